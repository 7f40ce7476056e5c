"""What this rank's averaging rounds moved: public counters, kept across elastic resets; and
what a network interface sent, as the kernel counts it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from .world import current_world

__all__ = ["TrafficCounters", "traffic", "reset_traffic", "count_round", "count_seconds",
           "record_route", "interface_tx_bytes"]


@dataclass
class TrafficCounters:
    """What averaging rounds moved on this rank since the last :func:`reset_traffic`.

    Attributes:
        global_allreduces: averaging rounds over all ranks.
        local_allreduces: rounds over smaller sets.
        bytes: payload bytes this rank handed to averaging, as they travel (float16 halves them).
        cross_node_bytes: the part of ``bytes`` handed to collectives whose members sit on more
            than one node (what crosses the link between nodes: a node-aware round hands them
            only this rank's share; counted when the placement is known, i.e. after
            ``hva.init()``).
        global_round_s, local_round_s: seconds inside rounds that finish before returning
            (levels without ``delay``), over all ranks or smaller sets: packing, checks and the
            wait for the collectives.
        launch_s: seconds starting delayed rounds (the snapshot, what travels, the first stage).
        poll_s: seconds moving delayed rounds on (one poll per training step, and the launch
            of each next stage).
        apply_wait_s: seconds waiting, at a delayed round's apply step, for what had not
            arrived yet.
        routes: ``{"[ranks], size": "node-aware (why)" or "flat (why)"}``: the way chosen for
            each set that can average node-aware and each size class, with the times measured
            (``HVA_ROUTE``; see :mod:`hvd_averaging.routes`).
    """

    global_allreduces: int = 0
    local_allreduces: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0
    global_round_s: float = 0.0
    local_round_s: float = 0.0
    launch_s: float = 0.0
    poll_s: float = 0.0
    apply_wait_s: float = 0.0
    routes: dict = field(default_factory=dict)


class _TrafficBook:
    """The counters of this process, handed from world to world (a reset does not zero them)."""

    survives_reset = True

    def __init__(self) -> None:
        self.counters = TrafficCounters()


def count_round(over_all_ranks: bool, nbytes: int, cross_node_bytes: int) -> None:
    """Add one round to this rank's counters."""
    counters = current_world().component(_TrafficBook).counters
    if over_all_ranks:
        counters.global_allreduces += 1
    else:
        counters.local_allreduces += 1
    counters.bytes += nbytes
    counters.cross_node_bytes += cross_node_bytes


def count_seconds(stage: str, seconds: float) -> None:
    """Add ``seconds`` to the counter named ``stage`` (one of the ``*_s`` fields)."""
    counters = current_world().component(_TrafficBook).counters
    setattr(counters, stage, getattr(counters, stage) + seconds)


def record_route(where: str, chosen: str) -> None:
    """Report the way chosen for a set and size class in the counters."""
    current_world().component(_TrafficBook).counters.routes[where] = chosen


def traffic() -> TrafficCounters:
    """A snapshot of this rank's traffic counters (see :class:`TrafficCounters`).

    Example::

        >>> hva.reset_traffic()
        >>> ...  # train
        >>> print(hva.traffic().cross_node_bytes / 1e6, "MB over the link between nodes")
    """
    counters = current_world().component(_TrafficBook).counters
    return replace(counters, routes=dict(counters.routes))


def reset_traffic() -> None:
    """Zero this rank's traffic counters."""
    current_world().component(_TrafficBook).counters = TrafficCounters()


def interface_tx_bytes(interface: str) -> Optional[int]:
    """Bytes sent by ``interface`` so far, from the kernel (``/proc/self/net/dev`` shows the
    interfaces of this process's network namespace: on an emulated node, the node's link), or
    None where there is no such interface."""
    try:
        lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    except OSError:
        return None
    for line in lines:
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # the transmit side's first counter: bytes
    return None
