"""How tensors travel: averaging a list of tensors over a Horovod process set.

Design, chosen because of two Horovod 0.28.1 hazards (``shared/horovod-hazards``): grouped
collectives share one group-id counter per process across all process sets, so a grouped call on
a subset of ranks makes a later grouped call on another set hang; and a grouped call after a used
set was removed hangs too. Plain ``allreduce_async_`` has neither problem. So the tensors of each
dtype are packed into one flat buffer (one collective per dtype, never one per tensor), all dtype
buffers are in flight at once, and each collective has a stable name so Horovod's response cache
hits step after step. bfloat16 (absent from Horovod's torch ops, horovod#4047) travels in a
float32 buffer and is rounded back once.

Before the data moves, one small allgather compares a digest of the layout (dtypes, shapes) across
the set: ranks with different parameter lists would otherwise hang (a dtype only some ranks
have) or silently average unrelated tensors (equal sizes, different shapes).
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import horovod.torch as hvd
import torch

from .runtime import check_same_on_all_ranks, members

__all__ = [
    "collect_parameters",
    "floating_buffers",
    "traffic",
    "reset_traffic",
    "average_tensors",
    "average_parameters",
    "TensorsLike",
]

TensorsLike = Union[Iterable[torch.nn.Parameter], Iterable[dict]]

# Horovod's torch ops carry these dtypes natively; others go through a float32 buffer.
_WIRE_DTYPE = {torch.bfloat16: torch.float32}
_buffers: dict[tuple, torch.Tensor] = {}

# Counted by average_tensors on this rank: averaging rounds over the whole (global) process set,
# rounds over smaller sets, and the payload bytes this rank handed to allreduce.
traffic = {"global_allreduces": 0, "local_allreduces": 0, "bytes": 0}


def reset_traffic() -> None:
    """Zero the counters in :data:`traffic`."""
    for key in traffic:
        traffic[key] = 0


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


def _buffer(key: tuple, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer (allocating hundreds of MB every averaging step costs page faults)."""
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _buffers[key] = buf
    return buf[:numel]


def average_tensors(
    tensors: list[torch.Tensor],
    process_set: Optional[hvd.ProcessSet] = None,
    *,
    name: str = "params",
) -> None:
    """Replace every tensor by its mean over ``process_set``, in place.

    Collective over the members of ``process_set``; a rank outside it returns at once. Tensors
    keep their identity, dtype, shape, memory layout and device.

    Raises:
        ValueError / TypeError: mixed devices, sparse or integer tensors, on the rank that has
            them; the other members raise ``RuntimeError`` naming that rank (no hang).
        RuntimeError: the count, dtypes or shapes differ across the set (raised on every member).
    """
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return
    try:
        _check_local_layout(tensors)
        local_error = None
    except (TypeError, ValueError) as error:
        local_error = error
    set_id = process_set.process_set_id
    set_ranks = members(process_set)
    layout = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    check_same_on_all_ranks(
        f"the tensors averaged as {name!r} over process set {set_ranks}",
        layout,
        local_error=local_error,
        process_set=process_set,
        name=f"hva.layout.{set_id}.{name}",
        summary=f"{len(tensors)} tensors ({sum(t.numel() for t in tensors)} elements, dtypes {dtypes})",
    )
    if not tensors or len(set_ranks) == 1:
        return

    global_round = len(set_ranks) == hvd.size()
    traffic["global_allreduces" if global_round else "local_allreduces"] += 1
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)

    in_flight = []
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            wire = _WIRE_DTYPE.get(dtype, dtype)
            numel = sum(t.numel() for t in group)
            flat = _buffer((set_id, name, wire, group[0].device), numel, wire, group[0].device)
            traffic["bytes"] += flat.numel() * flat.element_size()
            if wire == dtype:
                torch.cat([t.reshape(-1) for t in group], out=flat)
            else:
                offset = 0
                for t in group:
                    flat[offset:offset + t.numel()].view(t.shape).copy_(t)
                    offset += t.numel()
            handle = hvd.allreduce_async_(
                flat, op=hvd.Average, name=f"hva.{set_id}.{name}.{dtype}".replace("torch.", ""),
                process_set=process_set,
            )
            in_flight.append((handle, flat, group))
        for handle, flat, group in in_flight:
            hvd.synchronize(handle)
            chunks = [c.view(t.shape) for c, t in zip(flat.split([t.numel() for t in group]), group)]
            torch._foreach_copy_(group, chunks)


def average_parameters(params: TensorsLike, process_set: Optional[hvd.ProcessSet] = None) -> None:
    """Average parameters (or an optimizer's param groups) over ``process_set`` now, in place.

    The one-shot utility behind the averagers: collective over the members of ``process_set``
    (default: Horovod's global set); other ranks return at once.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> hva.average_parameters(model.parameters())
    """
    average_tensors(collect_parameters(params), process_set)
