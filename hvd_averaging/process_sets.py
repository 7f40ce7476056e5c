"""Horovod process sets, shared: one registry per world hands out each set of ranks once.

Horovod refuses to register a set twice, so averagers, routes and user code all take their
sets from :func:`process_set`. Registering a new set is collective over all ranks and must
happen in the same order everywhere.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

import horovod.torch as hvd
from horovod.torch.mpi_ops import _basics

from .deadlines import blocking_call
from .placement import rank_to_node
from .topology import group_of, level_groups
from .world import current_world

__all__ = [
    "process_set",
    "members",
    "register_groups",
    "local_process_set",
    "dynamic_process_sets_enabled",
    "registered_process_sets",
    "ProcessSetRegistry",
    "ProcessSetNotRegistered",
]


class ProcessSetNotRegistered(RuntimeError):
    """A set that is not registered, where Horovod runs without dynamic process sets."""


def dynamic_process_sets_enabled() -> bool:
    """True when Horovod accepts ``hvd.add_process_set`` (initialized with ``"dynamic"``)."""
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower() in ("1", "true", "yes", "on")


def registered_process_sets() -> dict[int, list[int]]:
    """Horovod's registered process sets: ``{process_set_id: sorted ranks}``."""
    return {int(k): sorted(v) for k, v in _basics._get_process_set_ids_and_ranks().items()}


def members(process_set: hvd.ProcessSet) -> list[int]:
    """Global ranks of ``process_set``, ascending."""
    return sorted(process_set.ranks) if process_set.ranks else list(range(hvd.size()))


class ProcessSetRegistry:
    """The sets this world handed out, by their sorted ranks (a component of the world)."""

    def __init__(self) -> None:
        self._by_ranks: dict[tuple[int, ...], hvd.ProcessSet] = {}

    def get(self, key: tuple[int, ...]) -> hvd.ProcessSet:
        cached = self._by_ranks.get(key)
        if cached is not None and cached.process_set_id is not None:
            return cached
        for set_id, set_ranks in registered_process_sets().items():
            if tuple(set_ranks) == key:  # registered at init or by user code
                found = hvd.ProcessSet(list(key))
                found.process_set_id = set_id
                self._by_ranks[key] = found
                return found
        if not dynamic_process_sets_enabled():
            raise ProcessSetNotRegistered(
                f"process set for ranks {list(key)} is not registered and Horovod was initialized "
                "without dynamic process sets. Register its level at start-up (hva.init("
                f"group_sizes=[..., {len(key)}]) or hvd.init(process_sets=[hvd.ProcessSet({list(key)}), "
                "...])), or call hva.init() without group_sizes (dynamic process sets)")
        # collective and blocking inside Horovod (no handle to poll): the watchdog bounds it
        with blocking_call(f"registering process set {list(key)} (hvd.add_process_set)"):
            created = self._by_ranks[key] = hvd.add_process_set(list(key))
        return created


def process_set(ranks: Iterable[int]) -> hvd.ProcessSet:
    """The registered ``hvd.ProcessSet`` for exactly ``ranks``, registering it if needed.

    Collective when the set is new: every rank must call it with the same ranks, in the same
    order as its other calls. A set that exists (registered at init, by an earlier call, or by
    user code through this function) is returned, never registered twice.

    Raises:
        ValueError: ``ranks`` is empty, has duplicates or ranks outside ``0..size-1``.
        RuntimeError: the set does not exist and Horovod runs without dynamic process sets.

    Example::

        >>> # every rank registers every set, in the same order (not only the set it is in):
        >>> pairs = [hva.process_set([0, 1]), hva.process_set([2, 3])]
    """
    world = current_world()
    ranks = list(ranks)
    if not ranks:
        raise ValueError("process_set([]) : a process set needs at least one rank")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"process set ranks must be integers, got {r!r} in {ranks}")
    key = tuple(sorted(ranks))
    if len(set(key)) != len(key):
        raise ValueError(f"process set ranks {ranks} contain duplicates")
    if key[0] < 0 or key[-1] >= world.size:
        raise ValueError(f"process set ranks {ranks} must lie in 0..{world.size - 1} (Horovod size "
                         f"{world.size})")
    if key == tuple(range(world.size)):
        return hvd.global_process_set
    return world.component(ProcessSetRegistry).get(key)


def register_groups(parent: hvd.ProcessSet, groups: list[list[int]]) -> Optional[hvd.ProcessSet]:
    """Register every group of one level (collective, same order on every rank) and return the
    set of this rank's group, or None on ranks outside ``parent``. A group equal to ``parent``
    is ``parent`` itself."""
    parent_ranks = members(parent)
    sets = [parent if group == parent_ranks else process_set(group) for group in groups]
    if hvd.rank() not in parent_ranks:
        return None
    return sets[groups.index(group_of(groups, hvd.rank()))]


def local_process_set(parent: Optional[hvd.ProcessSet] = None,
                      group_size: Optional[int] = None) -> Optional[hvd.ProcessSet]:
    """This rank's node-local group inside ``parent`` (default: all ranks), as a process set.

    ``group_size`` defaults to the number of ``parent``'s ranks on this rank's node (which must
    be the same on every node); a smaller size makes groups inside a node, a larger one groups of
    whole nodes (the same node-major rule as the hierarchical averager). Collective: every rank
    registers every group, in the same order. Returns None on ranks outside ``parent``.

    Raises:
        ValueError: nodes hold different numbers of ``parent``'s ranks and no ``group_size`` was
            given, or ``group_size`` does not fit the placement.

    Example::

        >>> node = hva.local_process_set()   # the ranks on this rank's node
    """
    parent = parent if parent is not None else hvd.global_process_set
    ranks = members(parent)
    nodes = rank_to_node()
    local_nodes = [nodes[r] for r in ranks]
    if group_size is None:
        counts = {n: local_nodes.count(n) for n in local_nodes}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"nodes hold different numbers of ranks {sorted(counts.values())}: give the "
                "local group size explicitly")
        group_size = next(iter(counts.values()))
    groups = [[ranks[i] for i in g] for g in level_groups(local_nodes, group_size)]
    return register_groups(parent, groups)
