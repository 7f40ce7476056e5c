"""The interface of a wire format (what a round's buffers become while they travel).

A :class:`WireFormat` is a format's settings: frozen, compared across ranks, shared freely (the
public ``compression=`` values). It builds, along a :class:`~hvd_averaging.routes.Route`, the
:class:`~hvd_averaging.transports.Transport` that carries the buffers in that format. A
:class:`WireCodec` is one user's instance of a format (an averager level, or the rounds of one
spelling): the transports it built, so their buffers are reused round after round, and the state
the format carries between rounds (int8's error feedback residuals), owned by that user alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import horovod.torch as hvd
import torch

from ..routes import Route
from ..transports import Transport
from ..transports.base import Stages

__all__ = ["WireFormat", "WireCodec", "NonFiniteOnWire", "AgreeFinite"]


@dataclass(frozen=True)
class WireFormat(ABC):
    """A wire format's settings. Subclasses are frozen dataclasses (their fields are the
    settings) and name themselves in :mod:`.registry`."""

    name: ClassVar[str] = ""
    round_name: ClassVar[str] = "a round"  # in messages: "a float16 round cannot scale it"

    @abstractmethod
    def build(self, route: Route, state: Optional[Any]) -> Transport:
        """A new transport over ``route`` in this format; ``state``: :meth:`new_state`'s object."""

    def new_state(self) -> Optional[Any]:
        """What one user of the format carries between rounds (an object with ``state_dict`` and
        ``load_state_dict``), or None when the format keeps nothing."""
        return None

    def with_error_feedback(self) -> Optional["WireFormat"]:
        """This format keeping its quantization residuals, or None if it has none to keep."""
        return None

    def spec(self) -> Any:
        """Plain data ranks compare and checkpoints hold: the name, or the name and settings."""
        return self.name

    def codec(self) -> "WireCodec":
        """A new user of this format, with state of its own."""
        return WireCodec(self)


class WireCodec:
    """One user's instance of a :class:`WireFormat`: the transports built per route and the
    format's state between rounds."""

    def __init__(self, wire_format: WireFormat) -> None:
        self.format = wire_format
        self.state = wire_format.new_state()
        self._transports: dict[tuple, Transport] = {}

    @property
    def keeps_state(self) -> bool:
        return self.state is not None

    def transport(self, route: Route) -> Transport:
        """This format's transport over ``route`` (built once per route)."""
        found = self._transports.get(route.key)
        if found is None:
            found = self._transports[route.key] = self.format.build(route, self.state)
        return found

    def state_dict(self) -> dict[str, Any]:
        """The state kept between rounds (empty when the format keeps none)."""
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.state is not None:
            self.state.load_state_dict(state)

    def __repr__(self) -> str:
        return f"WireCodec({self.format!r})"


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

    def writes_in_place(self) -> bool:
        return self.inner.writes_in_place()

    def forget_buffers(self) -> None:
        self.inner.forget_buffers()
