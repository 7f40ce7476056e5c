"""Where averaged tensors live: one flat buffer per dtype that the tensors view into.

Copying every parameter into a flat buffer before each allreduce and back after it costs two
passes over the whole model, as much time as the allreduce itself on a fast link. So, the first
time a list of tensors is averaged, each tensor that owns its storage is moved into a flat
per-dtype buffer (``tensor.data`` becomes a view of it, with the tensor's own shape and strides,
so channels_last and transposed layouts are kept); later rounds allreduce the buffer directly and
copy nothing. The tensors stay the same Python objects, so optimizers, their state and
``state_dict()``/``load_state_dict()`` (which copies in place) are unaffected.

Tensors that cannot be moved are copied in and out of their slot on every round instead: views
into a larger storage (the user shares that storage on purpose), tensors sharing storage with
another tensor of the list, overlapping or gapped strides, and dtypes that travel as another
dtype (bfloat16 as float32). A tensor whose ``.data`` was later replaced (``model.to()``,
``load_state_dict(assign=True)``) is detected by its data pointer and the packing is rebuilt.

Local logic only: nothing here talks to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Optional, Sequence

import torch

__all__ = ["is_dense_permutation", "StorageMoveError", "DtypeSlab", "Packing", "pack"]

# Horovod's torch ops carry these dtypes natively; others travel in a buffer of the mapped dtype.
WIRE_DTYPE = MappingProxyType({torch.bfloat16: torch.float32})


def is_dense_permutation(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """True when ``stride`` lays ``shape`` out densely with no gaps or overlaps in some dimension
    order (contiguous, channels_last, transposed): exactly ``numel`` consecutive elements."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    if any(sz == 0 for sz in shape):
        return True
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _owns_its_storage(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and is_dense_permutation(t.shape, t.stride())
    )


class StorageMoveError(MemoryError):
    """No memory for a second copy of a packing's buffers, on their device nor on the host."""


def _allocated_like(
        buffers: list[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[torch.device]]:
    """A new buffer like each of ``buffers``: all on their devices, or else all in host memory
    (on a CPU-only model: a second try, the first try's buffers freed). Allocates every buffer
    before anything is changed. Returns the buffers and the host device if it was used."""
    host = torch.device("cpu")
    failures = []
    for device in (None, host):
        try:
            made = [torch.empty_like(b, device=device or b.device) for b in buffers]
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            failures.append(error)
            continue
        moved = device is not None and any(b.device != host for b in buffers)
        return made, (host if moved else None)
    needed = sum(b.numel() * b.element_size() for b in buffers)
    raise StorageMoveError(
        f"no room for a second copy of {needed} bytes on {buffers[0].device} "
        f"({failures[0]}) nor in host memory ({failures[-1]})") from failures[-1]


def _synchronised(buffers: list[torch.Tensor]) -> None:
    """Wait for the copies queued on the current stream of the buffers' GPUs."""
    for device in {b.device for b in buffers if b.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


@dataclass
class DtypeSlab:
    """One dtype's flat buffer and the tensors that live in it (bound) or are copied through it."""

    dtype: torch.dtype
    wire_dtype: torch.dtype
    flat: torch.Tensor
    bound: list[torch.Tensor] = field(default_factory=list)
    copied: list[torch.Tensor] = field(default_factory=list)
    copied_slots: list[torch.Tensor] = field(default_factory=list)

    def copy_in(self) -> None:
        """Copy the tensors that do not live in ``flat`` into their slots."""
        if self.copied:
            with torch.no_grad():
                torch._foreach_copy_(self.copied_slots, self.copied)

    def copy_out(self) -> None:
        """Copy the averaged slots back into the tensors that do not live in ``flat``."""
        if self.copied:
            with torch.no_grad():
                torch._foreach_copy_(self.copied, self.copied_slots)


@dataclass
class Packing:
    """Per-dtype slabs for one list of tensors, in the order of first appearance of each dtype."""

    tensors: list[torch.Tensor]
    slabs: list[DtypeSlab]
    layout: list[tuple[str, tuple[int, ...]]]
    _bound_pointers: list[tuple[torch.Tensor, int]]
    # per tensor: (slab index, offset, strides in the slab or None for a contiguous slot)
    places: list[tuple[int, int, Optional[tuple[int, ...]]]] = field(default_factory=list)
    layout_digest: Optional[int] = None  # set by the rounds layer, once per packing

    def views_into(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's place in ``flats`` (buffers laid out like the slabs, e.g. an average
        that arrived), as a view with the tensor's shape, in the order of ``tensors``."""
        return [flats[slab].as_strided(t.shape, stride, offset) if stride is not None
                else flats[slab][offset:offset + t.numel()].view(t.shape)
                for t, (slab, offset, stride) in zip(self.tensors, self.places)]

    def still_bound(self) -> bool:
        """False once any bound tensor's ``.data`` was replaced (it no longer views its slab)."""
        return all(t.data_ptr() == ptr for t, ptr in self._bound_pointers)

    def move_to_new_storage(self, finished: Callable[[], bool]) -> Optional[torch.device]:
        """Move every bound tensor, with its current value, to new buffers, so that nothing
        written into the old ones from now on reaches it: a round that was interrupted (a
        timeout, ``KeyboardInterrupt``) stays queued in Horovod, and a flat allreduce writes its
        average into the old buffers when a late rank arrives.

        All or nothing: the new buffers are allocated first, on the tensors' device or, where
        it cannot hold a second copy, in host memory (the tensors then live on the host: the
        returned device says so); the values are copied (on a GPU the stream is synchronised,
        so the copy is done before ``finished()`` is read); if the round completed meanwhile,
        the old buffers hold its whole average, which the tensors take instead (never a mix);
        only then are all tensors rebound, in one loop that allocates nothing. The packing
        stays the same (same tensors, same layout), so the next round needs no new cross-rank
        check.

        Returns:
            None, or the host device the tensors now live on.

        Raises:
            StorageMoveError: no room for the new buffers on the device nor on the host;
                nothing was changed (the tensors still live in the old buffers).
        """
        with torch.no_grad():
            old = [slab.flat for slab in self.slabs]
            new, fell_back = _allocated_like(old)
            for source, target in zip(old, new):
                target.copy_(source)
            _synchronised(old)
            if finished():
                for source, target in zip(old, new):
                    target.copy_(source)
                _synchronised(old)
            # every view first; the rebinding below allocates no storage and cannot fail half-way
            views = [new[index].as_strided(t.shape, stride, offset) if stride is not None
                     else new[index][offset:offset + t.numel()].view(t.shape)
                     for t, (index, offset, stride) in zip(self.tensors, self.places)]
            slots: list[list[torch.Tensor]] = [[] for _ in self.slabs]
            for t, view, (index, _, stride) in zip(self.tensors, views, self.places):
                if stride is None:  # copied through its slot: never written by a transfer
                    slots[index].append(view)
                else:
                    t.data = view
            for slab, flat, slab_slots in zip(self.slabs, new, slots):
                slab.flat = flat
                slab.copied_slots = slab_slots
            self._bound_pointers = [(t, t.data_ptr()) for t, _ in self._bound_pointers]
        return fell_back

    @property
    def extra_bytes(self) -> int:
        """Bytes held for tensors that are copied through a slab (the bound ones cost nothing)."""
        return sum(s.flat.element_size() * sum(t.numel() for t in s.copied) for s in self.slabs)


def pack(tensors: list[torch.Tensor], *, bind: bool = True,
         reuse: Optional[dict] = None) -> Packing:
    """Lay ``tensors`` out in per-dtype flat buffers.

    With ``bind`` (parameters, buffers), each tensor that owns its storage is moved into its
    slab: its values are copied once and ``tensor.data`` is made a view of the slab with the
    tensor's shape and strides. Without it (gradients, which autograd replaces every step),
    every tensor is copied through its slot, and buffers come from ``reuse`` (a dict kept by the
    caller, keyed by tensor dtype and device) so that no memory is allocated per call.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    storages: dict[int, int] = {}
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        storages[key] = storages.get(key, 0) + 1

    slabs, bound_pointers, places = [], [], {}
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            wire = WIRE_DTYPE.get(dtype, dtype)
            numel = sum(t.numel() for t in group)
            device = group[0].device
            if reuse is not None and not bind:
                key = (dtype, device)
                flat = reuse.get(key)
                if flat is None or flat.numel() < numel:
                    flat = reuse[key] = torch.empty(numel, dtype=wire, device=device)
                flat = flat[:numel]
            else:
                flat = torch.empty(numel, dtype=wire, device=device)
            slab = DtypeSlab(dtype, wire, flat)
            offset = 0
            for t in group:
                movable = (bind and wire == dtype and t.numel() > 0 and _owns_its_storage(t)
                           and storages[t.untyped_storage().data_ptr()] == 1)
                if movable:
                    view = flat.as_strided(t.shape, t.stride(), offset)
                    view.copy_(t)
                    places[id(t)] = (len(slabs), offset, tuple(t.stride()))
                    t.data = view
                    slab.bound.append(t)
                    bound_pointers.append((t, t.data_ptr()))
                else:
                    slot = flat[offset:offset + t.numel()].view(t.shape)
                    places[id(t)] = (len(slabs), offset, None)
                    slab.copied.append(t)
                    slab.copied_slots.append(slot)
                offset += t.numel()
            slabs.append(slab)
    layout = [(str(t.dtype), tuple(t.shape)) for t in tensors]
    return Packing(list(tensors), slabs, layout, bound_pointers, [places[id(t)] for t in tensors])
