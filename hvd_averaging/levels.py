"""How each level of an averager averages: its wire format (and the state that format keeps)
and, for a delayed level, the round it leaves in flight.

An averager owns one :class:`LevelRounds`; its :class:`~hvd_averaging.membership.Membership`
says over which set each level averages, and its schedule says when.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import horovod.torch as hvd
import torch

from .checkpoint import averager_state_error
from .delayed import AverageTransform, ConstructionOrder, start_delayed_average
from .delayed_rounds import DelayedRounds
from .rounds import average_tensors
from .wire import WireCodec
from .world import current_world

__all__ = ["LevelRounds"]

SetAt = Callable[[int], Optional[hvd.ProcessSet]]  # level -> this rank's set there, or None


class LevelRounds:
    """The rounds of one averager's levels: ``{level: delay}`` (0: averaged at its firing
    step) and ``{level: codec}``, each codec the level's own (it may keep state between rounds;
    a level without one travels as is), set by :meth:`configure`.

    Args:
        owner: the averager's name, for messages.
        check_finite: refuse to average NaN/Inf (see :class:`~hvd_averaging.ModelAverager`).
    """

    def __init__(self, owner: str, check_finite: bool) -> None:
        self.owner = owner
        self.check_finite = check_finite
        self.codecs: dict[int, WireCodec] = {}
        self._delayed = DelayedRounds({})
        # same order on every rank: tells apart the rounds two averagers leave in flight at once
        self._number = current_world().component(ConstructionOrder).next()

    def configure(self, delays: Mapping[int, int], codecs: Mapping[int, WireCodec],
                  pieces: Optional[Mapping[int, int]] = None) -> None:
        """Set the levels' delays, wire formats and, per delayed level, how many pieces its
        rounds may travel in (before the first round)."""
        self._delayed = DelayedRounds(delays, pieces)
        self.codecs = dict(codecs)

    @property
    def delays(self) -> dict[int, int]:
        return dict(self._delayed.delays)

    def set_transforms(self, level: int, transform: AverageTransform,
                       before_send: Optional[AverageTransform]) -> None:
        """See :meth:`~hvd_averaging.ModelAverager.transform_delayed_average`."""
        self._delayed.set_transforms(level, transform, before_send)

    def average(self, level: int, tensors: list[torch.Tensor],
                process_set: Optional[hvd.ProcessSet], step: int) -> None:
        """Average ``tensors`` at ``level`` over ``process_set`` (None: this rank sits out), now
        or, for a delayed level, starting a round applied ``delay`` steps later."""
        if process_set is None:
            return
        if self._delayed.delayed(level):
            self._start_delayed(tensors, process_set, level, step, None)
        else:
            average_tensors(tensors, process_set, check_finite=self.check_finite,
                            compression=self.codecs.get(level), context=f"{self.owner} step {step}")

    def advance(self, step: int, tensors: Callable[[], list[torch.Tensor]], set_at: SetAt) -> None:
        """Before ``step``'s schedule: restart rounds read from a checkpoint, apply those due."""
        if self._delayed.active:
            self._delayed.advance(step, lambda level, saved: self._start_delayed(
                tensors(), set_at(level), level, saved["fired_at"], saved))

    def keep_moving(self) -> None:
        """After ``step``'s schedule: launch the next stage or piece of the rounds in flight
        whose current one finished (no waiting)."""
        if self._delayed.active:
            self._delayed.keep_moving()

    def drop_in_flight(self) -> None:
        """Forget the rounds in flight: their collectives died with the world they ran in."""
        self._delayed.drop()

    def _start_delayed(self, tensors: list[torch.Tensor], process_set: Optional[hvd.ProcessSet],
                       level: int, fired_at: int, saved: Optional[dict]) -> None:
        if process_set is None:
            return
        round_ = start_delayed_average(
            tensors, process_set, op_tag=f".delayed{level}.a{self._number}",
            buffers=self._delayed.buffers.setdefault(level, {}), check_finite=self.check_finite,
            context=f"{self.owner} step {fired_at} (delay {self._delayed.delays[level]})",
            compression=self.codecs.get(level),
            snapshots=None if saved is None else saved["snapshots"],
            snapshot_layout=None if saved is None else saved["layout"],
            before_send=self._delayed.before_send.get(level),
            pieces=self._delayed.pieces.get(level, 1))
        self._delayed.launched(level, fired_at, round_)

    def wire_specs(self) -> dict[int, Any]:
        """``{level: spec}`` of the levels' wire formats, as ranks compare them."""
        return {level: codec.format.spec() for level, codec in self.codecs.items()}

    def state_dict(self) -> dict[str, Any]:
        """``wire`` (the formats' state, int8's residuals) and ``in_flight`` (the delayed rounds'
        snapshots), each only when there is some."""
        state: dict[str, Any] = {}
        wire = {level: kept for level, kept in
                ((level, codec.state_dict()) for level, codec in self.codecs.items()) if kept}
        if wire:
            state["wire"] = wire
        in_flight = self._delayed.state()
        if in_flight:
            state["in_flight"] = in_flight
        return state

    def state_error(self, state: Mapping[str, Any]) -> Optional[ValueError]:
        """What :meth:`load_state_dict` would reject in an averager's ``state`` (local)."""
        kept = {level: {name: tuple(value.shape) for name, value in
                        (c.state_dict().get("residuals") or {}).items()}
                for level, c in self.codecs.items() if c.keeps_state}
        return averager_state_error(state, self._delayed.delays, kept)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put in place a state :meth:`state_error` accepted on every rank."""
        self._delayed.load(state.get("in_flight") or {})
        for level, codec_state in (state.get("wire") or {}).items():
            if level in self.codecs:
                self.codecs[level].load_state_dict(codec_state)
