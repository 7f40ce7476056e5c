"""The ways tensors travel: node-aware stages equal the flat average, float16 on the wire stays
within its stated bound and never turns a value into inf. Every check compares with the exact
average of all ranks' values, gathered from the other ranks."""
import os

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, param
from hvd_averaging.communication import averaging_route, average_tensors
from hvd_averaging.transports import Fp16Wire, NodeAware, fp16_error_bound, fp16_scale

U32 = 2.0 ** -24  # float32 unit roundoff
NUMEL = 300_007  # above the node-aware threshold (1 MiB in float32), not divisible by 2, 3 or 4


def random_params(rank, numel=NUMEL, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    big = torch.nn.Parameter(torch.randn(numel, generator=g) * scale)
    small = torch.nn.Parameter(torch.randn(5, 7, generator=g).double())
    for p in (big, small):
        p.grad = torch.zeros_like(p)
    return [big, small]


def exact_mean(tensor):
    """The exact (float64) average over all ranks and the mean magnitude, from every rank's values."""
    every = hvd.allgather(tensor.detach().double().reshape(1, -1), name="test.exact")
    return every.mean(0).reshape(tensor.shape), every.abs().mean(0).reshape(tensor.shape)


def pseudo_nodes(world, rail_allreduce=False):
    """On one host: pairs of ranks as nodes, to drive the node-aware stages (on the emulated
    cluster the pairs are the real nodes); the rail crosses with reduce-scatter + allgather
    (as over MPI) or with one allreduce (as over Gloo)."""
    pairs = [[r, r + 1] for r in range(0, world, 2)]
    rails = [list(range(0, world, 2)), list(range(1, world, 2))]
    node_sets = [hva.process_set(p) for p in pairs]
    rail_sets = [hva.process_set(r) for r in rails]
    rank = hvd.rank()
    mine = lambda sets, groups: next(s for s, g in zip(sets, groups) if rank in g)  # noqa: E731
    return NodeAware(mine(node_sets, pairs), mine(rail_sets, rails), 2, world // 2, rail_allreduce)


def drive(transport, buffer, name):
    """One buffer's round through ``transport``, driven to the end; its average."""
    transfer = transport.start([buffer], [name], f"test {name}")
    while not transfer.advance():
        pass
    return transfer.result[0]


def expected_route(world):
    """The emulated-cluster suites run 2 nodes x 2 ranks (HVA_TEST_NODES=2); one host otherwise."""
    nodes = int(os.environ.get("HVA_TEST_NODES", "1"))
    return "node-aware" if nodes > 1 and world // nodes > 1 else "flat"


def test_route_follows_the_placement_and_counts_what_crosses(world, rank):
    params = random_params(rank)
    hva.reset_traffic()
    hva.average_parameters(params)
    route = averaging_route(hvd.global_process_set, NUMEL * 4)
    assert hvd.allgather_object(route) == [expected_route(world)] * world
    # small buffers stay flat: four stages would cost more latency than they save
    assert averaging_route(hvd.global_process_set, 1000) == "flat"
    counters = hva.traffic()
    nbytes = NUMEL * 4 + 35 * 8
    assert counters.bytes == nbytes and counters.global_allreduces == 1
    nodes = int(os.environ.get("HVA_TEST_NODES", "1"))
    if route == "node-aware":
        per_node = world // nodes
        # both dtype buffers take the round's way; the rail carries each one's node share
        # (and, over MPI, its rail share again for the allgather)
        shares = [NUMEL * 4 // per_node, 35 * 8 // per_node]
        rail_extra = [0, 0] if not hvd.mpi_enabled() else [sh // nodes for sh in shares]
        assert counters.cross_node_bytes == sum(shares) + sum(rail_extra)
    else:
        assert counters.cross_node_bytes == (nbytes if nodes > 1 else 0)


@pytest.mark.parametrize("rail_allreduce", [False, True])
def test_node_aware_equals_flat_within_float_reassociation(world, rank, rail_allreduce):
    """Both within (R + 2) * 2**-24 * mean_j |x_j| of the exact average, elementwise."""
    flat_params = random_params(rank, seed=1)
    staged_params = random_params(rank, seed=1)
    exact, mean_abs = exact_mean(flat_params[0])
    average_tensors(flat_params, node_aware=False, name="test.flat")
    if world >= 4 and world % 2 == 0:
        if expected_route(world) == "node-aware":
            average_tensors(staged_params, node_aware=True, name=f"test.staged.{rail_allreduce}")
            assert averaging_route(hvd.global_process_set, NUMEL * 4) == "node-aware"
        else:
            buffer = staged_params[0].detach().clone()
            staged_params[0].data.copy_(drive(pseudo_nodes(world, rail_allreduce), buffer,
                                              f"test.pseudo.{rail_allreduce}"))
    else:
        average_tensors(staged_params, name=f"test.staged.{rail_allreduce}")  # nothing to stage
    bound = (world + 2) * U32 * mean_abs + 1e-30
    for result in (flat_params[0], staged_params[0]):
        assert bool(((result.double() - exact).abs() <= bound).all())
    assert bool(((staged_params[0] - flat_params[0]).double().abs() <= 2 * bound).all())
    # every rank holds the same average
    digest = float(staged_params[0].detach().double().sum())
    assert hvd.allgather_object(digest) == [digest] * world


@pytest.mark.parametrize("rail_allreduce", [False, True])
def test_node_aware_comes_back_in_place_for_any_length(world, rank, rail_allreduce):
    if world < 4 or world % 2:
        assert averaging_route(hvd.global_process_set, 1 << 30) == expected_route(world)
        return
    transport = pseudo_nodes(world, rail_allreduce)
    for numel in (1, 3, world + 1, 4099):
        values = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        out = drive(transport, values.clone(), f"test.len{numel}.{rail_allreduce}")
        expected = torch.arange(numel, dtype=torch.float32) * (world + 1) / 2
        assert torch.allclose(out, expected, rtol=1e-6), numel


@pytest.mark.parametrize("node_aware", [False, True])
def test_fp16_wire_within_bound_and_no_inf(world, rank, node_aware):
    # magnitudes far beyond float16 (65504) next to small ones: scaled, never inf
    params = random_params(rank, seed=2, scale=1e6)
    with torch.no_grad():
        params[0][:1000] *= 1e-9
    exact, mean_abs = exact_mean(params[0])
    absmax = max(hvd.allgather_object(float(params[0].detach().abs().max())))
    hva.reset_traffic()
    if node_aware and world >= 4 and world % 2 == 0 and expected_route(world) == "flat":
        wire = Fp16Wire(pseudo_nodes(world), hvd.global_process_set, world)
        out = drive(wire, params[0].detach().clone(), "test.fp16.pseudo")
        scale = wire.last_scales[0]
    else:
        average_tensors(params, compression=hvd.Compression.fp16, node_aware=node_aware,
                        name=f"test.fp16.{node_aware}")
        out = params[0].detach()
        assert hva.traffic().bytes == (NUMEL + 35) * 2  # float16 on the wire
        scale = None
    assert out.dtype == torch.float32 and params[1].dtype == torch.float64
    assert bool(torch.isfinite(out).all())
    scale = scale if scale is not None else fp16_scale(absmax, world)
    bound = fp16_error_bound(mean_abs, world, scale)
    error = (out.double() - exact).abs()
    assert bool((error <= bound * 1.01).all()), float((error / bound).max())
    # and it is a real error bound, not a vacuous one: float16 does lose bits here
    assert float(error.max()) > 0


def test_fp16_is_not_horovods_silent_inf(world, rank):
    """The hazard it avoids: Horovod's own fp16 compression turns 1e5 into inf."""
    value = torch.full((4,), 1e5)
    theirs = hvd.allreduce(value, op=hvd.Average, compression=hvd.Compression.fp16, name="test.hvdfp16")
    assert bool(torch.isinf(theirs).all())
    mine = [param(1e5 * (rank + 1), shape=(4,))]
    average_tensors(mine, compression=hvd.Compression.fp16, name="test.fp16big")
    expected = 1e5 * (world + 1) / 2
    assert torch.allclose(mine[0].detach(), torch.full((4,), expected), rtol=2 ** -10)


def test_fp16_non_finite_raises_on_every_rank_naming_the_tensor(world, rank):
    bad = world - 1
    params = [param(rank + 1.0), param(rank + 2.0, shape=(2, 2))]
    if rank == bad:
        with torch.no_grad():
            params[1][1, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    error = expect_error_on_every_rank(
        lambda: hva.average_parameters(params, compression=hvd.Compression.fp16), hva.NonFiniteError)
    if rank == bad:
        assert f"tensor #1 (shape (2, 2), dtype torch.float32) has 1 NaN/Inf value(s) on rank {bad}" in str(error)
    else:
        assert f"rank {bad} holds NaN/Inf" in str(error)
    for p, b in zip(params, before):  # nothing moved
        assert torch.equal(p.detach(), b)
    with torch.no_grad():  # the same tensors average once finite
        params[1].fill_(rank + 2.0)
    hva.average_parameters(params, compression=hvd.Compression.fp16)
    assert hvd.allgather_object(float(params[1][1, 0].detach())) == [sum(range(world)) / world + 2.0] * world


@pytest.mark.parametrize("kwargs", [{"compression": "fp16"}, {"compression": hvd.Compression.fp16()}])
def test_bad_compression_raises_on_every_rank(kwargs):
    error = expect_error_on_every_rank(lambda: hva.PeriodicModelAverager(period=2, **kwargs),
                                       (ValueError, RuntimeError))
    assert "compression must be hvd.Compression.none or hvd.Compression.fp16" in str(error) or \
        "raised an error" in str(error)


def test_hierarchical_fp16_only_on_the_top_level(world, rank):
    hierarchy = {2: 2, 4: world} if world >= 4 else {4: world}
    averager = hva.HierarchicalModelAverager(hierarchy, compression={4: hvd.Compression.fp16})
    params = [param(rank + 0.1)]
    hva.reset_traffic()
    averager.average_parameters(params)  # step 0: top level, float16 on the wire
    assert hva.traffic().bytes == 3 * 2
    values = hvd.allgather_object(float(params[0][0].detach()))
    assert max(abs(v - (sum(range(world)) / world + 0.1)) for v in values) <= 2 ** -10 * world
    if world >= 4:
        for _ in range(2):
            averager.average_parameters(params)  # step 1 nothing, step 2 pairs in float32
        assert hva.traffic().bytes == 3 * 2 + 3 * 4
