"""Failure modes that must be loud and bounded, and the flat storage parameters move into."""
import time

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import OutOfBand, expect_error_on_every_rank, gathered, param


def test_stalled_rank_times_out_naming_step_and_set(world, rank):
    """A rank that does not reach an averaging step: the others raise within the timeout. The
    late rank arrives only once every other rank said it raised (a file, not a sleep)."""
    late = world - 1
    signals = OutOfBand("stall")
    params = [param(rank)]
    averager = hva.PeriodicModelAverager(period=2)
    averager.average_parameters(params)  # step 0 fires on everyone
    averager.average_parameters(params)  # step 1 does not fire
    hva.set_timeout(3, exit_after=None)  # this test recovers from the stall
    try:
        if rank == late:
            signals.wait_for("raised", [r for r in range(world) if r != late])
            averager.average_parameters(params)  # arrives after the others gave up
            raised = None
        else:
            start = time.monotonic()
            with pytest.raises(hva.AveragingTimeoutError) as info:
                averager.average_parameters(params)
            waited = time.monotonic() - start
            signals.tell("raised")
            raised = str(info.value)
            assert 3 <= waited < 8, waited
            assert "PeriodicModelAverager step 2" in raised
            assert f"process set {list(range(world))}" in raised
            assert "not finished after 3 s" in raised
    finally:
        hva.set_timeout(None)
    signals.close()
    statuses = hvd.allgather_object(raised is None, name="test.stall.status")
    assert statuses == [r == late for r in range(world)]


def test_timeout_setting_is_validated():
    for bad in (0, -1, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            hva.set_timeout(bad)
    assert hva.timeout() == 45.0


def test_non_finite_check_names_tensor_and_rank_before_any_data_moves(world, rank):
    bad_rank = world - 1
    params = [param(rank + 1.0), param(rank + 2.0, shape=(2, 2))]
    if rank == bad_rank:
        with torch.no_grad():
            params[1][0, 1] = float("nan")
    averager = hva.PeriodicModelAverager(period=2, check_finite=True)
    before = [p.detach().clone() for p in params]
    error = expect_error_on_every_rank(lambda: averager.average_parameters(params),
                                       (hva.NonFiniteError, RuntimeError))
    if rank == bad_rank:
        assert isinstance(error, hva.NonFiniteError)
        assert f"tensor #1 (shape (2, 2), dtype torch.float32) has 1 NaN/Inf value(s) on rank {bad_rank}" in str(error)
        assert "PeriodicModelAverager step 0" in str(error)
    else:
        assert f"rank(s) [{bad_rank}] raised an error" in str(error)
    # nothing was averaged: every rank still holds its own values (NaN only where it was)
    for p, b in zip(params, before):
        assert torch.equal(torch.nan_to_num(p.detach()), torch.nan_to_num(b))
    # with finite values the same averager averages
    with torch.no_grad():
        params[1].fill_(rank + 2.0)
    averager.average_parameters(params)
    mean = sum(range(world)) / world
    assert gathered(params[1][0, 1]) == [mean + 2.0] * world


def test_flat_storage_keeps_optimizers_and_state_dict_working(world, rank):
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    model[0].weight.data = model[0].weight.data.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inputs = torch.randn(5, 3, 4, 4)

    def train_step():
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()

    train_step()
    identities = [id(p) for p in model.parameters()]
    hva.average_parameters(model.parameters())
    assert [id(p) for p in model.parameters()] == identities
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    first = [gathered(p.flatten()[0]) for p in model.parameters()]
    assert all(len(set(values)) == 1 for values in first)  # averaged: equal on every rank

    # Training after the move updates the storage that is averaged next time.
    train_step()
    own = [p.detach().clone() for p in model.parameters()]
    hva.average_parameters(model.parameters())
    for p, mine in zip(model.parameters(), own):
        everyone = hvd.allgather(mine.reshape(1, -1), name=f"test.flat.own.{p.numel()}")
        assert torch.allclose(p.detach().reshape(-1), everyone.mean(0), atol=1e-6)

    # load_state_dict copies into the storage in place; assign=True replaces it: both averaged.
    state = {k: torch.full_like(v, float(rank)) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    hva.average_parameters(model.parameters())
    assert gathered(model[2].bias[0]) == [sum(range(world)) / world] * world
    model.load_state_dict({k: v.clone() + 1 for k, v in state.items()}, assign=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hva.average_parameters(model.parameters())
    assert gathered(model[2].bias[0]) == [sum(range(world)) / world + 1] * world


def test_timed_out_round_leaves_parameters_whole(world, rank, tmp_path):
    """The ranks that time out save a checkpoint in their except block; then the late rank
    arrives and the round's queued allreduce completes. What they saved, and their parameters
    afterwards, hold each tensor's value from before the round, element for element (at the
    commit before this test the late round's average overwrote the ranks' parameter #0); the
    late rank holds the round's average."""
    late = world - 1
    on_time = [r for r in range(world) if r != late]
    signals = OutOfBand("torn")
    # under 1 MiB in all: the flat route, one allreduce in place in the flat storage, also on
    # the emulated cluster (node-aware rounds move through stages the late rank cannot finish
    # alone, and write into the parameters only from the caller's thread)
    params = [param(rank + 1.0, shape=(512, 500)), param(10.0 * rank, shape=(7,))]
    averager = hva.PeriodicModelAverager(period=2)
    averager.average_parameters(params)  # step 0: the layout is agreed, the slab bound
    averager.average_parameters(params)
    with torch.no_grad():
        for p in params:
            p.add_(float(rank))  # each rank's own values before the round at step 2
    before = [p.detach().clone() for p in params]
    hva.set_timeout(3, exit_after=None)  # this test recovers from the stall
    try:
        if rank == late:
            signals.wait_for("saved", on_time)
            averager.average_parameters(params)  # completes: the others' collectives were queued
            signals.tell("done")
        else:
            with pytest.raises(hva.AveragingTimeoutError):
                averager.average_parameters(params)
            torch.save([p.detach() for p in params], tmp_path / "except.pt")
            signals.tell("saved")
            signals.wait_for("done", [late])
            time.sleep(0.5)  # a late write, if one reached the parameters, has landed by now
    finally:
        hva.set_timeout(None)
    signals.close()
    if rank == late:
        for p, b in zip(params, before):  # every rank added its rank to equal values
            assert torch.equal(p.detach(), b + ((world - 1) / 2 - rank)), "the late rank averaged"
    else:
        saved = torch.load(tmp_path / "except.pt", weights_only=True)
        for index, (p, s, b) in enumerate(zip(params, saved, before)):
            assert torch.equal(s, b), f"checkpoint tensor #{index} changed in {int((s != b).sum())} elements"
            assert torch.equal(p.detach(), b), f"parameter #{index} overwritten after the timeout"
    # the averager goes on: the parameters are packed anew at the next round
    averager.average_parameters(params)
    averager.average_parameters(params)
    everyone = hvd.allgather(params[1].detach().reshape(1, -1), name="test.torn.after")
    assert all(torch.equal(everyone[0], row) for row in everyone)


def test_ranks_passing_different_compression_are_told(world, rank):
    params = [param(rank, shape=(64,))]
    compression = "fp16" if rank == world - 1 else None
    error = expect_error_on_every_rank(
        lambda: hva.average_parameters(params, compression=compression), RuntimeError)
    assert "differs across ranks" in str(error) and "wire format" in str(error)
    assert torch.equal(params[0].detach(), torch.full((64,), float(rank)))
