"""The ways tensors travel: node-aware stages equal the flat average, float16 on the wire stays
within its stated bound and never turns a value into inf. Every check compares with the exact
average of all ranks' values, gathered from the other ranks."""
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, param
from hvd_averaging.rounds import average_tensors
from hvd_averaging.routes import averaging_route, routes
from hvd_averaging.traffic import interface_tx_bytes
from hvd_averaging.transports import (FlatAllreduce, InPieces, NodeAware, ReduceScatterAllgather,
                                      Transport)
from hvd_averaging.wire import COMPRESSION_CHOICES, Fp16Wire, fp16_error_bound, fp16_scale

U32 = 2.0 ** -24  # float32 unit roundoff
NUMEL = 300_007  # above the node-aware threshold (1 MiB in float32), not divisible by 2, 3 or 4
NODES = int(os.environ.get("HVA_TEST_NODES", "1"))


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
    cluster the pairs are the real nodes). As over MPI (``rail_allreduce`` False): Horovod's
    reduce-scatter in the node and reduce-scatter + allgather on the rail; as over Gloo: an
    alltoall and a local sum in the node and one allreduce on the rail."""
    pairs = [[r, r + 1] for r in range(0, world, 2)]
    rails = [list(range(0, world, 2)), list(range(1, world, 2))]
    node_sets = [hva.process_set(p) for p in pairs]
    rail_sets = [hva.process_set(r) for r in rails]
    rank = hvd.rank()
    mine = lambda sets, groups: next(s for s, g in zip(sets, groups) if rank in g)  # noqa: E731
    rail_set = mine(rail_sets, rails)
    rail = (FlatAllreduce(rail_set, True) if rail_allreduce
            else ReduceScatterAllgather(rail_set, world // 2, True))
    return NodeAware(mine(node_sets, pairs), rail, 2, scatter_by_alltoall=rail_allreduce)


def drive(transport, buffer, name):
    """One buffer's round through ``transport``, driven to the end; its average."""
    transfer = transport.start([buffer], [name], f"test {name}")
    while not transfer.advance():
        time.sleep(1e-4)  # leave the CPU to Horovod's background thread (ranks share 2 cores)
    return transfer.result[0]


def expected_route(world):
    """The emulated-cluster suites run 2 nodes x 2 ranks (HVA_TEST_NODES=2); one host otherwise."""
    return "node-aware" if NODES > 1 and world // NODES > 1 else "flat"


def stages_on_this_run(world) -> bool:
    """Node-aware stages need nodes of 2+ ranks: 4 ranks in pairs (real nodes or pairs of ranks
    standing in for them on one host)."""
    return world >= 4 and world % 2 == 0


STAGES_NEED_4_RANKS = "node-aware stages need at least 2 nodes of 2 ranks: runs on 4 ranks"


@dataclass(frozen=True)
class LinkCount:
    """What this node has sent on its link to the other nodes, as the kernel counts it: bytes
    on ``eth0`` of the node's network namespace (which every rank of the node shares) and TCP
    segments sent again (the link's ``tbf`` drops what overflows its queue; TCP resends it)."""
    sent: int
    resent_segments: int

    @classmethod
    def now(cls) -> "LinkCount":
        sent = interface_tx_bytes("eth0")
        assert sent is not None, "no eth0 in this rank's network namespace: not on an emulated node"
        tcp = [line.split() for line in Path("/proc/self/net/snmp").read_text().splitlines()
               if line.startswith("Tcp:")]
        resent = int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
        return cls(sent, resent)

    def since(self, earlier: "LinkCount") -> "LinkCount":
        return LinkCount(self.sent - earlier.sent, self.resent_segments - earlier.resent_segments)

    def sent_once(self) -> int:
        """At most the bytes sent for the first time: every resent segment taken as a full frame."""
        return max(0, self.sent - 1514 * self.resent_segments)

    def slack(self) -> float:
        """What the link carries beyond the payload: Ethernet/IP/TCP headers and the ACKs for
        what the node receives (under 2% measured, with segmentation offload; 10% allowed), a
        fixed allowance for Horovod's coordination with rank 0 each cycle and the barriers around
        the measurement, and every resent segment as a full frame (1514 bytes)."""
        return 0.10 * self.sent + 128 * 1024 + 1514 * self.resent_segments


def test_route_follows_the_placement_and_counts_what_crosses(world, rank):
    params = random_params(rank)
    hva.average_parameters(params)  # agreement and registration happen here, not measured below
    route = averaging_route(hvd.global_process_set, NUMEL * 4)
    assert hvd.allgather_object(route) == [route] * world  # every rank takes the same way
    if expected_route(world) == "flat":  # one host, or one rank per node under Gloo
        assert route == "flat"
    else:
        # HVA_ROUTE=measure: the first round timed both ways; the faster one was kept
        chosen = routes().decided(hvd.global_process_set, NUMEL * 4)
        assert hvd.allgather_object(chosen.seconds) == [chosen.seconds] * world
        faster = min(chosen.seconds, key=chosen.seconds.get)
        assert route == faster, (route, chosen)
        assert chosen.why.startswith("measured: node-aware "), chosen.why
    # small buffers stay flat: four stages would cost more latency than they save
    assert averaging_route(hvd.global_process_set, 1000) == "flat"
    model_bytes = NUMEL * 4 + 35 * 8
    hvd.barrier()
    link_before = LinkCount.now() if NODES > 1 else None
    hva.reset_traffic()
    hva.average_parameters(params)
    counters = hva.traffic()
    hvd.barrier()
    link = LinkCount.now().since(link_before) if NODES > 1 else None
    assert counters.bytes == model_bytes and counters.global_allreduces == 1
    if NODES == 1:
        assert counters.cross_node_bytes == 0
        return
    hosts = hvd.allgather_object(socket.gethostname())
    counted = hvd.allgather_object(counters.cross_node_bytes)
    counted_here = sum(c for c, h in zip(counted, hosts) if h == socket.gethostname())
    sent = link.sent
    # Measured on the link: the counters never report less than crossed (TCP/IP headers and
    # Horovod's own coordination add a few percent), and a node-aware round sends one model
    # per node across (each node holds its reduced share, sent once and gathered once), where a
    # flat ring over 2 nodes x 2 ranks sends 1.5 models.
    slack = link.slack()
    assert sent <= counted_here + slack, (sent, counted_here)
    if route == "node-aware":
        assert 0.95 * model_bytes <= sent <= model_bytes + slack, (sent, model_bytes)


@pytest.mark.parametrize("rail_allreduce", [False, True])
def test_node_aware_equals_flat_within_float_reassociation(world, rank, rail_allreduce):
    """Both within (R + 2) * 2**-24 * mean_j |x_j| of the exact average, elementwise."""
    if not stages_on_this_run(world):
        pytest.skip(STAGES_NEED_4_RANKS)
    flat_params = random_params(rank, seed=1)
    staged_params = random_params(rank, seed=1)
    exact, mean_abs = exact_mean(flat_params[0])
    average_tensors(flat_params, node_aware=False, name="test.flat")
    if expected_route(world) == "node-aware":
        average_tensors(staged_params, node_aware=True, name=f"test.staged.{rail_allreduce}")
        assert routes().node_aware_sets(hvd.global_process_set) is not None
    else:
        buffer = staged_params[0].detach().clone()
        staged_params[0].data.copy_(drive(pseudo_nodes(world, rail_allreduce), buffer,
                                          f"test.pseudo.{rail_allreduce}"))
    bound = (world + 2) * U32 * mean_abs + 1e-30
    for result in (flat_params[0], staged_params[0]):
        assert bool(((result.double() - exact).abs() <= bound).all())
    assert bool(((staged_params[0] - flat_params[0]).double().abs() <= 2 * bound).all())
    # every rank holds the same average
    digest = float(staged_params[0].detach().double().sum())
    assert hvd.allgather_object(digest) == [digest] * world


@pytest.mark.parametrize("rail_allreduce", [False, True])
def test_node_aware_comes_back_in_place_for_any_length(world, rank, rail_allreduce):
    if not stages_on_this_run(world):
        pytest.skip(STAGES_NEED_4_RANKS)
    transport = pseudo_nodes(world, rail_allreduce)
    for numel in (1, 3, world + 1, 4099):
        values = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        out = drive(transport, values.clone(), f"test.len{numel}.{rail_allreduce}")
        expected = torch.arange(numel, dtype=torch.float32) * (world + 1) / 2
        assert torch.allclose(out, expected, rtol=1e-6), numel


class Counting(Transport):
    """``inner`` itself, keeping the names of every round it was asked to run."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def stages(self, buffers, names):
        self.calls.append(list(names))
        return (yield from self.inner.stages(buffers, names))

    def cross_node_bytes(self, buffers):
        return self.inner.cross_node_bytes(buffers)


@pytest.mark.parametrize("inner", ["flat", "reduce-scatter"])
def test_in_pieces_gives_the_whole_round_average_one_piece_per_stage(world, rank, inner):
    """Piece by piece (each launched when the previous one is collected), within the stages the
    window allows, the same values as the whole buffer's round, on every rank; two buffers of
    different lengths."""
    way = FlatAllreduce(hvd.global_process_set, NODES > 1) if inner == "flat" else \
        ReduceScatterAllgather(hvd.global_process_set, world, NODES > 1)
    g = torch.Generator().manual_seed(rank)
    big = torch.randn(300_007, generator=g)  # 1.2 MB: 4 pieces of at least 256 KiB
    small = torch.randn(70_000, generator=g, dtype=torch.float64)  # 560 kB: 2 pieces
    whole = [big.clone(), small.clone()]
    transfer = way.start(whole, [f"test.whole.{inner}.f", f"test.whole.{inner}.d"], "test whole")
    while not transfer.advance():
        time.sleep(1e-4)
    expected = transfer.result
    pieces = InPieces(Counting(way), window=8)
    buffers = [big.clone(), small.clone()]
    transfer = pieces.start(buffers, [f"test.pieces.{inner}.f", f"test.pieces.{inner}.d"], "test")
    while not transfer.advance():
        time.sleep(1e-4)
    # one after another, within 8 stages less one: the float32 buffer cut in 4 pieces when each
    # takes one stage (flat), in 3 when each takes two (reduce-scatter, allgather); the float64
    # one in 2 (its first piece and a rest too small to cut)
    f, d = f"test.pieces.{inner}.f", f"test.pieces.{inner}.d"
    rest = [[f"{f}.piece2"], [f"{f}.piece3"]] if inner == "flat" else [[f"{f}.piece2"]]
    assert pieces.inner.calls == [[f"{f}.piece0", f"{d}.piece0"], [f"{f}.piece1", f"{d}.piece1"],
                                  *rest], pieces.inner.calls
    for got, want, exact in zip(transfer.result, expected, (big, small)):
        assert got.data_ptr() in (b.data_ptr() for b in buffers)  # in place
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        mean = hvd.allreduce(exact, op=hvd.Average, name=f"test.exact.{inner}.{exact.dtype}")
        assert torch.allclose(got, mean, rtol=1e-5, atol=1e-6)
    every = hvd.allgather(transfer.result[0].reshape(1, -1), name=f"test.pieces.same.{inner}")
    assert all(torch.equal(row, every[0]) for row in every)
    with pytest.raises(ValueError, match=r"window=0 must be a positive int"):
        InPieces(way, window=0)


@pytest.mark.parametrize("kind", ["periodic", "hierarchical"])
def test_rounds_left_in_flight_try_each_way_then_keep_the_cheaper(world, rank, kind):
    """A delayed averager's rounds choose their way apart from blocking rounds (whole rounds
    and rounds in pieces apart): the first four try flat, node-aware, flat, node-aware, each
    reports what it cost the training thread at its apply step, and at the fourth the ranks
    agree (the slowest rank's best round per way) and keep the cheaper way; the rounds after
    it take that way, on trial no more. Every periodic round's average is the exact mean's,
    whichever way it took (the hierarchical ones: test_delay.py's reference)."""
    params = random_params(rank, seed=3 if kind == "periodic" else 4)
    if kind == "periodic":
        averager, pieces = hva.PeriodicModelAverager(period=4, delay=2), 1
    else:  # the top level above pairs travels in up to 2 pieces
        averager = hva.HierarchicalModelAverager({2: max(1, world // 2), 4: world},
                                                 delay={4: 2})
        pieces = 2
    nbytes = NUMEL * 4 + 35 * 8
    for step in range(24):
        before = params[0].detach().clone()
        averager.average_parameters(params)
        if step % 4 == 2 and kind == "periodic":  # applied: nothing moved since its launch
            exact, mean_abs = exact_mean(launched)
            error = (params[0].detach().double() - exact).abs()
            assert bool((error <= (world + 2) * U32 * mean_abs).all()), (step, error.max())
        if step % 4 == 0:
            launched = before
        if step < 14:  # the fourth round is applied at step 14
            assert averaging_route(hvd.global_process_set, nbytes, in_flight_pieces=pieces) in \
                ("to be measured", "flat"), step
        time.sleep(0.01)  # a step of training
    way = averaging_route(hvd.global_process_set, nbytes, in_flight_pieces=pieces)
    assert hvd.allgather_object(way) == [way] * world
    chosen = routes().decided(hvd.global_process_set, nbytes, in_flight_pieces=pieces)
    trials = routes().trials_of(hvd.global_process_set, nbytes, in_flight_pieces=pieces)
    if expected_route(world) == "flat":  # one host, or one rank per node under Gloo
        assert way == "flat" and chosen is None and trials is None
        return
    assert trials.handed == ["flat", "node-aware"] * 2  # none after the choice
    assert all(len(c) == 2 and min(c) > 0 for c in trials.costs.values()), trials.costs
    every = hvd.allgather_object(trials.costs)
    agreed = {w: max(min(costs[w]) for costs in every) for w in ("flat", "node-aware")}
    assert hvd.allgather_object(chosen) == [chosen] * world
    assert chosen.seconds == pytest.approx(agreed, rel=1e-12), (chosen, every)
    assert chosen.why.startswith("tried as it runs, 2 rounds each"), chosen.why
    assert way == ("node-aware" if agreed["node-aware"] < agreed["flat"] else "flat")


@pytest.mark.parametrize("node_aware", [False, True])
def test_fp16_wire_within_bound_and_no_inf(world, rank, node_aware):
    # magnitudes far beyond float16 (65504) next to small ones: scaled, never inf
    params = random_params(rank, seed=2, scale=1e6)
    with torch.no_grad():
        params[0][:1000] *= 1e-9
    exact, mean_abs = exact_mean(params[0])
    absmax = max(hvd.allgather_object(float(params[0].detach().abs().max())))
    hva.reset_traffic()
    if node_aware and stages_on_this_run(world) and expected_route(world) == "flat":
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


@pytest.mark.parametrize("compression,bad_value,tolerance", [
    (hvd.Compression.fp16, float("inf"), 0.0),  # the scaled float16 average is exact here
    ("int8", float("nan"), 1 / 127),  # within one int8 step of the largest value
])
def test_wire_non_finite_raises_on_every_rank_naming_the_tensor(world, rank, compression,
                                                                bad_value, tolerance):
    bad = world - 1
    params = [param(rank + 1.0), param(rank + 2.0, shape=(2, 2))]
    if rank == bad:
        with torch.no_grad():
            params[1][1, 0] = bad_value
    before = [p.detach().clone() for p in params]
    error = expect_error_on_every_rank(
        lambda: hva.average_parameters(params, compression=compression), hva.NonFiniteError)
    if rank == bad:
        assert f"tensor #1 (shape (2, 2), dtype torch.float32) has 1 NaN/Inf value(s) on rank {bad}" in str(error)
        if compression == "int8":
            assert "an int8 round cannot scale it" in str(error)
    else:
        assert f"rank {bad} holds NaN/Inf" in str(error)
    for p, b in zip(params, before):  # nothing moved
        assert torch.allclose(p.detach(), b, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():  # the same tensors average once finite
        params[1].fill_(rank + 2.0)
    hva.average_parameters(params, compression=compression)
    expected = sum(range(world)) / world + 2.0
    values = hvd.allgather_object(float(params[1][1, 0].detach()))
    assert max(abs(v - expected) for v in values) <= tolerance * expected


@pytest.mark.parametrize("kwargs", [{"compression": "int4"}, {"compression": "FP16"},
                                    {"compression": hvd.Compression.fp16()}])
def test_bad_compression_raises_on_every_rank(kwargs):
    # every rank passes the same bad value, so every rank raises the ValueError itself
    error = expect_error_on_every_rank(lambda: hva.PeriodicModelAverager(period=2, **kwargs),
                                       ValueError)
    assert f"compression must be one of {', '.join(COMPRESSION_CHOICES)}" in str(error)
    assert repr(kwargs["compression"]) in str(error)


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
