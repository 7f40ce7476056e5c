"""The three averagers and the one-shot utility, on real Horovod ranks."""
import warnings

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, gathered, param


def mean(values):
    return sum(values) / len(values)


def test_allreduce_of_rank_is_mean_of_all_ranks(world, rank):
    p = param(rank)
    hva.average_parameters([p])
    assert torch.equal(p.data, torch.full((3,), (world - 1) / 2))
    assert gathered(p[0]) == [(world - 1) / 2] * world


@pytest.mark.parametrize("warmup,expected", [
    (12, [12, 16, 20]), (13, [13, 17, 21]), (14, [14, 18, 22]), (15, [15, 19, 23]),
])
def test_periodic_firing_table(world, rank, warmup, expected):
    averager = hva.PeriodicModelAverager(period=4, warmup_steps=warmup)
    fired = []
    for step in range(24):
        p = param(rank * 10 + step)
        averager.average_parameters([p])
        if p[0].detach().item() != rank * 10 + step:
            assert p[0].detach().item() == pytest.approx(mean([r * 10 + step for r in range(world)]))
            fired.append(step)
    assert averager.step == 24
    assert fired == expected
    assert hvd.allgather_object(fired) == [expected] * world


def _level_of(value, rank, world):
    """Which level averaged a parameter that held ``rank`` before the call."""
    pair = rank // 2 * 2
    if value == rank:
        return None
    if world >= 4 and value == (pair + pair + 1) / 2:
        return "pairs"
    if value == (world - 1) / 2:
        return "world"
    raise AssertionError(f"rank {rank}: value {value} is neither own, pair nor world mean")


@pytest.mark.parametrize("hierarchy", [{2: 2, 4: 4}, {4: 4, 2: 2}])
def test_hierarchical_schedule_and_group_means(world, rank, hierarchy):
    sizes = {period: min(size, world) for period, size in hierarchy.items()}
    averager = hva.HierarchicalModelAverager(sizes, warmup_steps=10)
    assert list(averager.period_process_set_dict) == [2, 4]
    levels = {}
    for step in range(26):
        p = param(rank)
        averager.average_parameters([p])
        levels[step] = _level_of(p[0].detach().item(), rank, world)
    pair_level = "pairs" if world >= 4 else "world"  # on 2 ranks the pair is the world
    assert [s for s, lv in levels.items() if lv == "world"] == (
        [12, 16, 20, 24] if world >= 4 else [10, 12, 14, 16, 18, 20, 22, 24])
    if world >= 4:
        assert [s for s, lv in levels.items() if lv == pair_level] == [10, 14, 18, 22]
    assert all(lv is None for s, lv in levels.items() if s < 10 or s % 2)


def test_hierarchical_pairs_mean_is_per_group(world, rank):
    if world != 4:
        # the values below are the 4-rank case of the issue; on 2 ranks a pair is the world
        expected = [0.5] * world
    else:
        expected = [0.5, 0.5, 2.5, 2.5]
    averager = hva.HierarchicalModelAverager({2: 2, 4: world}, warmup_steps=0)
    averager.step = 2  # pairs only (2 % 4 != 0)
    p = param(rank)
    averager.average_parameters([p])
    assert gathered(p[0]) == expected


def test_param_groups_generators_and_skipped_grads(world, rank):
    a, b = param(rank), param(2 * rank)
    frozen = torch.nn.Parameter(torch.full((2,), float(rank)))  # no grad: skipped
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b, frozen], "lr": 0.5}], lr=0.1)
    hva.average_parameters(opt.param_groups)
    assert a[0].detach().item() == mean(range(world)) and b[0].detach().item() == 2 * mean(range(world))
    assert torch.equal(frozen.data, torch.full((2,), float(rank)))
    c = param(rank)
    hva.average_parameters(x for x in [c])
    assert gathered(c[0]) == [mean(range(world))] * world


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_each_dtype_averaged_in_its_own_dtype(world, rank, dtype):
    # rank + 1/8 is exact in every dtype; so is the mean over 2 or 4 ranks
    p = param(rank + 0.125, dtype=dtype, shape=(4, 5))
    ident = id(p)
    hva.average_parameters([p])
    assert id(p) == ident and p.dtype == dtype and p.shape == (4, 5)
    assert torch.equal(p.data, torch.full((4, 5), mean(range(world)) + 0.125, dtype=dtype))


def test_mixed_dtypes_in_one_call(world, rank):
    ps = [param(rank, d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]
    ps.append(param(rank + 1, torch.float32, shape=(7,)))
    hva.average_parameters(ps)
    for p in ps[:4]:
        assert p[0].detach().item() == mean(range(world)), p.dtype
    assert ps[4][0].detach().item() == mean(range(world)) + 1


def test_bfloat16_rounds_once_from_float32(world, rank):
    # values that differ below bfloat16's precision: the mean is computed in float32 and
    # rounded once, so it equals the float32 mean rounded to bfloat16
    values = [1.0 + r * 2 ** -7 for r in range(world)]
    p = param(values[rank], torch.bfloat16)
    hva.average_parameters([p])
    want = torch.tensor(mean([float(torch.tensor(v, dtype=torch.bfloat16)) for v in values]),
                        dtype=torch.float32).to(torch.bfloat16)
    assert p[0].detach().item() == want.detach().item()


def test_non_contiguous_and_channels_last_keep_layout(world, rank):
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 2, 2) + rank
    cl = torch.nn.Parameter(base.clone().to(memory_format=torch.channels_last))
    cl.grad = torch.zeros_like(cl)
    tr = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3).t() + rank)
    tr.grad = torch.zeros_like(tr)
    assert not tr.is_contiguous()
    hva.average_parameters([cl, tr])
    assert cl.is_contiguous(memory_format=torch.channels_last)
    assert not tr.is_contiguous()
    offset = mean(range(world))
    assert torch.equal(cl.data, torch.arange(24.0).reshape(2, 3, 2, 2) + offset)
    assert torch.equal(tr.data, torch.arange(6.0).reshape(2, 3).t() + offset)


def test_ranks_outside_subset_untouched_but_count_steps(world, rank):
    subset = hva.process_set([0, 1])
    assert hva.process_set([1, 0]) is subset  # shared, never registered twice
    averager = hva.PeriodicModelAverager(period=2, process_set=subset)
    values = []
    for _ in range(3):
        p = param(rank)
        averager.average_parameters([p])
        values.append(p[0].detach().item())
    assert averager.step == 3
    if rank in (0, 1):
        assert values == [0.5, rank, 0.5]
    else:
        assert values == [rank] * 3
    # the global level still works after subset-only collectives
    q = param(rank)
    hva.average_parameters([q])
    assert q[0].detach().item() == mean(range(world))


def test_user_grouped_calls_on_own_sets_do_not_hang_averaging(world, rank):
    # Horovod hazard: grouped calls by only some ranks desynchronize grouped calls elsewhere
    user_set = hva.process_set([0, 1])
    if rank in (0, 1):
        t = torch.full((2,), float(rank))
        hvd.grouped_allreduce_([t], op=hvd.Average, process_set=user_set)
        assert t[0].detach().item() == 0.5
    averager = hva.HierarchicalModelAverager({2: min(2, world), 4: world})
    averager.step = 4
    p = param(rank)
    averager.average_parameters([p])
    assert gathered(p[0]) == [mean(range(world))] * world


def test_empty_parameter_list_advances_step(world, rank):
    averager = hva.PeriodicModelAverager(period=2)
    frozen = torch.nn.Parameter(torch.ones(2))  # grad None: nothing to average
    for _ in range(4):
        averager.average_parameters([frozen])
    assert averager.step == 4
    assert hvd.allgather_object(averager.step) == [4] * world


def test_state_dict_round_trip_continues_schedule(world, rank):
    def run(steps, averager):
        fired = []
        for _ in range(steps):
            p = param(rank)
            averager.average_parameters([p])
            if p[0].detach().item() != rank:
                fired.append(averager.step - 1)
        return fired

    full = run(20, hva.PeriodicModelAverager(period=3, warmup_steps=5))
    first = hva.PeriodicModelAverager(period=3, warmup_steps=5)
    head = run(9, first)
    state = first.state_dict()
    assert state["step"] == 9
    resumed = hva.PeriodicModelAverager(period=3, warmup_steps=5)
    resumed.load_state_dict(state)
    assert head + run(11, resumed) == full == [5, 8, 11, 14, 17]

    h_full = run(26, hva.HierarchicalModelAverager({2: min(2, world), 4: world}, 10))
    h_first = hva.HierarchicalModelAverager({2: min(2, world), 4: world}, 10)
    h_head = run(13, h_first)
    h_resumed = hva.HierarchicalModelAverager({4: world, 2: min(2, world)}, 10)
    h_resumed.load_state_dict(h_first.state_dict())
    assert h_head + run(13, h_resumed) == h_full


def test_load_state_dict_with_different_steps_raises_everywhere(world, rank):
    averager = hva.PeriodicModelAverager(period=4)
    error = expect_error_on_every_rank(
        lambda: averager.load_state_dict({"step": 7 if rank == 0 else 8}), RuntimeError)
    assert "differs across ranks" in str(error)
    error = expect_error_on_every_rank(lambda: averager.load_state_dict({"step": -1}), ValueError)
    assert "must be an integer >= 0, got -1" in str(error)


@pytest.mark.parametrize("kwargs,match", [
    ({"period": 0}, "period must be >= 1, got 0"),
    ({"period": 4, "warmup_steps": -2}, "warmup_steps must be >= 0, got -2"),
    ({"period": 2.0}, "period must be an integer, got 2.0"),
])
def test_periodic_bad_arguments_raise_on_every_rank(kwargs, match):
    error = expect_error_on_every_rank(lambda: hva.PeriodicModelAverager(**kwargs), ValueError)
    assert match in str(error)


@pytest.mark.parametrize("hierarchy,match", [
    (None, "must be a non-empty mapping"),
    ({}, "is empty"),
    ({2: 3, 4: "world"}, "does not divide the process set size"),
    ({2: "world", 4: 1}, "must not decrease"),
    ({2: 1, 4: 1}, "must equal the process set size"),
])
def test_hierarchical_bad_arguments_raise_on_every_rank(world, hierarchy, match):
    if hierarchy:
        hierarchy = {k: (world if v == "world" else v) for k, v in hierarchy.items()}
    error = expect_error_on_every_rank(
        lambda: hva.HierarchicalModelAverager(hierarchy), ValueError)
    assert match in str(error)


def test_bad_argument_on_one_rank_raises_on_all_without_hang(rank):
    error = expect_error_on_every_rank(
        lambda: hva.PeriodicModelAverager(period=0 if rank == 0 else 4), (ValueError, RuntimeError))
    if rank == 0:
        assert isinstance(error, ValueError) and "period must be >= 1, got 0" in str(error)
    else:
        assert isinstance(error, RuntimeError) and "rank(s) [0] raised" in str(error)


def test_config_mismatch_across_ranks_names_the_ranks(world, rank):
    error = expect_error_on_every_rank(
        lambda: hva.PeriodicModelAverager(period=4 if rank == 0 else 8), RuntimeError)
    assert "differs across ranks" in str(error)
    if rank == 0:
        assert f"ranks {list(range(1, world))} have something else" in str(error)
    error = expect_error_on_every_rank(
        lambda: hva.HierarchicalModelAverager({2: 1, 4: world}, warmup_steps=rank % 2),
        RuntimeError)
    assert "HierarchicalModelAverager arguments differs across ranks" in str(error)


def test_layout_mismatch_raises_instead_of_hanging(world, rank):
    extra = [param(1.0, torch.float16)] if rank == world - 1 else []  # a dtype only one rank has
    error = expect_error_on_every_rank(
        lambda: hva.average_parameters([param(rank)] + extra), RuntimeError)
    assert "differ across ranks" in str(error) or "differs across ranks" in str(error)
    shape = (2, 3) if rank == 0 else (3, 2)  # same size, different shape
    error = expect_error_on_every_rank(
        lambda: hva.average_parameters([param(rank, shape=shape)]), RuntimeError)
    assert "differs across ranks" in str(error)


def test_bad_entries_and_tensors(rank):
    with pytest.raises(TypeError, match="expected torch.nn.Parameter, got Tensor"):
        hva.average_parameters([torch.ones(2)])
    with pytest.raises(TypeError, match="expected torch.nn.Parameter, got str"):
        hva.average_parameters(["weight"])
    with pytest.raises(TypeError, match="without a 'params' key"):
        hva.average_parameters([{"lr": 0.1}])
    sparse = torch.nn.Parameter(torch.eye(3).to_sparse())
    sparse.grad = torch.zeros(3, 3).to_sparse()
    error = expect_error_on_every_rank(lambda: hva.average_parameters([sparse]), ValueError)
    assert "only dense tensors" in str(error)


def test_period_one_warns_at_caller():
    with pytest.warns(UserWarning, match="period is 1") as record:
        hva.PeriodicModelAverager(period=1)
    assert record[0].filename == __file__
    with pytest.warns(UserWarning, match="largest period of the hierarchy is 1"):
        hva.HierarchicalModelAverager({1: hvd.size()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hva.PeriodicModelAverager(period=2)


def test_process_set_validation():
    with pytest.raises(ValueError, match="at least one rank"):
        hva.process_set([])
    with pytest.raises(ValueError, match=r"must lie in 0\.\."):
        hva.process_set([0, hvd.size()])
    with pytest.raises(ValueError, match="duplicates"):
        hva.process_set([0, 0])
    assert hva.process_set(range(hvd.size())) is hvd.global_process_set
