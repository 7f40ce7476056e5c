"""A :class:`Route`: which process sets one averaging round crosses, and the transport it
takes along them in the buffers' own dtype; a :class:`RouteChoice`: node-aware or flat, and
why (:mod:`.routes` decides which route a set takes)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import horovod.torch as hvd

from .transports import FlatAllreduce, NodeAware, ReduceScatterAllgather, Transport

__all__ = ["Route", "MeasuredAs", "RouteChoice"]


class Route(NamedTuple):
    """Which sets a round over ``process_set`` crosses.

    ``node_set``/``rail_set`` are set for node-aware rounds (``node_set`` None with one rank per
    node, the rail then being the set itself); ``rail_allreduce`` says whether a float rail
    crosses with one allreduce (Gloo) or reduce-scatter plus allgather (Open MPI), and
    ``scatter_by_alltoall`` whether the node's reduce-scatter is an alltoall and a local sum
    (Gloo) or Horovod's reduce-scatter (Open MPI).
    """

    process_set: hvd.ProcessSet
    members: int
    crosses_nodes: bool
    node_aware: bool = False
    node_set: Optional[hvd.ProcessSet] = None
    rail_set: Optional[hvd.ProcessSet] = None
    ranks_per_node: int = 1
    nodes: int = 1
    rail_allreduce: bool = False
    scatter_by_alltoall: bool = False

    @property
    def key(self) -> tuple:
        """Equal for routes over the same sets (ids are reused after an elastic reset: the
        members tell such sets apart)."""
        def ident(s: Optional[hvd.ProcessSet]) -> tuple:
            return (None,) if s is None else (s.process_set_id, tuple(s.ranks or ()))
        return (*ident(self.process_set), self.node_aware, *ident(self.node_set),
                *ident(self.rail_set))

    def float_transport(self) -> Transport:
        """The route in the buffers' own dtype."""
        if not self.node_aware:
            return FlatAllreduce(self.process_set, self.crosses_nodes)
        return self.node_aware_with(self.float_rail())

    def float_rail(self) -> Transport:
        if self.rail_allreduce:
            return FlatAllreduce(self.rail_set, True)
        return ReduceScatterAllgather(self.rail_set, self.nodes, True)

    def node_aware_with(self, rail: Transport) -> NodeAware:
        """Node-aware stages with ``rail`` crossing the link."""
        return NodeAware(self.node_set, rail, self.ranks_per_node, whole_set=self.process_set,
                         scatter_by_alltoall=self.scatter_by_alltoall)


# (a wire format's name, what builds its transport along a route): what a measurement times
MeasuredAs = tuple[str, Callable[["Route"], Transport]]


class RouteChoice(NamedTuple):
    """Node-aware or flat for a set and a size class, and why (``seconds``: what was measured)."""

    node_aware: bool
    why: str
    seconds: Optional[dict] = None
