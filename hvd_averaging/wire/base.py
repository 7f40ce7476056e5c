"""The interface of a wire format (what a round's buffers become while they travel), and the
route it is applied to.

A :class:`WireCodec` turns a :class:`Route` (which sets a round crosses: one flat set, or node
groups and rails) into a :class:`~hvd_averaging.transports.Transport`. Formats that keep state
between rounds (int8's error feedback) keep it in the codec, whose owner is the averager level
that holds it; a codec also keeps the transports it built, so their buffers are reused round
after round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Optional

import horovod.torch as hvd
import torch

from ..transports import FlatAllreduce, NodeAware, ReduceScatterAllgather, Transport
from ..transports.base import Stages

__all__ = ["Route", "WireCodec", "NonFiniteOnWire", "AgreeFinite"]


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


class WireCodec(ABC):
    """A wire format: builds the transport a route takes in it; may keep state across rounds."""

    name: str = ""
    round_name: str = "a round"  # in messages: "a float16 round cannot scale it"
    keeps_state: bool = False  # state carried from round to round (int8's error feedback)

    def __init__(self) -> None:
        self._transports: dict[tuple, Transport] = {}

    def transport(self, route: Route) -> Transport:
        """This format's transport over ``route`` (built once per route)."""
        found = self._transports.get(route.key)
        if found is None:
            found = self._transports[route.key] = self.build(route)
        return found

    @abstractmethod
    def build(self, route: Route) -> Transport:
        """A new transport over ``route`` in this format."""

    def check_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Raise ``ValueError`` if this format cannot carry ``tensors`` (local, before any
        collective); every format carries what a round accepts."""

    def spec(self) -> Any:
        """What ranks compare to agree on the format (a name, or a name and its settings)."""
        return self.name

    def state_dict(self) -> dict[str, Any]:
        """State kept between rounds (none unless the format keeps some)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NonFiniteOnWire(ValueError):
    """A rank's buffer holds NaN or Inf; raised on every member (``rank``: the highest such rank)."""

    def __init__(self, rank: int, wire: str):
        super().__init__(f"rank {rank} holds NaN/Inf in a buffer to average over {wire}")
        self.rank = rank


class AgreeFinite(Transport):
    """Before ``inner`` moves anything, the members agree (one small Max-allreduce) on whether
    any of them holds NaN/Inf; if one does, every member raises :class:`NonFiniteOnWire`.

    Needed where a NaN would not travel as itself: a block scale of NaN, or a requantized
    chunk, would spread garbage instead of the NaN a float round would carry.
    """

    def __init__(self, inner: Transport, process_set: hvd.ProcessSet, wire: str):
        self.inner = inner
        self.process_set = process_set
        self.wire = wire

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        bad = not all(bool(torch.isfinite(b).all()) for b in buffers)
        (agreed,) = yield [hvd.allreduce_async(
            torch.tensor([float(hvd.rank()) if bad else -1.0], dtype=torch.float64), op=hvd.Max,
            process_set=self.process_set, name=f"{names[0]}.finite")]
        if agreed[0] >= 0:
            raise NonFiniteOnWire(int(agreed[0]), self.wire)
        return (yield from self.inner.stages(buffers, names))

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.wire_bytes(buffers)

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.cross_node_bytes(buffers)
