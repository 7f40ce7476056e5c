"""One rank's tensors or state to every rank, bounded: flat per-dtype buffers, and state dicts
as ``torch.save`` bytes read back with ``torch.load(weights_only=True)`` (data, never code).

What DiLoCo's starting point needs (every rank starts from the same weights, as PyTorch's DDP
and torchft do): the set's lowest rank's values, bit for bit, in place. The layout is agreed on
first, so ranks with different models raise instead of broadcasting unrelated bytes. Elastic
jobs hand rank 0's optimizer states to joining workers the second way.
"""

from __future__ import annotations

import io
from typing import Any, Optional

import horovod.torch as hvd
import torch

from .agreement import check_same_on_all_ranks, config_digest
from .deadlines import bounded_collective
from .flat_storage import pack
from .process_sets import members

__all__ = ["broadcast_from_first_member", "broadcast_state"]


def broadcast_from_first_member(tensors: list[torch.Tensor],
                                process_set: Optional[hvd.ProcessSet] = None, *,
                                what: str, name: str) -> None:
    """Every member's ``tensors`` become the lowest member's, in place (collective over
    ``process_set``, default all ranks; ranks outside it return at once). Bounded by
    ``hva.timeout()``.

    Raises:
        RuntimeError: the members' tensors differ in count, dtype or shape (on every member).
        AveragingTimeoutError: a member did not take part in time.
    """
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return
    ranks = members(process_set)
    layout = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    check_same_on_all_ranks(f"the tensors of {what}", config_digest(layout),
                            process_set=process_set, name=f"{name}.layout",
                            summary=f"{len(tensors)} tensors ({sum(t.numel() for t in tensors)} elements)")
    if len(ranks) == 1 or not tensors:
        return
    packing = pack(tensors, bind=False)
    for slab in packing.slabs:
        slab.copy_in()
    nbytes = sum(slab.flat.numel() * slab.flat.element_size() for slab in packing.slabs)
    with bounded_collective(f"{what} (broadcast from rank {ranks[0]})", nbytes) as collective:
        handles = [hvd.broadcast_async_(slab.flat, root_rank=ranks[0], process_set=process_set,
                                        name=f"{name}.{str(slab.dtype).replace('torch.', '')}")
                   for slab in packing.slabs]
        collective.wait(handles)
    for slab in packing.slabs:
        slab.copy_out()


def broadcast_state(state: Any, *, what: str, name: str) -> Any:
    """Rank 0's ``state`` (tensors, numbers, strings, lists and dicts of them: an optimizer's
    ``state_dict()``) on every rank (collective over all ranks; bounded). It travels as
    ``torch.save`` bytes and is read with ``torch.load(weights_only=True)``, which rebuilds data
    only: a rank cannot make another run code, as an unpickled object could."""
    raw = None
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        raw = buffer.getvalue()
    length = torch.tensor([len(raw) if raw is not None else 0], dtype=torch.int64)
    with bounded_collective(f"{what} (size)") as collective:
        collective.wait([hvd.broadcast_async_(length, root_rank=0, name=f"{name}.size")])
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw is not None else \
        torch.empty(int(length.item()), dtype=torch.uint8)
    with bounded_collective(what, int(length.item())) as collective:
        collective.wait([hvd.broadcast_async_(payload, root_rank=0, name=f"{name}.bytes")])
    if hvd.rank() == 0:
        return state
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
