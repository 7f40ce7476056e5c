"""How tensors travel: averaging a list of tensors over a Horovod process set.

Design, chosen because of two Horovod 0.28.1 hazards (``shared/horovod-hazards``): grouped
collectives share one group-id counter per process across all process sets, so a grouped call on
a subset of ranks makes a later grouped call on another set hang; and a grouped call after a used
set was removed hangs too. Plain ``allreduce_async_`` has neither problem. So the tensors of each
dtype live in one flat buffer (:mod:`.flat_storage`: parameters view into it, so nothing is
copied per round), there is one collective per dtype, never one per tensor, all dtype buffers are
in flight at once, and each collective has a stable name so Horovod's response cache hits step
after step. bfloat16 (absent from Horovod's torch ops, horovod#4047) travels as float32.

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

from dataclasses import dataclass, replace
from typing import Iterable, Optional, Union

import horovod.torch as hvd
import torch

from .flat_storage import Packing, pack
from .runtime import (bounded_collective, check_same_on_all_ranks, config_digest,
                      known_rank_to_node, members)

__all__ = [
    "collect_parameters",
    "floating_buffers",
    "TrafficCounters",
    "traffic",
    "reset_traffic",
    "forget_layout_agreements",
    "NonFiniteError",
    "average_tensors",
    "average_parameters",
    "TensorsLike",
]

TensorsLike = Union[Iterable[torch.nn.Parameter], Iterable[dict]]

# Packings by (name, tensor identities), at most a few: a model averaged again finds its slabs.
_packings: dict[tuple, Packing] = {}
_MAX_PACKINGS = 8
_reused_buffers: dict[tuple, dict] = {}  # per name, for tensors copied through (gradients)
_agreed_layouts: dict[tuple, int] = {}  # (set id, name) -> layout digest all members agreed on



@dataclass
class TrafficCounters:
    """What :func:`average_tensors` moved on this rank since the last :func:`reset_traffic`.

    Attributes:
        global_allreduces: averaging rounds over all ranks.
        local_allreduces: rounds over smaller sets.
        bytes: payload bytes this rank handed to allreduce.
        cross_node_bytes: the part of ``bytes`` in rounds whose set spans more than one node
            (what crosses the link between nodes; counted when the placement is known, i.e.
            after ``hva.init()``).
    """

    global_allreduces: int = 0
    local_allreduces: int = 0
    bytes: int = 0
    cross_node_bytes: int = 0


_traffic = TrafficCounters()
_set_crosses_nodes: dict[int, bool] = {}  # process set id -> spans several nodes


class NonFiniteError(ValueError):
    """A tensor to average holds NaN or Inf (raised only with ``check_finite=True``)."""


def forget_layout_agreements() -> None:
    """Forget which layouts the ranks agreed on (process set ids are reassigned after an elastic
    reset, so the next round over each set checks again)."""
    _agreed_layouts.clear()
    _set_crosses_nodes.clear()


def traffic() -> TrafficCounters:
    """A snapshot of this rank's traffic counters (see :class:`TrafficCounters`).

    Example::

        >>> hva.reset_traffic()
        >>> ...  # train
        >>> print(hva.traffic().cross_node_bytes / 1e6, "MB over the link between nodes")
    """
    return replace(_traffic)


def reset_traffic() -> None:
    """Zero this rank's traffic counters."""
    global _traffic
    _traffic = TrafficCounters()


def _crosses_nodes(set_id: int, set_ranks: list[int]) -> bool:
    if set_id not in _set_crosses_nodes:
        nodes = known_rank_to_node()
        if nodes is None:
            return False
        _set_crosses_nodes[set_id] = len({nodes[r] for r in set_ranks}) > 1
    return _set_crosses_nodes[set_id]


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


def _cached_packing(tensors: list[torch.Tensor], name: str, bind: bool) -> Optional[Packing]:
    """The packing made for exactly these tensors, if they still live in it."""
    if not bind:
        return None
    packing = _packings.get((name, tuple(id(t) for t in tensors)))  # holds the tensors: ids stay theirs
    return packing if packing is not None and packing.still_bound() else None


def _new_packing(tensors: list[torch.Tensor], name: str, bind: bool) -> Packing:
    if not bind:
        return pack(tensors, bind=False, reuse=_reused_buffers.setdefault(name, {}))
    packing = pack(tensors, bind=True)
    key = (name, tuple(id(t) for t in tensors))
    _packings.pop(key, None)
    _packings[key] = packing
    while len(_packings) > _MAX_PACKINGS:
        _packings.pop(next(iter(_packings)))
    return packing


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


def average_tensors(
    tensors: list[torch.Tensor],
    process_set: Optional[hvd.ProcessSet] = None,
    *,
    name: str = "params",
    bind: bool = True,
    check_finite: bool = False,
    context: str = "averaging",
) -> None:
    """Replace every tensor by its mean over ``process_set``, in place.

    Collective over the members of ``process_set``; a rank outside it returns at once. Tensors
    keep their identity, dtype, shape, memory layout and device. With ``bind`` (the default) the
    tensors are moved into reused flat per-dtype storage on the first call (see
    :mod:`hvd_averaging.flat_storage`), so later calls copy nothing; pass ``bind=False`` for
    tensors that are replaced every step (gradients). ``context`` names the round in errors
    (e.g. the averager and step).

    Raises:
        ValueError / TypeError: mixed devices, sparse or integer tensors, on the rank that has
            them; the other members raise ``RuntimeError`` naming that rank (no hang).
        RuntimeError: the count, dtypes or shapes differ across the set (raised on every member).
        NonFiniteError: with ``check_finite``, a tensor holds NaN/Inf on this rank (checked
            before any data moves; the other members raise ``RuntimeError`` naming this rank).
        AveragingTimeoutError: the round did not finish within ``hva.timeout()`` seconds.
        HorovodInternalError: Horovod failed or was shut down during the round.
    """
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return
    set_id = process_set.process_set_id
    set_ranks = members(process_set)
    what = f"{context} over process set {set_ranks} ({name!r}, {len(tensors)} tensors)"
    local_error = None
    packing = _cached_packing(tensors, name, bind)
    new_list = packing is None and bind  # a list seen for the first time (or re-bound) is checked
    if packing is None:
        try:
            _check_local_layout(tensors)
            packing = _new_packing(tensors, name, bind)
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
            or _agreed_layouts.get(agreed_key) != layout_digest):
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
        check_same_on_all_ranks(
            f"the tensors of {what}",
            layout_digest,
            local_error=local_error,
            process_set=process_set,
            name=f"hva.layout.{set_id}.{name}",
            summary=f"{len(tensors)} tensors ({sum(t.numel() for t in tensors)} elements, dtypes {dtypes})",
        )
        _agreed_layouts[agreed_key] = layout_digest
    if not tensors or len(set_ranks) == 1:
        return

    if len(set_ranks) == hvd.size():
        _traffic.global_allreduces += 1
    else:
        _traffic.local_allreduces += 1
    nbytes = sum(slab.flat.numel() * slab.flat.element_size() for slab in packing.slabs)
    _traffic.bytes += nbytes
    if _crosses_nodes(set_id, set_ranks):
        _traffic.cross_node_bytes += nbytes
    with bounded_collective(what, nbytes) as collective:
        handles = [hvd.allreduce_async_(
            slab.flat, op=hvd.Average, process_set=process_set,
            name=f"hva.{set_id}.{name}.{slab.dtype}".replace("torch.", ""),
        ) for slab in packing.slabs]
        collective.wait(handles)
    for slab in packing.slabs:
        slab.copy_out()


def average_parameters(params: TensorsLike, process_set: Optional[hvd.ProcessSet] = None, *,
                       check_finite: bool = False) -> None:
    """Average parameters (or an optimizer's param groups) over ``process_set`` now, in place.

    The one-shot utility behind the averagers: collective over the members of ``process_set``
    (default: Horovod's global set); other ranks return at once.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> hva.average_parameters(model.parameters())
    """
    average_tensors(collect_parameters(params), process_set, check_finite=check_finite)
