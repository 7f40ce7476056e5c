"""What this rank's averaging rounds moved: public counters, kept across elastic resets; and
what a network interface sent, as the kernel counts it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from .world import current_world

__all__ = ["TrafficCounters", "traffic", "reset_traffic", "count_round", "interface_tx_bytes"]


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
    """

    global_allreduces: int = 0
    local_allreduces: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0


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


def traffic() -> TrafficCounters:
    """A snapshot of this rank's traffic counters (see :class:`TrafficCounters`).

    Example::

        >>> hva.reset_traffic()
        >>> ...  # train
        >>> print(hva.traffic().cross_node_bytes / 1e6, "MB over the link between nodes")
    """
    return replace(current_world().component(_TrafficBook).counters)


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
