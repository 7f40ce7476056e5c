"""Flat per-dtype storage: pure local logic, no Horovod."""
import pytest
import torch

from hvd_averaging.flat_storage import is_dense_permutation, pack


@pytest.mark.parametrize("tensor, dense", [
    (torch.empty(4, 5), True),
    (torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last), True),
    (torch.empty(4, 6).t(), True),
    (torch.empty(1, 7), True),
    (torch.empty(0, 3), True),
    (torch.empty(4, 6)[:, ::2], False),        # gaps
    (torch.empty(3, 1).expand(3, 4), False),   # overlap (stride 0)
    (torch.empty(4, 6)[1:], True),             # dense, though it does not own its storage
])
def test_is_dense_permutation(tensor, dense):
    assert is_dense_permutation(tensor.shape, tensor.stride()) is dense


def params(*shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]


def test_pack_moves_tensors_into_one_slab_per_dtype_keeping_values_and_layout():
    conv = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    tensors = [conv] + params((4, 6), (6,)) + params((3,), dtype=torch.float64)
    values = [t.detach().clone() for t in tensors]
    ids = [id(t) for t in tensors]
    packing = pack(tensors)
    assert [id(t) for t in tensors] == ids
    assert [s.dtype for s in packing.slabs] == [torch.float32, torch.float64]
    assert [len(s.bound) for s in packing.slabs] == [3, 1] and packing.extra_bytes == 0
    for t, v in zip(tensors, values):
        assert torch.equal(t, v) and t.stride() == v.stride()
    assert conv.is_contiguous(memory_format=torch.channels_last)
    flat = packing.slabs[0].flat
    start = flat.data_ptr()
    assert {t.data_ptr() for t in tensors[:3]} <= set(range(start, start + flat.numel() * 4))
    # the slab is the tensors' storage: writing it writes them
    flat.fill_(2.0)
    assert all(bool((t == 2).all()) for t in tensors[:3])
    assert packing.still_bound()


def test_an_optimizer_step_and_load_state_dict_write_into_the_slab():
    model = torch.nn.Linear(3, 2)
    packing = pack(list(model.parameters()))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert torch.equal(packing.slabs[0].flat[:6].view(2, 3), model.weight.detach())
    model.load_state_dict({"weight": torch.zeros(2, 3), "bias": torch.ones(2)})
    assert packing.still_bound()
    assert packing.slabs[0].flat.tolist() == [0.0] * 6 + [1.0] * 2


def test_replacing_data_is_detected():
    model = torch.nn.Linear(3, 2)
    packing = pack(list(model.parameters()))
    model.weight.data = torch.zeros(2, 3)
    assert not packing.still_bound()


def test_views_shared_storage_and_bfloat16_are_copied_through_their_slot():
    base = torch.randn(4, 6)
    views = [torch.nn.Parameter(base[:2]), torch.nn.Parameter(base[2:])]  # one storage
    strided = torch.nn.Parameter(torch.randn(4, 6)[:, ::2])
    half = params((5,), dtype=torch.bfloat16)
    tensors = views + [strided] + half
    values = [t.detach().clone() for t in tensors]
    packing = pack(tensors)
    assert all(len(s.bound) == 0 for s in packing.slabs)
    assert packing.slabs[1].wire_dtype == torch.float32 and packing.slabs[1].dtype == torch.bfloat16
    for slab in packing.slabs:
        slab.copy_in()
        slab.flat.mul_(2)
        slab.copy_out()
    for t, v in zip(tensors, values):
        assert torch.equal(t.detach(), (v.float() * 2).to(v.dtype))
    assert views[0].data_ptr() == base.data_ptr()  # still sharing the user's storage
    assert packing.extra_bytes == 4 * (24 + 12 + 5)


def test_without_bind_buffers_are_reused_per_dtype():
    reuse = {}
    grads = [torch.randn(3), torch.randn(2).to(torch.bfloat16)]
    first = pack(grads, bind=False, reuse=reuse)
    second = pack([torch.randn(3), torch.randn(2).to(torch.bfloat16)], bind=False, reuse=reuse)
    assert [s.flat.data_ptr() for s in first.slabs] == [s.flat.data_ptr() for s in second.slabs]
    assert first.slabs[0].flat.data_ptr() != first.slabs[1].flat.data_ptr()
    assert all(len(s.bound) == 0 for s in first.slabs)


def test_views_into_other_buffers_follow_each_tensors_place():
    """An average that arrives in other buffers laid out like the slabs: each tensor's view
    there holds exactly the values at its place (bound with its strides, copied contiguous,
    bfloat16 travelling as float32)."""
    conv = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    base = torch.randn(4, 6)
    shared_view = torch.nn.Parameter(base[1:])  # does not own its storage: copied through
    tensors = [conv, shared_view] + params((6,)) + params((3,), dtype=torch.float64) + \
        params((5,), dtype=torch.bfloat16)
    packing = pack(tensors)
    for slab in packing.slabs:
        slab.copy_in()
    arrived = [slab.flat.clone() * 2 + 1 for slab in packing.slabs]  # what a round brings
    expected = [(t.detach().to(a.dtype) * 2 + 1) for t, a in
                zip(tensors, [arrived[0]] * 3 + [arrived[1], arrived[2]])]
    views = packing.views_into(arrived)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    for view, want in zip(views, expected):
        torch.testing.assert_close(view, want, rtol=0, atol=0)
    views[0].fill_(7.0)  # writes land in the arrived buffer, at the tensor's place
    assert int((arrived[0] == 7.0).sum()) == conv.numel()


def test_move_to_new_storage_keeps_values_away_from_late_writes():
    """What a timed-out round does: bound tensors move to new buffers with their values, a late
    write into the old buffers no longer reaches them; if the round had completed meanwhile,
    they take its whole result instead. Copied tensors get slots in the new buffers."""
    from hvd_averaging.flat_storage import pack
    a = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    b = torch.nn.Parameter(torch.ones(4))
    base = torch.zeros(10)
    view = base[2:6]  # a view: copied through its slot, never bound
    packing = pack([a, b, view], bind=True)
    old = packing.slabs[0].flat
    packing.move_to_new_storage(finished=lambda: False)
    old.fill_(99.0)  # the late round writes its average into the old buffer
    assert torch.equal(a.detach(), torch.arange(6.0).reshape(2, 3)) and torch.equal(b.detach(), torch.ones(4))
    assert packing.still_bound() and packing.slabs[0].flat.data_ptr() != old.data_ptr()
    assert a.data_ptr() == packing.slabs[0].flat.data_ptr()
    packing.slabs[0].copy_in()
    assert torch.equal(packing.slabs[0].copied_slots[0], torch.zeros(4))
    old2 = packing.slabs[0].flat
    old2.fill_(7.0)  # the round completed while the values were copied
    packing.move_to_new_storage(finished=lambda: True)
    assert torch.equal(a.detach(), torch.full((2, 3), 7.0)) and torch.equal(b.detach(), torch.full((4,), 7.0))


class FailingAllocations:
    """``torch.empty_like`` failing as a GPU without room for a second copy does, on the calls
    numbered in ``failing`` (0-based); the others allocate."""

    def __init__(self, monkeypatch, failing):
        self.calls, self.failing = 0, set(failing)
        real = torch.empty_like

        def empty_like(*args, **kwargs):
            call, self.calls = self.calls, self.calls + 1
            if call in self.failing:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")
            return real(*args, **kwargs)
        monkeypatch.setattr(torch, "empty_like", empty_like)


def two_slab_packing():
    a = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    b = torch.nn.Parameter(torch.arange(4.0, dtype=torch.float64))
    packing = pack([a, b], bind=True)
    return packing, [a, b], [a.detach().clone(), b.detach().clone()]


def test_move_that_cannot_allocate_changes_nothing_and_says_why(monkeypatch):
    """No room for the second copy, on the device nor in host memory: a MemoryError naming the
    bytes, raised before anything changed (at the commit before, the first slab's buffer was
    replaced before the second allocation raised OutOfMemoryError, leaving the packing pointing
    at a buffer no tensor lives in)."""
    packing, tensors, values = two_slab_packing()
    flats = [slab.flat for slab in packing.slabs]
    FailingAllocations(monkeypatch, failing=range(1, 100))  # the second buffer, every try
    with pytest.raises(MemoryError, match=r"no room for a second copy of 56 bytes"):
        packing.move_to_new_storage(finished=lambda: False)
    assert [slab.flat for slab in packing.slabs] == flats and packing.still_bound()
    for t, flat in zip(tensors, flats):
        assert t.data_ptr() == flat.data_ptr()
    for t, v in zip(tensors, values):
        assert torch.equal(t.detach(), v)


def test_move_falls_back_to_a_second_try_in_host_memory(monkeypatch):
    """The device cannot hold the copy (its allocation fails once): the buffers come from host
    memory, every tensor moves with its value, and a late write into the old buffers no longer
    reaches them (on this CPU-only host the second try is in the same memory)."""
    packing, tensors, values = two_slab_packing()
    flats = [slab.flat for slab in packing.slabs]
    allocations = FailingAllocations(monkeypatch, failing={1})
    assert packing.move_to_new_storage(finished=lambda: False) is None  # the tensors stay on cpu
    assert allocations.calls == 4  # two buffers tried on the device, then both in host memory
    for flat in flats:
        flat.fill_(99.0)  # the late round's write
    for t, v in zip(tensors, values):
        assert torch.equal(t.detach(), v)
    assert packing.still_bound()
    assert all(slab.flat.data_ptr() != old.data_ptr() for slab, old in zip(packing.slabs, flats))
