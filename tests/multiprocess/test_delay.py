"""Averaging overlapped with training (``delay``): a round started at a firing step s is applied
at s + delay as average(snapshot at s) + (parameters - snapshot). Parity with a hand-computed
reference over every rank's trajectory, checkpoints taken while a round is in flight, timeouts."""
import time

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from hvd_averaging.schedule import delayed_level_pieces
from helpers import OutOfBand, expect_error_on_every_rank

SHAPE = (40_000,)  # float64: 320 kB, a few stages' worth


def start_value(rank, numel=SHAPE[0]):
    return torch.linspace(0, 1, numel, dtype=torch.float64) * (rank + 1)


def local_update(rank, step, values):
    """The 'optimizer step' of rank at step: different on every rank, nonlinear in the values."""
    return values + 0.01 * (rank + 1) * (step + 1) - 0.05 * torch.sin(values)


def make_param(values):
    p = torch.nn.Parameter(values.clone())
    p.grad = torch.zeros_like(p)
    return p


def reference(world, steps, firing, delay, numel=SHAPE[0]):
    """Every rank's parameters after every step, computed on one process: local update, then
    apply a round due at this step, then start a round."""
    params = [start_value(r, numel) for r in range(world)]
    in_flight, history = None, []
    for step in range(steps):
        params = [local_update(r, step, params[r]) for r in range(world)]
        if in_flight is not None and in_flight[0] == step:
            _, averages, snapshots = in_flight
            params = [averages[r] + (params[r] - snapshots[r]) for r in range(world)]
            in_flight = None
        if firing(step):
            snapshots = [p.clone() for p in params]
            average = torch.stack(snapshots).mean(0)
            averages = [average] * world
            in_flight = (step + delay, averages, snapshots)
        history.append([p.clone() for p in params])
    return history


def run(averager, rank, steps, param=None, start=0, history=None, numel=SHAPE[0]):
    param = param if param is not None else make_param(start_value(rank, numel))
    for step in range(start, steps):
        with torch.no_grad():
            param.copy_(local_update(rank, step, param.detach()))
        averager.average_parameters([param])
        if history is not None:
            history.append(param.detach().clone())
    return param


def check_every_rank(history, expected, world):
    """This rank's trajectory and every other rank's final values match the reference."""
    rank = hvd.rank()
    for step, mine in enumerate(history):
        assert torch.allclose(mine, expected[step][rank], rtol=1e-12, atol=1e-12), f"step {step}"
    finals = hvd.allgather(history[-1].reshape(1, -1), name="test.delay.finals")
    for r in range(world):
        assert torch.allclose(finals[r], expected[-1][r], rtol=1e-12, atol=1e-12), f"rank {r}"


@pytest.mark.parametrize("delay", [1, 3])
def test_periodic_delay_matches_reference(world, rank, delay):
    averager = hva.PeriodicModelAverager(period=4, warmup_steps=2, delay=delay)
    history = []
    run(averager, rank, 17, history=history)
    expected = reference(world, 17, lambda s: s >= 2 and (s - 2) % 4 == 0, delay)
    check_every_rank(history, expected, world)
    if delay > 1:
        # between firing (step 2) and applying, a rank holds its own progress only: step 3 is
        # its local update of its own step-2 values, not of the step-2 average
        own = local_update(rank, 3, history[2])
        assert torch.equal(history[3], own)
        average_then_update = local_update(rank, 3, torch.stack(expected[2]).mean(0))
        assert not torch.allclose(history[3], average_then_update)


def test_delay_zero_is_the_synchronous_averager(world, rank):
    a, b = hva.PeriodicModelAverager(period=3), hva.PeriodicModelAverager(period=3, delay=0)
    pa, pb = run(a, rank, 10), run(b, rank, 10)
    assert torch.equal(pa.detach(), pb.detach())


def reference_levels(world, steps, levels, numel):
    """Every rank's parameters after every step with several levels, each delayed or not:
    ``levels`` is ``{period: (group of a rank, delay)}``; at each step the largest period that
    divides it fires; every round due at a step is applied after its local update."""
    params = [start_value(r, numel) for r in range(world)]
    in_flight, history = [], []
    for step in range(steps):
        params = [local_update(r, step, params[r]) for r in range(world)]
        for _, averages, snapshots in [f for f in in_flight if f[0] == step]:
            params = [params[r] + (averages[r] - snapshots[r]) for r in range(world)]
        in_flight = [f for f in in_flight if f[0] != step]
        fired = [period for period in levels if step % period == 0]
        if fired:
            group, delay = levels[max(fired)]
            means = [torch.stack([params[m] for m in group(r)]).mean(0) for r in range(world)]
            if delay:
                in_flight.append((step + delay, means, [p.clone() for p in params]))
            else:
                params = means
        history.append([p.clone() for p in params])
    return history


def pair_of(r):
    return [r - r % 2, r - r % 2 + 1]


# 320 kB travels whole; 1.6 MB in pieces (within the window's 3 stages) when pairs sit beneath
@pytest.mark.parametrize("numel", [SHAPE[0], 200_000])
def test_hierarchical_top_level_delay_with_lower_level_in_the_window(world, rank, numel):
    # top level every 8 steps, delayed by 3; pairs (inside a node) every 2 steps, synchronous
    pairs = world >= 4
    hierarchy = {2: 2, 8: world} if pairs else {8: world}
    averager = hva.HierarchicalModelAverager(hierarchy, delay=3)
    assert averager.level_delays == {**({2: 0} if pairs else {}), 8: 3}
    assert delayed_level_pieces(averager.level_delays) == ({8: 3} if pairs else {})
    history = []
    run(averager, rank, 20, history=history, numel=numel)
    levels = {**({2: (pair_of, 0)} if pairs else {}), 8: (lambda r: range(world), 3)}
    check_every_rank(history, reference_levels(world, 20, levels, numel), world)


def test_hierarchical_every_level_delayed(world, rank):
    # pairs every 2 steps applied 1 step later, everyone every 8 applied 3 steps later (in
    # pieces): at steps 3, 11 and 19 a pair round and a global round are due together
    if world < 4:
        pytest.skip("pairs beneath a larger top level need 4 ranks: runs in the np=4 and cluster stages")
    numel = 200_000
    averager = hva.HierarchicalModelAverager({2: 2, 8: world}, delay={2: 1, 8: 3})
    assert averager.level_delays == {2: 1, 8: 3}
    history = []
    run(averager, rank, 20, history=history, numel=numel)
    expected = reference_levels(world, 20, {2: (pair_of, 1), 8: (lambda r: range(world), 3)}, numel)
    check_every_rank(history, expected, world)


@pytest.mark.parametrize("saved_after", [1, 2])  # steps after the firing step: mid-window, due now
def test_checkpoint_while_in_flight_resumes_bit_identically(world, rank, saved_after):
    period, delay, fired, steps = 4, 2, 4, 11
    averager = hva.PeriodicModelAverager(period=period, delay=delay)
    param = run(averager, rank, fired + saved_after)
    state = averager.state_dict()
    saved = param.detach().clone()
    assert sorted(state["in_flight"]) == [period] and state["in_flight"][period]["fired_at"] == fired
    uninterrupted = run(averager, rank, steps, param=param, start=fired + saved_after)
    # a restarted job: new tensors, a new averager, the checkpoint loaded into both
    resumed_averager = hva.PeriodicModelAverager(period=period, delay=delay)
    resumed_averager.load_state_dict(state)
    resumed = run(resumed_averager, rank, steps, param=make_param(saved), start=fired + saved_after)
    assert torch.equal(resumed.detach(), uninterrupted.detach())
    finals = hvd.allgather(resumed.detach().reshape(1, -1), name="test.delay.resume")
    expected = reference(world, steps, lambda s: s % period == 0, delay)[-1]
    for r in range(world):
        assert torch.allclose(finals[r], expected[r], rtol=1e-12, atol=1e-12)


def test_checkpoint_with_in_flight_round_that_does_not_fit_raises():
    averager = hva.PeriodicModelAverager(period=4, delay=2)
    state = {"step": 9, "in_flight": {4: {"fired_at": 4, "layout": 0, "snapshots": []}}}
    with pytest.raises(ValueError, match=r"in_flight.*fired at 4.*does not fit this averager at step 9"):
        averager.load_state_dict(state)


@pytest.mark.parametrize("kwargs, match", [
    ({"period": 4, "delay": 4}, "delay 4 must be smaller than the period 4"),
    ({"period": 4, "delay": -1}, "delay must be >= 0"),
    ({"period": 4, "delay": 1.5}, "delay must be an integer"),
])
def test_bad_delay_raises_on_every_rank(kwargs, match):
    # every rank passes the same bad value, so every rank raises the ValueError itself
    error = expect_error_on_every_rank(lambda: hva.PeriodicModelAverager(**kwargs), ValueError)
    assert match in str(error)


def test_hierarchical_bad_delay_names_the_level(world):
    with pytest.raises(ValueError, match=r"level with period 8: delay 8 must be smaller"):
        hva.HierarchicalModelAverager({8: world}, delay=8)
    with pytest.raises(ValueError, match=r"delay names period\(s\) \[3\]"):
        hva.HierarchicalModelAverager({8: world}, delay={3: 1})


def test_only_a_delayed_level_takes_a_transform(world):
    averager = hva.PeriodicModelAverager(period=4, delay=0)
    with pytest.raises(ValueError, match="level 4 is not delayed"):
        averager.transform_delayed_average(4, lambda tensors, averages: None)


def test_late_rank_times_out_at_the_apply_step(world, rank):
    """A rank that starts its round late: the others' apply step raises within the timeout,
    counted from the round's start, naming the firing step and the delay. The late rank starts
    only once every other rank said it raised (a file, not a race against a sleep)."""
    late = world - 1
    signals = OutOfBand("delay-stall")
    averager = hva.PeriodicModelAverager(period=2, delay=1)
    param = make_param(start_value(rank))
    averager.average_parameters([param])  # step 0 starts a round (and agrees on the layout)
    averager.average_parameters([param])  # step 1 applies it
    hva.set_timeout(3, exit_after=None)  # this test recovers from the stall
    try:
        if rank == late:
            signals.wait_for("raised", [r for r in range(world) if r != late])
            averager.average_parameters([param])  # starts its round; the others gave up
            averager.average_parameters([param])  # applies it: complete, since all started
            raised = None
        else:
            start = time.monotonic()
            averager.average_parameters([param])  # step 2: starts, returns without waiting
            assert time.monotonic() - start < 3
            with pytest.raises(hva.AveragingTimeoutError) as info:
                averager.average_parameters([param])  # step 3: apply
            waited = time.monotonic() - start
            signals.tell("raised")
            raised = str(info.value)
            assert 3 <= waited < 8, waited
            assert "PeriodicModelAverager step 2 (delay 1)" in raised
            assert "not finished after 3 s" in raised
    finally:
        hva.set_timeout(None)
    signals.close()
    assert hvd.allgather_object(raised is None, name="test.delay.stall") == [r == late for r in range(world)]
