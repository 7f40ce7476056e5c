"""Averaging overlapped with training: rounds left in flight (``delay`` in the averagers).

A :class:`DelayedAverage` is one round: at its start the tensors' values are copied into a
snapshot and the snapshot's average is launched; training goes on while its stages move on
Horovod's background thread, and at the apply step every tensor becomes
``average(snapshot) + (tensor - snapshot)``. :class:`~.delayed_rounds.DelayedRounds` is what an
averager keeps: at most one round in flight per level, when each is due, and their checkpoint
form.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import horovod.torch as hvd
import torch

from .agreement import check_same_on_all_ranks
from .deadlines import bounded_collective, guarded_enqueue
from .rounds import NonFiniteError, Round, abandon_round, begin_round, settle_timed_out
from .traffic import count_seconds
from .transports import InPieces

__all__ = ["AverageTransform", "DelayedAverage", "start_delayed_average", "ConstructionOrder"]

# (tensors of the round, a view of each one's average) -> None; may overwrite the averages.
AverageTransform = Callable[[list, list], None]


class ConstructionOrder:
    """Numbers this process's averagers in the order they are made (the same on every rank:
    construction is collective, or in elastic jobs runs the same script), so that two averagers'
    rounds in flight at once get different Horovod names. Kept across elastic resets."""

    survives_reset = True

    def __init__(self) -> None:
        self.made = 0

    def next(self) -> int:
        self.made += 1
        return self.made - 1


def _reused_like(buffers: dict, key: tuple, like: torch.Tensor) -> torch.Tensor:
    found = buffers.get(key)
    if found is None or found.shape != like.shape or found.dtype != like.dtype \
            or found.device != like.device:
        found = buffers[key] = torch.empty_like(like)
    return found


class DelayedAverage:
    """One averaging round left in flight while training goes on.

    :meth:`progress` (called once per training step, never waits) keeps its stages moving;
    :meth:`apply` waits for the rest (bounded by ``hva.timeout()`` counted from the start) and
    sets every tensor to ``average(snapshot) + (tensor - snapshot)``: the average of the models
    at the start plus the local progress made since.

    While the way of such rounds is being chosen (:mod:`~hvd_averaging.route_trials`), the
    round reports what it cost the training thread at its apply step (collective over its set
    at the last trial, where every member applies it).

    Memory: the snapshot and the buffer that travels (a copy of the tensors each, in their own
    dtype), plus the wire format's buffers (float16: half a copy more), kept in the averager's
    ``buffers`` for its next round. After a timeout the buffers a late write may still land in
    are dropped, and the next round allocates fresh ones once the abandoned round completed
    (:mod:`~hvd_averaging.abandoned_rounds`).
    """

    def __init__(self, round_: Round, buffers: dict, snapshots: Optional[list[torch.Tensor]],
                 before_send: Optional[AverageTransform] = None, pieces: int = 1):
        began = time.perf_counter()
        self._round = round_
        self.what = round_.what
        self._buffers = buffers
        self._snapshots = []
        wires = []
        for index, slab in enumerate(round_.packing.slabs):
            snapshot = _reused_like(buffers, ("snapshot", index), slab.flat)
            snapshot.copy_(snapshots[index] if snapshots is not None else slab.flat)
            self._snapshots.append(snapshot)
            wire = _reused_like(buffers, ("wire", index), slab.flat)
            wire.copy_(snapshot)
            wires.append(wire)
        if before_send is not None:
            with torch.no_grad():
                before_send(round_.packing.tensors, round_.packing.views_into(wires))
        pieces = pieces if not round_.codec.keeps_state else 1  # a state follows the whole buffer
        transport, self._trial = round_.transport_left_in_flight(pieces)
        if pieces > 1:
            transport = InPieces(transport, window=pieces)
        self._transport, self._wires = transport, wires
        self.started_at = time.monotonic()
        launching = time.perf_counter()
        with self._trial_abandoned_on_error(), guarded_enqueue(self.what):
            self._transfer = transport.start(wires, round_.op_names(), self.what)
        self.nbytes = round_.count(transport, wires)
        # what this round costs the training thread beyond its copies: its stages' launches,
        # its polls, its wait at the apply step (a trial of its way reports it)
        self._training_seconds = time.perf_counter() - launching
        count_seconds("launch_s", time.perf_counter() - began)

    @contextmanager
    def _trial_abandoned_on_error(self) -> Iterator[None]:
        """A round on trial that is never launched or applied gives its way back to be tried
        again."""
        try:
            yield
        except BaseException:
            if self._trial is not None:
                self._trial.abandon()
            raise

    @property
    def layout_digest(self) -> int:
        return self._round.packing.layout_digest

    def snapshots(self) -> list[torch.Tensor]:
        """Copies of the snapshot buffers (one per dtype), for a checkpoint."""
        return [s.clone() for s in self._snapshots]

    def finish_without_applying(self) -> None:
        """Let the round complete (bounded) and drop its result: before a checkpoint is loaded
        into the averager that started it (Horovod refuses a second round of the same name
        while one is in flight)."""
        if self._trial is not None:
            self._trial.abandon()
        try:
            self._wait()
        except NonFiniteError:
            pass

    def _wait(self) -> None:
        """Drive the round to its end, bounded by ``hva.timeout()`` counted from its start."""
        with bounded_collective(self.what, self.nbytes, started_at=self.started_at) as collective, \
                self._round.naming_non_finite():
            try:
                collective.drive([self._transfer])
            except BaseException as error:
                if not self._transfer.in_flight:
                    raise
                # The stage stays queued and may still write into the wire buffers: the next
                # round of this averager level gets fresh ones (the parameters are not
                # written: what travels is a copy).
                replacement = abandon_round(
                    self._round, self._transport, self._transfer, self._wires, error,
                    reused=[(self._buffers, ("wire", i)) for i in range(len(self._wires))])
                if replacement is error:
                    raise
                raise replacement from replacement.__cause__

    def progress(self) -> None:
        """Launch the next stage of every transfer whose current one finished; never waits.
        Costs one poll per dtype buffer while stages run; the watchdog is armed only around
        launches."""
        began = time.perf_counter()
        if self._transfer.ready():
            with guarded_enqueue(self.what), self._round.naming_non_finite():
                self._transfer.advance()
        spent = time.perf_counter() - began
        self._training_seconds += spent
        count_seconds("poll_s", spent)

    def apply(self, transform: Optional[AverageTransform] = None) -> None:
        """Wait for the average (bounded), then ``tensor = average + (tensor - snapshot)``.

        ``transform(tensors, averages)`` may first replace the averages in place (``averages``:
        one view per tensor of the round, in its order): DiLoCo's outer step puts the new global
        copy there, so that ``tensor = global + (tensor - snapshot)``.

        Raises:
            AveragingTimeoutError: not finished within ``hva.timeout()`` of its start.
            NonFiniteError: float16 and a NaN/Inf on some rank at the start.
            HorovodInternalError: Horovod failed or shut down meanwhile.
        """
        with self._trial_abandoned_on_error():
            waited = self._apply(transform)
        if self._trial is not None:  # after applying: an error in agreeing tears nothing
            self._trial.report(self._training_seconds + waited)

    def _apply(self, transform: Optional[AverageTransform]) -> float:
        """:meth:`apply`'s work; the seconds it waited for the round."""
        began = time.perf_counter()
        self._wait()
        waited = time.perf_counter() - began
        count_seconds("apply_wait_s", waited)
        if not self._round.packing.still_bound():
            raise RuntimeError(
                f"{self.what}: a tensor's .data was replaced (model.to(), load_state_dict(assign="
                "True)) while its round was in flight, so the round cannot be applied to it")
        averages = self._transfer.result
        with torch.no_grad():
            if transform is not None:
                transform(self._round.packing.tensors, self._round.packing.views_into(averages))
            for slab, snapshot, average in zip(self._round.packing.slabs, self._snapshots,
                                               averages):
                slab.copy_in()  # tensors copied through their slot moved on since the start
                torch.sub(slab.flat, snapshot, out=snapshot)  # the local progress
                slab.flat.copy_(average)
                slab.flat.add_(snapshot)
                slab.copy_out()
        return waited


def start_delayed_average(
    tensors: list[torch.Tensor],
    process_set: Optional[hvd.ProcessSet] = None,
    *,
    buffers: dict,
    op_tag: str,
    name: str = "params",
    check_finite: bool = False,
    context: str = "averaging",
    compression=None,
    node_aware: Optional[bool] = None,
    snapshots: Optional[list[torch.Tensor]] = None,
    snapshot_layout: Optional[int] = None,
    before_send: Optional[AverageTransform] = None,
    pieces: int = 1,
) -> Optional[DelayedAverage]:
    """Start averaging ``tensors`` over ``process_set`` and return without waiting (collective).

    ``buffers`` is the caller's dict where the round's snapshot and wire buffers are kept for
    the next round (one round in flight per dict); ``op_tag`` tells its collectives apart from
    other rounds over the same tensors. ``snapshots`` and ``snapshot_layout`` (from
    :meth:`DelayedAverage.snapshots` and ``layout_digest``) restart a round from a checkpoint:
    the same snapshot is averaged again, so the result is the one the interrupted round would
    have given. ``before_send(tensors, wire_views)`` may change, in place, what travels (a copy
    of the snapshot; the snapshot itself is kept): DiLoCo subtracts its global copy, so that the
    progress since it is averaged. ``pieces > 1`` cuts what travels into pieces that take at most
    that many stages in all (none under :data:`~hvd_averaging.transports.in_pieces.MIN_PIECE_BYTES`),
    one stage launched per :meth:`DelayedAverage.progress`, so that other rounds pass between them; a wire format
    that keeps state (int8 with error feedback) travels whole. Returns None where :func:`~hvd_averaging.rounds.average_tensors` would move
    nothing. Raises what it raises before data moves, and ``ValueError`` (on every member) when
    ``snapshots`` do not fit the tensors.
    """
    round_ = begin_round(tensors, process_set, name=name, bind=True, check_finite=check_finite,
                         context=context, compression=compression, node_aware=node_aware)
    if round_ is None:
        return None
    round_.op_tag = op_tag
    settle_timed_out(round_)
    if snapshots is not None:
        slabs = round_.packing.slabs
        fits = snapshot_layout == round_.packing.layout_digest and len(snapshots) == len(slabs) \
            and all(s.shape == slab.flat.shape and s.dtype == slab.flat.dtype
                    for s, slab in zip(snapshots, slabs))
        error = None if fits else ValueError(
            f"{round_.what}: the checkpoint's in-flight snapshot does not fit these tensors "
            "(different parameters, shapes or dtypes than when it was saved)")
        check_same_on_all_ranks(f"{round_.what} snapshot from the checkpoint", True,
                                local_error=error, process_set=round_.process_set,
                                name=f"hva.snapshot.{round_.process_set.process_set_id}.{name}")
    return DelayedAverage(round_, buffers, snapshots, before_send, pieces)
