"""Rounds this rank stopped waiting for while their collectives stay queued in Horovod.

A round's wait can end before its collectives do: :class:`~.deadlines.AveragingTimeoutError`,
``KeyboardInterrupt``, an exception a SIGTERM handler raises to save a checkpoint. Horovod
offers no way to cancel a queued collective: it completes when the late rank arrives, and
writes its result then (a flat allreduce in place, into the buffers it was handed), and until
then Horovod holds its tensors and refuses another collective of the same name. So an abandoned
round must keep that late write away from everything this rank uses afterwards
(:func:`abandon`), and the set's next round first waits for it, bounded, and lets it go
(:func:`settle`). Memory: a set keeps at most the rounds that were in flight over it when its
wait ended (:func:`bytes_held_by_timed_out_rounds`).
"""

from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch

from .deadlines import AveragingTimeoutError, bounded_collective
from .flat_storage import Packing, StorageMoveError
from .transports import Transfer, Transport
from .world import current_world

__all__ = ["AbandonedRounds", "abandon", "settle", "bytes_held_by_timed_out_rounds"]


class AbandonedRounds:
    """This world's abandoned rounds, per process set (the collectives of an older world died
    with it)."""

    def __init__(self) -> None:
        self.pending: dict[int, list[tuple[Transfer, int, str]]] = {}  # set id -> rounds

    def keep(self, process_set: hvd.ProcessSet, transfer: Transfer, nbytes: int,
             what: str) -> None:
        self.pending.setdefault(process_set.process_set_id, []).append((transfer, nbytes, what))

    def held_bytes(self) -> int:
        return sum(nbytes for rounds in self.pending.values() for _, nbytes, _ in rounds)

    def settle(self, process_set: hvd.ProcessSet, what: str) -> None:
        """Wait (bounded by ``hva.timeout()`` per round) until the set's abandoned rounds
        complete, then synchronize their handles, which releases what Horovod holds of them.

        Raises:
            AveragingTimeoutError: one is still queued (its late rank has not arrived); names
                it, and ``what``, which launched nothing.
        """
        rounds = self.pending.get(process_set.process_set_id)
        while rounds:
            transfer, _, earlier = rounds[0]
            with bounded_collective(f"{what}, before it starts: {earlier}, abandoned earlier "
                                    "and still queued in Horovod", 0) as collective:
                collective.wait(transfer.handles)
            rounds.pop(0)
        self.pending.pop(process_set.process_set_id, None)


def bytes_held_by_timed_out_rounds() -> int:
    """Bytes this rank's abandoned rounds still hold in Horovod's queue, until the late rank
    arrives and the set's next round lets them go: for a round Horovod writes in place, the
    parameters' old flat storage (their size exactly); for the others, the wire bytes of the
    round (float16's staging copy; an estimate for int8 and node-aware stages). 0 when none."""
    return current_world().component(AbandonedRounds).held_bytes()


def settle(process_set: hvd.ProcessSet, what: str) -> None:
    """Before a round over ``process_set`` launches anything: the set's abandoned rounds
    complete first (:meth:`AbandonedRounds.settle`). Costs nothing when there are none."""
    abandoned = current_world().component(AbandonedRounds)
    if abandoned.pending:
        abandoned.settle(process_set, what)


def _with_note(error: BaseException, note: str, cause: BaseException) -> BaseException:
    """``error`` with ``note``: an :class:`AveragingTimeoutError` says it in its message (a new
    one, chained to ``cause``), any other exception (``KeyboardInterrupt``) carries a note."""
    if isinstance(error, AveragingTimeoutError):
        replacement = AveragingTimeoutError(f"{error} {note}")
        replacement.__cause__ = cause
        return replacement
    error.add_note(note)
    return error


def abandon(packing: Packing, process_set: hvd.ProcessSet, what: str, transport: Transport,
            transfer: Transfer, buffers: list[torch.Tensor], error: BaseException,
            reused: Optional[list[tuple[dict, object]]] = None) -> BaseException:
    """After ``error`` stopped the wait for ``transfer`` over ``buffers`` while its stage is
    still queued in Horovod: keep the round's late write away from everything this rank uses
    from now on, and return what to raise.

    The transfer launches nothing more and is kept until the set's next round. Buffers kept
    for later rounds are dropped, so the next round gets fresh ones: ``reused`` ((dict, key)
    pairs: gradient buffers, a delayed round's wire buffers) and the transport's staging copies
    (float16's). Where Horovod writes in place into the flat storage the tensors of ``packing``
    live in, they move to new storage (:meth:`~.flat_storage.Packing.move_to_new_storage`,
    all or nothing); where that fails, or they had to move to host memory, the error says so
    (an :class:`AveragingTimeoutError` stays one, chained to the failure). Rounds that never
    write in place (float16, int8, node-aware stages with several ranks per node) move nothing.
    """
    transfer.abandon()
    in_place = transport.writes_in_place()
    transport.forget_buffers()
    for store, key in reused or []:
        store.pop(key, None)
    held = sum(b.numel() * b.element_size() for b in buffers) if in_place \
        else transport.wire_bytes(buffers)
    current_world().component(AbandonedRounds).keep(process_set, transfer, held, what)
    slabs = packing.slabs
    if not (in_place and any(slab.bound for slab in slabs)
            and any(b is slab.flat for b in buffers for slab in slabs)):
        return error
    try:
        # a blocking round that writes in place has one stage: ready() means it is complete
        host = packing.move_to_new_storage(finished=transfer.ready)
    except StorageMoveError as failure:
        return _with_note(error, (
            f"The parameters could not be moved out of the round's reach ({failure}): if a "
            "late rank arrives, the round's average is written into them."), failure)
    if host is None:
        return error
    return _with_note(error, (
        f"The parameters' device could not hold a second copy of them: they now live in host "
        f"memory ({host}), out of the round's reach; move the model back (model.to(...)) "
        "before training on."), error)
