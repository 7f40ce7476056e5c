"""Averaging rounds: what every round does whichever way its tensors travel.

A round packs the tensors (:mod:`.flat_storage`: one flat buffer per dtype that parameters view
into, so nothing is copied per round), checks them, agrees on their layout across the set,
counts traffic, picks the way each buffer travels (:mod:`.routes`, :mod:`.transports`: one
flat allreduce, node-aware stages across nodes, float16 on the wire) and bounds the wait. Rounds
finish before returning (:func:`average_tensors`) or stay in flight while training goes on
(:class:`DelayedAverage`).

Design, chosen because of Horovod 0.28.1 hazards (``shared/horovod-hazards``): grouped
collectives share one group-id counter per process across all process sets, so a grouped call on
a subset of ranks makes a later grouped call on another set hang; and a grouped call after a used
set was removed hangs too. Plain ``*_async`` collectives have neither problem. So there is one
chain of collectives per dtype, never one per tensor, all dtype buffers are in flight at once,
and each collective has a stable name so Horovod's response cache hits step after step.
bfloat16 (absent from Horovod's torch ops, horovod#4047) travels as float32.

Ranks must agree on what they average, or Horovod hangs (a dtype only some ranks have) or
silently averages unrelated tensors (equal sizes, different shapes). One small allgather compares
a digest of the layout (dtypes, shapes) across the set the first time a list of tensors is
averaged over a set, and whenever the list or its layout changes; rounds over the same tensors
add no collective. (A list that changes on some ranks only is caught by the timeout below.)

No wait is unbounded: a round that does not finish within :func:`timeout` seconds (a rank died,
stalled, or averages a different sequence) raises :class:`AveragingTimeoutError` naming the
round, the process set and the ranks, instead of hanging the job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Union

import horovod.torch as hvd
import torch

from .flat_storage import Packing, pack
from .routes import Routes
from .runtime import (bounded_collective, check_same_on_all_ranks, config_digest, guarded_enqueue,
                      members)
from .transports import Transport
from .transports.fp16_wire import NonFiniteOnWire

__all__ = [
    "collect_parameters",
    "floating_buffers",
    "TrafficCounters",
    "traffic",
    "reset_traffic",
    "forget_layout_agreements",
    "prepare_process_set",
    "averaging_route",
    "NonFiniteError",
    "average_tensors",
    "start_delayed_average",
    "DelayedAverage",
    "average_parameters",
    "TensorsLike",
]

TensorsLike = Union[Iterable[torch.nn.Parameter], Iterable[dict]]

_MAX_PACKINGS = 8


@dataclass
class TrafficCounters:
    """What averaging rounds moved on this rank since the last :func:`reset_traffic`.

    Attributes:
        global_allreduces: averaging rounds over all ranks.
        local_allreduces: rounds over smaller sets.
        bytes: payload bytes this rank handed to averaging, as they travel (float16 halves them).
        cross_node_bytes: the part of ``bytes`` handed to collectives whose members sit on more
            than one node (what crosses the link between nodes: a node-aware round hands them
            only this rank's share; counted when the placement is known, i.e. after
            ``hva.init()``).
    """

    global_allreduces: int = 0
    local_allreduces: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0


class NonFiniteError(ValueError):
    """A tensor to average holds NaN or Inf (raised with ``check_finite=True``, and always
    before a float16 round, where it would make the scale meaningless)."""


class _RoundBook:
    """The state rounds share on this rank: packings, layouts agreed per set, traffic, routes,
    and the buffers of rounds left in flight."""

    def __init__(self) -> None:
        self.packings: dict[tuple, Packing] = {}  # by (name, tensor identities), at most a few
        self.reused: dict[str, dict] = {}  # per name, for tensors copied through (gradients)
        self.agreed_layouts: dict[tuple, int] = {}  # (set id, name) -> layout digest agreed on
        self.traffic = TrafficCounters()
        self.routes = Routes()

    def forget_sets(self) -> None:
        self.agreed_layouts.clear()
        self.routes.forget()

    def cached_packing(self, tensors: list[torch.Tensor], name: str, bind: bool) -> Optional[Packing]:
        """The packing made for exactly these tensors, if they still live in it."""
        if not bind:
            return None
        packing = self.packings.get((name, tuple(id(t) for t in tensors)))  # holds them: ids stay theirs
        return packing if packing is not None and packing.still_bound() else None

    def new_packing(self, tensors: list[torch.Tensor], name: str, bind: bool) -> Packing:
        if not bind:
            return pack(tensors, bind=False, reuse=self.reused.setdefault(name, {}))
        packing = pack(tensors, bind=True)
        key = (name, tuple(id(t) for t in tensors))
        self.packings.pop(key, None)
        self.packings[key] = packing
        while len(self.packings) > _MAX_PACKINGS:
            self.packings.pop(next(iter(self.packings)))
        return packing



def _reused_like(buffers: dict, key: tuple, like: torch.Tensor) -> torch.Tensor:
    found = buffers.get(key)
    if found is None or found.shape != like.shape or found.dtype != like.dtype \
            or found.device != like.device:
        found = buffers[key] = torch.empty_like(like)
    return found


_book = _RoundBook()


def forget_layout_agreements() -> None:
    """Forget which layouts the ranks agreed on and which way each set travels (process set ids
    are reassigned after an elastic reset, so the next round over each set checks again)."""
    _book.forget_sets()


def traffic() -> TrafficCounters:
    """A snapshot of this rank's traffic counters (see :class:`TrafficCounters`).

    Example::

        >>> hva.reset_traffic()
        >>> ...  # train
        >>> print(hva.traffic().cross_node_bytes / 1e6, "MB over the link between nodes")
    """
    return replace(_book.traffic)


def reset_traffic() -> None:
    """Zero this rank's traffic counters."""
    _book.traffic = TrafficCounters()


def prepare_process_set(process_set: hvd.ProcessSet) -> None:
    """Make ``process_set`` average node-aware where it can (register its node groups and rails).

    Collective over all ranks, same order on every rank (averagers call it for their levels at
    construction; the global set is prepared at its first round).
    """
    _book.routes.prepare(process_set)


def averaging_route(process_set: Optional[hvd.ProcessSet] = None, nbytes: int = 1 << 30) -> str:
    """``"node-aware"`` or ``"flat"``: how a buffer of ``nbytes`` travels over ``process_set``
    now (local; call after the set was prepared or averaged over once)."""
    process_set = process_set if process_set is not None else hvd.global_process_set
    return "node-aware" if _book.routes.takes_node_aware(process_set, nbytes) else "flat"


def floating_buffers(buffers) -> list[torch.Tensor]:
    """The floating-point tensors of ``buffers`` (e.g. ``model.buffers()``: BatchNorm running
    statistics yes, its integer ``num_batches_tracked`` no)."""
    if buffers is None:
        return []
    selected = []
    for index, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffers entry #{index}: expected torch.Tensor, got {type(buf).__name__}")
        if buf.is_floating_point():
            selected.append(buf)
    return selected


def collect_parameters(params: TensorsLike) -> list[torch.Tensor]:
    """The parameters to average from parameters or optimizer param groups.

    As in PyTorch, a parameter whose ``.grad`` is None is skipped (this optimizer did not update
    it). A parameter listed twice (tied weights) is averaged once.

    Raises:
        TypeError: an entry is neither a ``torch.nn.Parameter`` nor a param-group dict.
    """
    selected: list[torch.Tensor] = []
    seen: set[int] = set()

    def take(param, where: str) -> None:
        if not isinstance(param, torch.nn.Parameter):
            raise TypeError(
                f"{where}: expected torch.nn.Parameter, got {type(param).__name__}; pass "
                "model.parameters() or optimizer.param_groups"
            )
        if param.grad is not None and id(param) not in seen:
            seen.add(id(param))
            selected.append(param)

    for index, entry in enumerate(params):
        if isinstance(entry, dict):
            if "params" not in entry:
                raise TypeError(f"param group #{index} is a dict without a 'params' key")
            for param in entry["params"]:
                take(param, f"param group #{index}")
        else:
            take(entry, f"params entry #{index}")
    return selected


def _check_local_layout(tensors: list[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"tensors to average lie on several devices {sorted(map(str, devices))}: keep a "
            "model's averaged parameters on one device"
        )
    for i, t in enumerate(tensors):
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"tensor #{i} has layout {t.layout}: only dense tensors can be averaged")
        if not t.is_floating_point():
            raise TypeError(
                f"tensor #{i} has dtype {t.dtype}: an average of integers is not an integer; "
                "only floating-point tensors can be averaged"
            )


def _first_non_finite(packing: Packing) -> Optional[str]:
    """Where the first NaN/Inf is, or None. One reduction per dtype slab, then per tensor only
    in the slab that has one."""
    index = {id(t): i for i, t in enumerate(packing.tensors)}
    for slab in packing.slabs:
        if bool(torch.isfinite(slab.flat).all()):
            continue
        for t in slab.bound + slab.copied:
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                return (f"tensor #{index[id(t)]} (shape {tuple(t.shape)}, dtype {t.dtype}) has "
                        f"{bad} NaN/Inf value(s) on rank {hvd.rank()}")
    return None


def wire_is_fp16(compression) -> bool:
    """True for ``hvd.Compression.fp16``, False for None or ``hvd.Compression.none``.

    Raises:
        ValueError: anything else (named).
    """
    if compression is None or compression is hvd.Compression.none:
        return False
    if compression is hvd.Compression.fp16:
        return True
    raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16, got "
                     f"{compression!r}")


def compression_name(compression) -> str:
    """``"fp16"`` or ``"none"`` (for configurations compared across ranks)."""
    return "fp16" if wire_is_fp16(compression) else "none"


@dataclass
class _Round:
    """A round whose tensors are packed, checked and agreed on, ready to travel."""

    packing: Packing
    process_set: hvd.ProcessSet
    set_ranks: list[int]
    name: str
    what: str
    fp16: bool
    node_aware: Optional[bool]
    op_tag: str = ""  # tells apart rounds over the same tensors in flight at once

    def transport(self) -> Transport:
        nbytes = sum(slab.flat.numel() * slab.flat.element_size() for slab in self.packing.slabs)
        return _book.routes.transport(self.process_set, nbytes, fp16=self.fp16,
                                      node_aware=self.node_aware)

    def op_names(self) -> list[str]:
        """One stable name per dtype buffer (Horovod's response cache hits round after round)."""
        prefix = f"hva.{self.process_set.process_set_id}.{self.name}{self.op_tag}"
        return [f"{prefix}.{str(slab.dtype).replace('torch.', '')}" for slab in self.packing.slabs]

    def count(self, transport: Transport, buffers: list[torch.Tensor]) -> int:
        counters = _book.traffic
        if len(self.set_ranks) == hvd.size():
            counters.global_allreduces += 1
        else:
            counters.local_allreduces += 1
        nbytes = transport.wire_bytes(buffers)
        counters.bytes += nbytes
        counters.cross_node_bytes += transport.cross_node_bytes(buffers)
        return nbytes

    def non_finite_error(self, error: NonFiniteOnWire) -> NonFiniteError:
        where = _first_non_finite(self.packing) if error.rank == hvd.rank() else None
        return NonFiniteError(f"{self.what}: " + (
            f"{where}; a float16 round cannot scale it" if where else
            f"rank {error.rank} holds NaN/Inf (see its error); nothing was averaged"))


def _begin_round(tensors: list[torch.Tensor], process_set: Optional[hvd.ProcessSet], *, name: str,
                 bind: bool, check_finite: bool, context: str, compression,
                 node_aware: Optional[bool]) -> Optional[_Round]:
    """Pack, check and agree on ``tensors`` (collective over the set); None when there is nothing
    to move (this rank is outside the set, the set has one rank, or the list is empty)."""
    fp16 = wire_is_fp16(compression)
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return None
    set_id = process_set.process_set_id
    set_ranks = members(process_set)
    what = f"{context} over process set {set_ranks} ({name!r}, {len(tensors)} tensors)"
    local_error = None
    packing = _book.cached_packing(tensors, name, bind)
    new_list = packing is None and bind  # a list seen for the first time (or re-bound) is checked
    if packing is None:
        try:
            _check_local_layout(tensors)
            packing = _book.new_packing(tensors, name, bind)
        except (TypeError, ValueError) as error:
            local_error = error
    if packing is not None:
        if packing.layout_digest is None:
            packing.layout_digest = config_digest(packing.layout)
        for slab in packing.slabs:
            slab.copy_in()
        if check_finite and len(set_ranks) > 1:
            where = _first_non_finite(packing)
            if where is not None:
                local_error = NonFiniteError(
                    f"{what}: {where}; refusing to average it into every rank's model")
    agreed_key = (set_id, name)
    layout_digest = packing.layout_digest if packing is not None else None
    if (local_error is not None or check_finite or new_list
            or _book.agreed_layouts.get(agreed_key) != layout_digest):
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        check_same_on_all_ranks(
            f"the tensors of {what}",
            layout_digest,
            local_error=local_error,
            process_set=process_set,
            name=f"hva.layout.{set_id}.{name}",
            summary=f"{len(tensors)} tensors ({sum(t.numel() for t in tensors)} elements, dtypes {dtypes})",
        )
        _book.agreed_layouts[agreed_key] = layout_digest
    if not tensors or len(set_ranks) == 1:
        return None
    return _Round(packing, process_set, set_ranks, name, what, fp16, node_aware)


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

    ``compression=hvd.Compression.fp16`` sends float16 on the wire, scaled so that nothing
    overflows (:mod:`hvd_averaging.transports.fp16_wire` states the error bound).
    ``node_aware``: None lets the set's placement choose (node-aware stages across nodes with
    several ranks each, for buffers of at least 1 MiB; see :mod:`hvd_averaging.routes`), False
    forces one flat allreduce, True node-aware stages wherever the set allows them.

    Raises:
        ValueError / TypeError: mixed devices, sparse or integer tensors, on the rank that has
            them; the other members raise ``RuntimeError`` naming that rank (no hang). A bad
            ``compression`` (on every rank, before any collective).
        RuntimeError: the count, dtypes or shapes differ across the set (raised on every member).
        NonFiniteError: with ``check_finite``, a tensor holds NaN/Inf on this rank (checked
            before any data moves; the other members raise ``RuntimeError`` naming this rank);
            with float16, a NaN/Inf on any rank (raised on every member).
        AveragingTimeoutError: the round did not finish within ``hva.timeout()`` seconds.
        HorovodInternalError: Horovod failed or was shut down during the round.
    """
    round_ = _begin_round(tensors, process_set, name=name, bind=bind, check_finite=check_finite,
                          context=context, compression=compression, node_aware=node_aware)
    if round_ is None:
        return
    slabs = round_.packing.slabs
    buffers = [slab.flat for slab in slabs]
    transport = round_.transport()
    nbytes = round_.count(transport, buffers)
    with bounded_collective(round_.what, nbytes) as collective:
        try:
            collective.drive([transport.start(buffers, round_.op_names(), round_.what)])
        except NonFiniteOnWire as error:
            raise round_.non_finite_error(error) from None
    for slab in slabs:
        slab.copy_out()


class DelayedAverage:
    """One averaging round left in flight while training goes on (``delay`` in the averagers).

    At its start the tensors' values are copied into a snapshot and the snapshot's average is
    launched; :meth:`progress` (called once per training step, never waits) keeps its stages
    moving on Horovod's background thread; :meth:`apply` waits for the rest (bounded by
    ``hva.timeout()`` counted from the start) and sets every tensor to
    ``average(snapshot) + (tensor - snapshot)``: the average of the models at the start plus the
    local progress made since.

    Memory: the snapshot (one copy of the tensors, in the dtype they travel in) and the buffer
    the average arrives in (another copy, or half of one in float16), held only while in flight.
    """

    def __init__(self, round_: _Round, buffers: dict, snapshots: Optional[list[torch.Tensor]]):
        self._round = round_
        self.what = round_.what
        slabs = round_.packing.slabs
        self._snapshots = []
        wires = []
        for index, slab in enumerate(slabs):
            snapshot = _reused_like(buffers, ("snapshot", index), slab.flat)
            snapshot.copy_(snapshots[index] if snapshots is not None else slab.flat)
            self._snapshots.append(snapshot)
            wire = _reused_like(buffers, ("wire", index), slab.flat)
            wire.copy_(snapshot)
            wires.append(wire)
        transport = round_.transport()
        self.nbytes = round_.count(transport, wires)
        self.started_at = time.monotonic()
        with guarded_enqueue(self.what):
            self._transfer = transport.start(wires, round_.op_names(), self.what)

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
        try:
            self._wait()
        except NonFiniteError:
            pass

    def _wait(self) -> None:
        """Drive the round to its end, bounded by ``hva.timeout()`` counted from its start."""
        with bounded_collective(self.what, self.nbytes, started_at=self.started_at) as collective:
            try:
                collective.drive([self._transfer])
            except NonFiniteOnWire as error:
                raise self._round.non_finite_error(error) from None

    def progress(self) -> None:
        """Launch the next stage of every transfer whose current one finished; never waits.
        Costs one poll per dtype buffer while stages run; the watchdog is armed only around
        launches."""
        if not self._transfer.ready():
            return
        try:
            with guarded_enqueue(self.what):
                self._transfer.advance()
        except NonFiniteOnWire as error:
            raise self._round.non_finite_error(error) from None

    def apply(self) -> None:
        """Wait for the average (bounded), then ``tensor = average + (tensor - snapshot)``.

        Raises:
            AveragingTimeoutError: not finished within ``hva.timeout()`` of its start.
            NonFiniteError: float16 and a NaN/Inf on some rank at the start.
            HorovodInternalError: Horovod failed or shut down meanwhile.
        """
        self._wait()
        if not self._round.packing.still_bound():
            raise RuntimeError(
                f"{self.what}: a tensor's .data was replaced (model.to(), load_state_dict(assign="
                "True)) while its round was in flight, so the round cannot be applied to it")
        with torch.no_grad():
            for slab, snapshot, average in zip(self._round.packing.slabs, self._snapshots,
                                               self._transfer.result):
                slab.copy_in()  # tensors copied through their slot moved on since the start
                torch.sub(slab.flat, snapshot, out=snapshot)  # the local progress
                slab.flat.copy_(average)
                slab.flat.add_(snapshot)
                slab.copy_out()


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
) -> Optional[DelayedAverage]:
    """Start averaging ``tensors`` over ``process_set`` and return without waiting (collective).

    ``buffers`` is the caller's dict where the round's snapshot and wire buffers are kept for
    the next round (one round in flight per dict); ``op_tag`` tells its collectives apart from
    other rounds over the same tensors (``name``: the same packing as synchronous rounds). ``snapshots`` and
    ``snapshot_layout`` (from :meth:`DelayedAverage.snapshots` and ``layout_digest``) restart a
    round from a checkpoint: the same snapshot is averaged again, so the result is the one the
    interrupted round would have given. Returns None where :func:`average_tensors` would move
    nothing. Raises what :func:`average_tensors` raises before data moves, and ``ValueError``
    (on every member) when ``snapshots`` do not fit the tensors.
    """
    round_ = _begin_round(tensors, process_set, name=name, bind=True, check_finite=check_finite,
                          context=context, compression=compression, node_aware=node_aware)
    if round_ is None:
        return None
    round_.op_tag = op_tag
    if snapshots is not None:
        fits = snapshot_layout == round_.packing.layout_digest and len(snapshots) == len(
            round_.packing.slabs) and all(s.shape == slab.flat.shape and s.dtype == slab.flat.dtype
                                          for s, slab in zip(snapshots, round_.packing.slabs))
        error = None if fits else ValueError(
            f"{round_.what}: the checkpoint's in-flight snapshot does not fit these tensors "
            "(different parameters, shapes or dtypes than when it was saved)")
        check_same_on_all_ranks(f"{round_.what} snapshot from the checkpoint", True,
                                local_error=error, process_set=round_.process_set,
                                name=f"hva.snapshot.{round_.process_set.process_set_id}.{name}")
    return DelayedAverage(round_, buffers, snapshots)


def average_parameters(params: TensorsLike, process_set: Optional[hvd.ProcessSet] = None, *,
                       check_finite: bool = False, compression=None) -> None:
    """Average parameters (or an optimizer's param groups) over ``process_set`` now, in place.

    The one-shot utility behind the averagers: collective over the members of ``process_set``
    (default: Horovod's global set); other ranks return at once. Across nodes with several
    ranks each it averages node-aware; ``compression=hvd.Compression.fp16`` halves the bytes
    on the wire (see :func:`average_tensors`).

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> hva.average_parameters(model.parameters())
        >>> hva.average_parameters(model.parameters(), compression=hvd.Compression.fp16)
    """
    average_tensors(collect_parameters(params), process_set, check_finite=check_finite,
                    compression=compression)
