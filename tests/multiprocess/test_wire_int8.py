"""int8 on the wire: within its stated bound of the exact average of every rank's values over
magnitudes 1e-3..1e6 (flat and node-aware), bit-identical on every rank, a quarter of the bytes
counted (and, on the emulated cluster, sent on the link), error
feedback that cancels errors over rounds and resumes bit-identically. (NaN on the wire, for
float16 and int8 alike: test_transports.py.)"""
import os
import time

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, param
from hvd_averaging.rounds import average_tensors
from hvd_averaging.routes import Route, averaging_route, routes
from hvd_averaging.wire import COMPRESSION_CHOICES, Int8, int8_error_bound, window_absmax
from hvd_averaging.wire.int8 import Int8Exchange, Residuals
from hvd_averaging.transports.in_pieces import piece_bounds
from test_transports import LinkCount, pseudo_nodes, stages_on_this_run

NUMEL = 300_007  # above the node-aware threshold, not divisible by 2, 3 or 4
NODES = int(os.environ.get("HVA_TEST_NODES", "1"))
BLOCK = 1024


def wide_values(rank, numel=NUMEL, seed=0):
    """Magnitudes from 1e-3 to 1e6 along the buffer, random signs, different on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    magnitudes = torch.logspace(-3, 6, numel, dtype=torch.float64)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * magnitudes).float()


def every_rank(tensor, name):
    return hvd.allgather(tensor.detach().reshape(1, -1).contiguous(), name=name)


def pseudo_route(world):
    """On one host: pairs of ranks standing in for nodes (see test_transports.pseudo_nodes)."""
    staged = pseudo_nodes(world)
    return Route(hvd.global_process_set, world, False, node_aware=True, node_set=staged.node_set,
                 scatter_by_alltoall=not hvd.mpi_enabled(),
                 rail_set=staged.rail.process_set, ranks_per_node=2, nodes=world // 2)


def drive(transport, buffer, name):
    transfer = transport.start([buffer], [name], f"test {name}")
    while not transfer.advance():
        time.sleep(1e-4)
    return transfer.result[0]


@pytest.mark.parametrize("node_aware", [False, True])
def test_int8_within_bound_and_bit_identical(world, rank, node_aware):
    values = wide_values(rank, seed=3)
    everyone = every_rank(values, f"test.int8.all.{node_aware}").double()
    exact = everyone.mean(0)
    out = [torch.nn.Parameter(values.clone())]
    out[0].grad = torch.zeros_like(out[0])
    if node_aware and NODES == 1:
        if not stages_on_this_run(world):
            pytest.skip("node-aware stages need at least 2 pseudo-nodes of 2 ranks: 4 ranks")
        result = drive(Int8().build(pseudo_route(world), None), values.clone(), "test.int8.pseudo")
    else:
        average_tensors(out, compression="int8", node_aware=node_aware, name=f"test.int8.{node_aware}")
        result = out[0].detach()
        if node_aware and world // NODES > 1:
            assert routes().node_aware_sets(hvd.global_process_set) is not None
    error = (result.double() - exact).abs()
    bound = int8_error_bound(window_absmax(everyone, BLOCK).double(), world)
    assert bool((error <= bound).all()), float((error / bound).max())
    relative = error / exact.abs().clamp_min(1e-30)
    assert float(error.max()) > 0 and float(relative.median()) > 1e-5  # int8 does lose bits
    # every rank holds exactly the same bits
    results = every_rank(result, f"test.int8.result.{node_aware}")
    assert bool((results == results[0]).all())


def test_int8_bytes_counted_and_sent(world, rank):
    params = [torch.nn.Parameter(torch.randn(4 * 2 ** 20))]  # 16 MiB of float32
    params[0].grad = torch.zeros_like(params[0])
    float32_bytes = params[0].numel() * 4
    hva.average_parameters(params, compression="int8")  # agreement and registration
    hvd.barrier()
    link_before = LinkCount.now() if NODES > 1 else None
    hva.reset_traffic()
    hva.average_parameters(params, compression="int8")
    counters = hva.traffic()
    hvd.barrier()
    link = LinkCount.now().since(link_before) if NODES > 1 else None
    assert counters.bytes <= 0.2520 * float32_bytes + 4 * world, counters.bytes
    assert counters.bytes >= 0.25 * float32_bytes
    if NODES > 1:
        sent = link.sent
        per_node = world // NODES
        route = averaging_route(hvd.global_process_set, float32_bytes, str(Int8().spec()))
        # HVA_ROUTE=measure timed both ways in int8 at the first round and kept the faster
        assert route in ("node-aware", "flat") and hvd.allgather_object(route) == [route] * world
        # one model in int8: a byte per value and a float32 scale per block of 1024 values
        int8_model = params[0].numel() + 4 * -(-params[0].numel() // BLOCK)
        if route == "node-aware":  # the rail alone crosses: one model per node, in int8
            payload = int8_model
        else:  # every rank's chunks cross in int8: 2 (n-1)/n of a model per rank
            payload = 2 * per_node * (world - 1) / world * int8_model
        # well under a float16 model (half the float32 bytes) even with the link's overhead
        assert sent <= payload + link.slack(), (link, payload, route)
        assert counters.cross_node_bytes * per_node >= 0.9 * link.sent_once(), (counters, link)


@pytest.mark.parametrize("kwargs", [{"compression": "int4"}, {"compression": "INT8"},
                                    {"compression": object()}])
def test_bad_int8_spelling_raises_on_every_rank(kwargs):
    error = expect_error_on_every_rank(lambda: hva.PeriodicModelAverager(period=2, **kwargs),
                                       ValueError)
    assert repr(kwargs["compression"]) in str(error)
    assert ", ".join(COMPRESSION_CHOICES) in str(error)


@pytest.mark.parametrize("block_size", [0, -4, 1.5, True, "1024"])
def test_bad_block_size_raises_on_every_rank(block_size):
    error = expect_error_on_every_rank(lambda: hva.Int8(block_size=block_size), ValueError)
    assert f"block_size must be a positive int (values per int8 scale), got {block_size!r}" in str(error)


def test_int8_on_integer_tensors_raises_naming_the_dtype(world, rank):
    counts = torch.arange(4)
    error = expect_error_on_every_rank(
        lambda: average_tensors([counts], compression="int8", name="test.int8.ints"), TypeError)
    assert "tensor #0 has dtype torch.int64" in str(error)  # the same error as without int8


@pytest.mark.parametrize("feedback", [False, True])
def test_pipelined_pieces_give_the_same_bits_as_one(world, rank, feedback):
    """Pieces start on block boundaries, so each block's scale and sum are the ones a single
    piece gives: the averages (and error feedback's residuals) match bit for bit."""
    numel = 4 * NUMEL
    assert len(piece_bounds(-(-numel // world), BLOCK, 4)) == 4  # it did cut into 4 pieces
    results, kept = {}, {}
    for pieces in (1, 4):
        residuals = Residuals() if feedback else None
        exchange = Int8Exchange(hvd.global_process_set, world, False, BLOCK, residuals,
                                pieces=pieces)
        results[pieces] = [drive(exchange, wide_values(rank, numel, seed=r), f"test.pieces{pieces}")
                           for r in range(3)]
        kept[pieces] = residuals.state_dict()["residuals"] if feedback else {}
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[4]))
    assert kept[1].keys() == kept[4].keys() and all(torch.equal(kept[1][k], kept[4][k]) for k in kept[1])
    exact = every_rank(wide_values(rank, numel, seed=2), "test.pieces.exact").double().mean(0)
    assert float((results[4][2].double() - exact).abs().max()) > 0  # int8 did round


def _rounds(averager, values, rounds, rank):
    """Average the same per-rank values ``rounds`` times (each round starts from them again)."""
    p = torch.nn.Parameter(values.clone())
    p.grad = torch.zeros_like(p)
    results = []
    for _ in range(rounds):
        with torch.no_grad():
            p.copy_(values)
        averager.average_parameters([p])
        results.append(p.detach().double().clone())
    return results


def test_error_feedback_cancels_errors_over_rounds(world, rank):
    values = torch.randn(20_000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    exact = every_rank(values, "test.ef.exact").double().mean(0)
    plain = _rounds(hva.PeriodicModelAverager(1, compression="int8"), values, 16, rank)
    fed = _rounds(hva.PeriodicModelAverager(1, compression="int8", error_feedback=True),
                  values, 16, rank)
    one_round = float((plain[0] - exact).abs().mean())
    assert float((torch.stack(plain).mean(0) - exact).abs().mean()) == pytest.approx(one_round, rel=1e-6)
    # with error feedback the errors of successive rounds cancel: their mean is far closer
    assert float((torch.stack(fed).mean(0) - exact).abs().mean()) < 0.25 * one_round


def test_error_feedback_state_resumes_bit_identically(world, rank):
    values = torch.randn(20_000, generator=torch.Generator().manual_seed(10 + rank))
    first = hva.PeriodicModelAverager(1, compression="int8", error_feedback=True)
    _rounds(first, values, 3, rank)
    state = first.state_dict()
    assert set(state["wire"][1]["residuals"]) == {"0.sent", "0.owned"}
    going_on = _rounds(first, values, 2, rank)
    resumed = hva.PeriodicModelAverager(1, compression="int8", error_feedback=True)
    resumed.load_state_dict(state)
    again = _rounds(resumed, values, 2, rank)
    assert all(torch.equal(a, b) for a, b in zip(going_on, again))
    fresh = _rounds(hva.PeriodicModelAverager(1, compression="int8", error_feedback=True),
                    values, 2, rank)
    assert not torch.equal(fresh[1], going_on[1])  # the residuals did matter


def test_hierarchical_int8_only_on_the_top_level(world, rank):
    hierarchy = {2: 2, 4: world} if world >= 4 else {4: world}
    averager = hva.HierarchicalModelAverager(hierarchy, compression={4: "int8"})
    params = [param(rank + 0.5, shape=(1000,))]
    hva.reset_traffic()
    averager.average_parameters(params)  # step 0: top level in int8
    packet = -(-1000 // world)
    assert hva.traffic().bytes == world * (packet + 4)
    expected = sum(range(world)) / world + 0.5
    values = hvd.allgather_object(float(params[0][0].detach()))
    assert max(abs(v - expected) for v in values) <= 2 * (world - 0.5) / 254 + 1e-6
    if world >= 4:
        for _ in range(2):
            averager.average_parameters(params)  # step 1 nothing, step 2 pairs in float32
        assert hva.traffic().bytes == world * (packet + 4) + 1000 * 4


def test_error_feedback_without_int8_warns():
    with pytest.warns(UserWarning, match="error_feedback=True does nothing without an int8 level"):
        hva.PeriodicModelAverager(4, compression="fp16", error_feedback=True)
