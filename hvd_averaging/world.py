"""The Horovod world this process is in, and everything the library knows that belongs to it.

A :class:`World` is made by :func:`hvd_averaging.init` and replaced whenever Horovod starts
again (an elastic reset shuts Horovod down and initializes it anew, which drops every process
set and reassigns their ids, horovod#4021). It owns the MPI communicator Horovod runs over, the
node placement, and one instance of each per-world component that the layers above keep (the
process-set registry, routes, agreed layouts and packings, traffic counters): so nothing of an
old world survives a reset by accident, and nothing has to be cleared from several places.

Averagers remember the :attr:`World.generation` their process sets were made for
(:class:`WorldFollower`) and make them again when it changes.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, TypeVar

import horovod.torch as hvd

from .deadlines import check_environment

__all__ = ["World", "WorldFollower", "current_world", "start_world", "renew_world"]

T = TypeVar("T")


class World:
    """What this process knows about one Horovod world (one ``hvd.init``).

    Attributes:
        generation: 1 for the first world of this process, one more for each new one.
        mpi_comm: the ``mpi4py`` communicator Horovod was initialized over (None: MPI's world,
            or Gloo).
        size: Horovod's size when the world was made.
    """

    def __init__(self, generation: int, mpi_comm=None,
                 placement: Optional[list[Hashable]] = None,
                 carried: Optional[dict] = None) -> None:
        self.generation = generation
        self.mpi_comm = mpi_comm
        self.size = hvd.size()
        self._placement = list(placement) if placement is not None else None
        self._components: dict = dict(carried or {})

    @property
    def placement(self) -> Optional[list[Hashable]]:
        """The node of every rank, once known (see :func:`hvd_averaging.placement.rank_to_node`)."""
        return list(self._placement) if self._placement is not None else None

    def learn_placement(self, placement: list[Hashable]) -> None:
        self._placement = list(placement)

    def component(self, factory: Callable[[], T]) -> T:
        """This world's instance of a component (made by ``factory()`` on first use). A class
        with ``survives_reset = True`` (traffic counters) is handed on to the next world."""
        found = self._components.get(factory)
        if found is None:
            found = self._components[factory] = factory()
        return found

    def _carried(self) -> dict:
        return {key: value for key, value in self._components.items()
                if getattr(key, "survives_reset", False)}


# The current world of this process (None before Horovod starts).
_current: Optional[World] = None


def _require_initialized() -> None:
    if not hvd.is_initialized():
        raise RuntimeError("hvd_averaging needs Horovod: call hva.init() (or hvd.init()) first")


def start_world(mpi_comm=None, placement: Optional[list[Hashable]] = None) -> World:
    """A new world right after ``hvd.init`` (``hva.init`` calls it)."""
    global _current
    _require_initialized()
    check_environment()  # a malformed HVA_* setting fails here, not in a later timeout
    previous = _current
    _current = World(previous.generation + 1 if previous else 1, mpi_comm, placement,
                     previous._carried() if previous else None)
    return _current


def renew_world() -> World:
    """A new world after Horovod was initialized again (an elastic reset): local, no collective."""
    previous = _current
    return start_world(previous.mpi_comm if previous else None)


def current_world() -> World:
    """The current world; a new one when Horovod was started by the user (``hvd.init``) or its
    size changed since (a reset that was not announced)."""
    _require_initialized()
    if _current is None or _current.size != hvd.size():
        return renew_world()
    return _current


class WorldFollower:
    """Which world an averager's process sets were made for (None: not made yet)."""

    def __init__(self) -> None:
        self.generation: Optional[int] = None

    @property
    def started(self) -> bool:
        return self.generation is not None

    def behind(self) -> bool:
        """True when the sets were never made, or were made for an older world."""
        return self.generation != current_world().generation

    def caught_up(self) -> None:
        self.generation = current_world().generation
