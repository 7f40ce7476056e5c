"""What an averager keeps of its delayed levels: at most one round in flight per level
(:class:`~.delayed.DelayedAverage`), when each is due, and their checkpoint form."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from .delayed import AverageTransform, DelayedAverage

__all__ = ["DelayedRounds"]


class DelayedRounds:
    """An averager's delayed levels: ``{period: delay}``, the round in flight per level with the
    step it is due at, and rounds read from a checkpoint, restarted at the next call.

    The averager launches rounds (it knows the tensors and sets) and hands each one to
    :meth:`launched`; :meth:`advance` calls it back to restart a checkpoint's round.
    """

    def __init__(self, delays: Mapping[int, int], pieces: Optional[Mapping[int, int]] = None) -> None:
        self.delays = dict(delays)
        self.pieces = dict(pieces or {})  # per level: its rounds travel in up to this many pieces
        self.transforms: dict[int, AverageTransform] = {}  # per level, applied before the average
        self.before_send: dict[int, Optional[AverageTransform]] = {}  # per level, on what travels
        self.buffers: dict[int, dict] = {}
        self._in_flight: dict[int, tuple[int, DelayedAverage]] = {}
        self._to_restart: dict[int, dict] = {}

    def delayed(self, level: int) -> bool:
        return bool(self.delays.get(level))

    def set_transforms(self, level: int, transform: AverageTransform,
                       before_send: Optional[AverageTransform]) -> None:
        """What ``level``'s rounds apply to their average, and to what they send (None: as is).

        Raises:
            ValueError: ``level`` is not delayed.
        """
        if not self.delayed(level):
            raise ValueError(f"level {level!r} is not delayed (delays per level "
                             f"{self.delays}): its average is applied at its firing step")
        self.transforms[level] = transform
        self.before_send[level] = before_send

    @property
    def active(self) -> bool:
        return bool(self._in_flight or self._to_restart)

    def launched(self, level: int, fired_at: int, round_: Optional[DelayedAverage]) -> None:
        if round_ is not None:
            self._in_flight[level] = (fired_at + self.delays[level], round_)

    def advance(self, step: int, restart: Callable[[int, dict], None]) -> None:
        """Restart rounds read from a checkpoint (``restart(level, saved)``) and apply those due
        at ``step``."""
        for level, saved in sorted(self._to_restart.items()):
            del self._to_restart[level]
            restart(level, saved)
        for level, (apply_at, round_) in sorted(self._in_flight.items()):
            if step >= apply_at:
                del self._in_flight[level]
                round_.apply(self.transforms.get(level))

    def keep_moving(self) -> None:
        """Launch the next stage or piece of every round in flight whose current one finished
        (a poll each: no waiting). The averager calls it after the step's own round, so that
        round does not queue behind a piece launched just before it."""
        for _, round_ in self._in_flight.values():
            round_.progress()

    def drop(self) -> None:
        """Forget every round: their collectives died with the world they ran in."""
        self._in_flight.clear()
        self._to_restart.clear()

    def state(self) -> dict[int, dict]:
        """The rounds in flight as a checkpoint holds them (fired step, layout, snapshots)."""
        saved: dict[int, Any] = {
            level: {"fired_at": apply_at - self.delays[level], "layout": r.layout_digest,
                    "snapshots": r.snapshots()}
            for level, (apply_at, r) in self._in_flight.items()}
        saved.update(self._to_restart)
        return saved

    def load(self, in_flight: Mapping) -> None:
        """Finish the rounds in flight without applying them, then take the checkpoint's (checked
        beforehand by :func:`hvd_averaging.checkpoint.averager_state_error` on every rank)."""
        for _, round_ in self._in_flight.values():
            round_.finish_without_applying()
        self._in_flight.clear()
        self._to_restart = {level: dict(saved) for level, saved in in_flight.items()}
