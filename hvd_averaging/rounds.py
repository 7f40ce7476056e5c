"""Averaging rounds: what every round does whichever way its tensors travel.

A round packs the tensors (:mod:`.flat_storage`: one flat buffer per dtype that parameters view
into, so nothing is copied per round), checks them, agrees on their layout across the set,
counts traffic (:mod:`.traffic`), takes the way its set travels (:mod:`.routes`) and bounds the
wait (:mod:`.deadlines`). :func:`average_tensors` finishes the round before returning;
:mod:`.delayed` leaves one in flight while training goes on.

Design, chosen because of Horovod 0.28.1 hazards (``shared/horovod-hazards``): grouped
collectives share one group-id counter per process across all process sets, so a grouped call on
a subset of ranks makes a later grouped call on another set hang; and a grouped call after a used
set was removed hangs too. Plain ``*_async`` collectives have neither problem. So there is one
chain of collectives per dtype, never one per tensor, all dtype buffers are in flight at once,
and each collective has a stable name so Horovod's response cache hits step after step.
bfloat16 (absent from Horovod's torch ops, horovod#4047) travels as float32.

Ranks must agree on what they average, or Horovod hangs (a dtype only some ranks have) or
silently averages unrelated tensors (equal sizes, different shapes). One small allgather compares
a digest of the layout (dtypes, shapes) and the wire format across the set the first time a list
of tensors is averaged over a set, and whenever the list, its layout or the format changes;
rounds over the same tensors add no collective. (A list that changes on some ranks only is
caught by the timeout.)
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import horovod.torch as hvd
import torch

from .abandoned_rounds import abandon, settle
from .agreement import check_same_on_all_ranks, config_digest
from .deadlines import bounded_collective
from .flat_storage import Packing
from .params import TensorsLike, check_local_layout, collect_parameters, first_non_finite
from .process_sets import members
from .route_trials import Trial
from .round_book import RoundBook
from .routes import routes
from .traffic import count_round, count_seconds
from .transports import Transfer, Transport
from .wire import NonFiniteOnWire, WireCodec, WireFormat, wire_format
from .world import current_world

__all__ = ["NonFiniteError", "Round", "OneShotCodecs", "begin_round", "settle_timed_out",
           "abandon_round", "average_tensors", "average_parameters"]


class NonFiniteError(ValueError):
    """A tensor to average holds NaN or Inf (raised with ``check_finite=True``, and always
    before a float16 or int8 round, where it would make the scales meaningless)."""


@dataclass
class Round:
    """A round whose tensors are packed, checked and agreed on, ready to travel."""

    packing: Packing
    process_set: hvd.ProcessSet
    set_ranks: list[int]
    name: str
    what: str
    codec: WireCodec
    node_aware: Optional[bool]
    op_tag: str = ""  # tells apart rounds over the same tensors in flight at once

    def _measured_as(self) -> tuple[int, tuple]:
        nbytes = sum(slab.flat.numel() * slab.flat.element_size() for slab in self.packing.slabs)
        wire = self.codec.format
        return nbytes, (str(wire.spec()), lambda route: wire.build(route, None))  # no state

    def transport(self) -> Transport:
        """The way this round travels (chosen for blocking rounds)."""
        nbytes, measured_as = self._measured_as()
        return self.codec.transport(routes().route(
            self.process_set, nbytes, self.node_aware, measured_as,
            self.packing.slabs[0].flat.device))

    def transport_left_in_flight(self, pieces: int) -> tuple[Transport, Optional[Trial]]:
        """The way this round travels when left in flight (in up to ``pieces`` pieces), and
        the trial it reports its cost to while that way is being chosen (:mod:`.route_trials`)."""
        nbytes, measured_as = self._measured_as()
        route, trial = routes().left_in_flight(
            self.process_set, nbytes, self.node_aware, measured_as,
            self.packing.slabs[0].flat.device, self.codec.keeps_state, pieces)
        return self.codec.transport(route), trial

    def op_names(self) -> list[str]:
        """One stable name per dtype buffer (Horovod's response cache hits round after round)."""
        prefix = f"hva.{self.process_set.process_set_id}.{self.name}{self.op_tag}"
        return [f"{prefix}.{str(slab.dtype).replace('torch.', '')}" for slab in self.packing.slabs]

    def count(self, transport: Transport, buffers: list[torch.Tensor]) -> int:
        """Count the round in the traffic counters; its payload bytes as they travel."""
        nbytes = transport.wire_bytes(buffers)
        count_round(len(self.set_ranks) == hvd.size(), nbytes, transport.cross_node_bytes(buffers))
        return nbytes

    @contextmanager
    def naming_non_finite(self) -> Iterator[None]:
        """Turn a transport's NaN/Inf verdict (agreed on by every rank) into a
        :class:`NonFiniteError` that names the tensor on the rank that has it."""
        try:
            yield
        except NonFiniteOnWire as error:
            where = first_non_finite(self.packing) if error.rank == hvd.rank() else None
            raise NonFiniteError(f"{self.what}: " + (
                f"{where}; {self.codec.format.round_name} cannot scale it" if where else
                f"rank {error.rank} holds NaN/Inf (see its error); nothing was averaged")) from None


def settle_timed_out(round_: Round) -> None:
    """Before ``round_`` launches anything, its set's abandoned rounds complete and are let go
    (:meth:`~.abandoned_rounds.AbandonedRounds.settle`)."""
    settle(round_.process_set, round_.what)


def abandon_round(round_: Round, transport: Transport, transfer: Transfer,
                  buffers: list[torch.Tensor], error: BaseException,
                  reused: Optional[list[tuple[dict, object]]] = None) -> BaseException:
    """After ``error`` stopped the wait for ``transfer`` (its stage still queued in Horovod):
    :func:`~.abandoned_rounds.abandon`, with the round's gradient buffers (reused per name)
    among those dropped. Returns what to raise."""
    book = current_world().component(RoundBook)
    return abandon(round_.packing, round_.process_set, round_.what, transport, transfer, buffers,
                   error, [(book.reused, round_.name)] + list(reused or []))


def _packed_and_checked(book: RoundBook, tensors: list[torch.Tensor], name: str, bind: bool,
                        check_finite: bool, what: str) -> tuple[Optional[Packing], bool,
                                                                Optional[Exception]]:
    """This rank alone: the tensors packed and copied in; whether the list is new (seen for the
    first time, or re-bound: then the ranks compare layouts); what this rank cannot average."""
    packing = book.cached_packing(tensors, name, bind)
    new_list = packing is None and bind
    if packing is None:
        try:
            check_local_layout(tensors)
            packing = book.new_packing(tensors, name, bind)
        except (TypeError, ValueError) as error:
            return None, new_list, error
    if packing.layout_digest is None:
        packing.layout_digest = config_digest(packing.layout)
    for slab in packing.slabs:
        slab.copy_in()
    where = first_non_finite(packing) if check_finite else None
    error = NonFiniteError(f"{what}: {where}; refusing to average it into every rank's model") \
        if where is not None else None
    return packing, new_list, error


def begin_round(tensors: list[torch.Tensor], process_set: Optional[hvd.ProcessSet], *, name: str,
                bind: bool, check_finite: bool, context: str, compression,
                node_aware: Optional[bool]) -> Optional[Round]:
    """Pack, check and agree on ``tensors`` (collective over the set); None when there is nothing
    to move (this rank is outside the set, the set has one rank, or the list is empty).
    ``compression``: a codec (an averager level's, kept across rounds) or its public spelling."""
    book = current_world().component(RoundBook)
    codec = compression if isinstance(compression, WireCodec) else book.codec(compression)
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return None
    set_id = process_set.process_set_id
    set_ranks = members(process_set)
    what = f"{context} over process set {set_ranks} ({name!r}, {len(tensors)} tensors)"
    packing, new_list, local_error = _packed_and_checked(
        book, tensors, name, bind, check_finite and len(set_ranks) > 1, what)
    # the wire format too: ranks that pass different compression= are told, not left waiting
    layout = (packing.layout_digest, repr(codec.format.spec())) if packing is not None else None
    # Ranks compare when one of them may differ: an error here, a new list, another layout or
    # format than last agreed; and every round with check_finite (its NaN verdict travels too).
    agreed_key = (set_id, name)
    if local_error is not None or check_finite or new_list \
            or book.agreed_layouts.get(agreed_key) != layout:
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        check_same_on_all_ranks(
            f"the tensors of {what}", layout, local_error=local_error, process_set=process_set,
            name=f"hva.layout.{set_id}.{name}",
            summary=f"{len(tensors)} tensors ({sum(t.numel() for t in tensors)} elements, dtypes "
                    f"{dtypes}) in wire format {codec.format.spec()!r}")
        book.agreed_layouts[agreed_key] = layout
    if not tensors or len(set_ranks) == 1:
        return None
    return Round(packing, process_set, set_ranks, name, what, codec, node_aware)


def average_tensors(
    tensors: list[torch.Tensor],
    process_set: Optional[hvd.ProcessSet] = None,
    *,
    name: str = "params",
    bind: bool = True,
    check_finite: bool = False,
    context: str = "averaging",
    compression=None,
    node_aware: Optional[bool] = None,
) -> None:
    """Replace every tensor by its mean over ``process_set``, in place.

    Collective over the members of ``process_set``; a rank outside it returns at once. Tensors
    keep their identity, dtype, shape, memory layout and device. With ``bind`` (the default) the
    tensors are moved into reused flat per-dtype storage on the first call (see
    :mod:`hvd_averaging.flat_storage`), so later calls copy nothing; pass ``bind=False`` for
    tensors that are replaced every step (gradients). ``context`` names the round in errors
    (e.g. the averager and step).

    ``compression``: ``"fp16"`` (or ``hvd.Compression.fp16``) sends float16 on the wire, scaled
    so that nothing overflows; ``"int8"`` (or :class:`~hvd_averaging.wire.Int8`) sends int8
    with a scale per block across the link; :mod:`hvd_averaging.wire` states the error bounds.
    ``node_aware``: None lets the library choose (where the set spans nodes with several ranks
    each, for buffers of at least 1 MiB, ``HVA_ROUTE``: by default the faster of node-aware
    stages and one flat allreduce, timed at the set's first round of that size; see
    :mod:`hvd_averaging.routes`), False forces one flat allreduce, True node-aware stages
    wherever the set allows them.

    Raises:
        ValueError: mixed devices or sparse tensors; TypeError: integer tensors (whatever the
            ``compression``): on the rank that has them, the other members raising
            ``RuntimeError`` naming that rank (no hang). ValueError: a bad ``compression``,
            naming it and the choices (on every rank, before any collective).
        RuntimeError: the count, dtypes or shapes differ across the set (raised on every member).
        NonFiniteError: with ``check_finite``, a tensor holds NaN/Inf on this rank (checked
            before any data moves; the other members raise ``RuntimeError`` naming this rank);
            with float16 or int8, a NaN/Inf on any rank (raised on every member).
        AveragingTimeoutError: the round did not finish within ``hva.timeout()`` seconds. Each
            tensor then holds its value from before the round (or the round's whole average, if
            it completed while the error was raised), in storage of its own that no late
            transfer of the round writes into (in host memory if the device had no room: the
            message says so; where no memory held the copy, chained to that failure). The same
            holds after any other exception raised during the wait (``KeyboardInterrupt``, a
            signal handler's). The set's next round first waits for this one to complete
            (see :mod:`hvd_averaging.abandoned_rounds`); raised too when it still has not.
        HorovodInternalError: Horovod failed or was shut down during the round.
    """
    began = time.perf_counter()
    round_ = begin_round(tensors, process_set, name=name, bind=bind, check_finite=check_finite,
                         context=context, compression=compression, node_aware=node_aware)
    if round_ is None:
        return
    settle_timed_out(round_)
    slabs = round_.packing.slabs
    buffers = [slab.flat for slab in slabs]
    transport = round_.transport()
    nbytes = round_.count(transport, buffers)
    with bounded_collective(round_.what, nbytes) as collective, round_.naming_non_finite():
        transfer = transport.start(buffers, round_.op_names(), round_.what)
        try:
            collective.drive([transfer])
        except BaseException as error:
            if not transfer.in_flight:  # the round is over on every rank (a NaN, Horovod gone)
                raise
            # The stage stays queued, and a flat one writes into the slabs when the late rank
            # comes: whatever stopped the wait, nothing of this rank's may receive that write.
            replacement = abandon_round(round_, transport, transfer, buffers, error)
            if replacement is error:
                raise
            raise replacement from replacement.__cause__
    for slab in slabs:
        slab.copy_out()
    over_all = len(round_.set_ranks) == hvd.size()
    count_seconds("global_round_s" if over_all else "local_round_s", time.perf_counter() - began)


_MAX_ONE_SHOT_CODECS = 8  # tensor lists whose one-shot residuals are kept, per world


class OneShotCodecs:
    """The codecs of one-shot rounds (:func:`average_parameters`) in a format that keeps state
    between rounds (int8 with error feedback): one per wire format, process set and tensor list,
    so that each list's residuals carry to its next round as an averager level's do. The most
    recently used :data:`_MAX_ONE_SHOT_CODECS` are kept; the tensors are held weakly."""

    def __init__(self) -> None:
        self._codecs: dict[tuple, tuple[list[weakref.ref], WireCodec]] = {}

    def codec(self, wire: WireFormat, process_set: hvd.ProcessSet,
              tensors: list[torch.Tensor]) -> WireCodec:
        key = (wire, process_set.process_set_id, tuple(id(t) for t in tensors))
        found = self._codecs.pop(key, None)
        # ids are reused once a tensor is freed: the weak references tell
        if found is None or not all(ref() is t for ref, t in zip(found[0], tensors)):
            found = ([weakref.ref(t) for t in tensors], wire.codec())
        self._codecs[key] = found  # the most recently used last
        while len(self._codecs) > _MAX_ONE_SHOT_CODECS:
            self._codecs.pop(next(iter(self._codecs)))
        return found[1]


def average_parameters(params: TensorsLike, process_set: Optional[hvd.ProcessSet] = None, *,
                       check_finite: bool = False, compression=None) -> None:
    """Average parameters (or an optimizer's param groups) over ``process_set`` now, in place.

    The one-shot utility behind the averagers: collective over the members of ``process_set``
    (default: Horovod's global set); other ranks return at once. Across nodes with several
    ranks each it averages node-aware; ``compression="fp16"`` halves the bytes on the wire,
    ``"int8"`` quarters them across the link (see :func:`average_tensors`).
    ``hva.Int8(error_feedback=True)`` keeps each rank's quantization residual per process set
    and list of parameters (the same objects, in the same order) and adds it to that list's next
    round, as an averager level does; the residuals of the 8 lists used last are kept (not in
    any ``state_dict``: an averager's are).

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> hva.average_parameters(model.parameters())
        >>> hva.average_parameters(model.parameters(), compression=hvd.Compression.fp16)
        >>> hva.average_parameters(model.parameters(), compression="int8")
    """
    tensors = collect_parameters(params)
    if compression is not None and not isinstance(compression, WireCodec):
        wire = wire_format(compression)  # ValueError: a bad spelling, on every rank
        if wire.new_state() is not None:
            compression = current_world().component(OneShotCodecs).codec(
                wire, process_set if process_set is not None else hvd.global_process_set, tensors)
    average_tensors(tensors, process_set, check_finite=check_finite, compression=compression)
