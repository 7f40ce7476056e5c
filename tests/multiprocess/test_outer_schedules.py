"""DiLoCo's outer schedules (``outer_scheduler=``) on real ranks: the momentum warm-up and a
PyTorch LR scheduler on the outer lr, blocking and overlapped, against a reference that
simulates every rank and PyTorch's SGD by hand; resuming mid-warm-up; refusals on every rank."""
import copy

import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank
from test_diloco import (LR, SHAPE, assert_same_as_uninterrupted, check_against, make, resume,
                         target, train_step)

OUTER_LR, MOMENTUM, WARMUP = 0.7, 0.9, 3


def nesterov(params):
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)


def warmup(outer):
    return hva.OuterMomentumWarmup(outer, WARMUP)


def reference(world, steps, period, delay, lr_at, momentum_at):
    """Every rank's parameters after every step: inner SGD; at s % period == 0 the snapshot, and
    at s + delay (delay 0: at once) the outer step ``k`` with ``lr_at(k)`` and Nesterov momentum
    ``momentum_at(k)`` (PyTorch's SGD: no buffer is kept while the momentum is 0), after which
    every rank becomes ``global + (w - snapshot)``."""
    torch.manual_seed(0)
    start = torch.randn(SHAPE).double()
    local = [start.clone() for _ in range(world)]
    global_copy, buf, outer_steps, in_flight = start.clone(), None, 0, None
    history = []

    def outer_step(snapshots):
        nonlocal global_copy, buf, outer_steps
        pseudo = global_copy - sum(snapshots) / world
        momentum = momentum_at(outer_steps)
        update = pseudo
        if momentum != 0:
            buf = pseudo.clone() if buf is None else momentum * buf + pseudo
            update = pseudo + momentum * buf
        global_copy = global_copy - lr_at(outer_steps) * update
        outer_steps += 1

    for s in range(steps):
        local = [w - LR * (w - target(r, s).double()) for r, w in enumerate(local)]
        if in_flight is not None and in_flight[0] == s:
            outer_step(in_flight[1])
            local = [global_copy + (w - snap) for w, snap in zip(local, in_flight[1])]
            in_flight = None
        if s % period == 0:
            if delay:
                in_flight = (s + delay, [w.clone() for w in local])
            else:
                outer_step(local)
                local = [global_copy.clone() for _ in range(world)]
        history.append([w.clone() for w in local])
    return history


def warmed(k):
    return MOMENTUM * min(1.0, k / WARMUP)


@pytest.mark.parametrize("delay", [0, 2], ids=["blocking", "overlapped"])
def test_momentum_warmup_matches_reference(world, rank, delay):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3, delay=delay),
                      outer=nesterov, outer_scheduler=warmup)
    steps = 20  # 7 outer steps: the warm-up's 3 and 4 at the full momentum
    history = reference(world, steps, 3, delay, lambda k: OUTER_LR, warmed)
    check_against(history, param, opt, world, rank, steps)
    assert opt.outer_optimizer.param_groups[0]["momentum"] == MOMENTUM


def test_warmup_changes_the_trajectory(world, rank):
    """The reference above is not blind to the schedule: without it the run differs."""
    with_warmup = reference(world, 12, 3, 0, lambda k: OUTER_LR, warmed)
    without = reference(world, 12, 3, 0, lambda k: OUTER_LR, lambda k: MOMENTUM)
    assert not torch.allclose(with_warmup[-1][rank], without[-1][rank], rtol=0, atol=1e-3)


def test_torch_lr_scheduler_on_the_outer_lr_matches_reference(world, rank):
    def halving(outer):
        return torch.optim.lr_scheduler.LambdaLR(outer, lambda k: 0.5 ** k)

    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3, delay=1),
                      outer=nesterov, outer_scheduler=halving)
    history = reference(world, 14, 3, 1, lambda k: OUTER_LR * 0.5 ** k, lambda k: MOMENTUM)
    check_against(history, param, opt, world, rank, 14)


@pytest.mark.parametrize("saved_after", [4, 8])  # mid-warm-up, both with a round in flight
def test_resume_mid_warmup_is_bit_identical(world, rank, saved_after):
    steps = 16

    def build():
        return make(world, lambda: hva.PeriodicModelAverager(period=3, delay=2),
                    outer=nesterov, outer_scheduler=warmup)

    param, opt = build()
    for s in range(steps):
        train_step(param, opt, rank, s)
    uninterrupted = param.detach().clone()
    param, opt = build()
    for s in range(saved_after):
        train_step(param, opt, rank, s)
    saved = {"param": param.detach().clone(), "opt": copy.deepcopy(opt.state_dict())}
    assert saved["opt"]["outer_scheduler"]["outer_steps_taken"] == (saved_after - 1) // 3
    param = resume(build, saved, rank, saved_after, steps)
    assert_same_as_uninterrupted(param, uninterrupted, world, f"test.schedule.resume.{saved_after}")


@pytest.mark.parametrize("saved_with, loaded_with", [(None, warmup), (warmup, None)],
                         ids=["schedule-missing", "schedule-unexpected"])
def test_checkpoint_and_schedule_that_do_not_match_raise_on_every_rank(world, rank, saved_with,
                                                                       loaded_with):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3), outer=nesterov,
                      outer_scheduler=saved_with)
    for s in range(4):
        train_step(param, opt, rank, s)
    saved = opt.state_dict()
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3), outer=nesterov,
                      outer_scheduler=loaded_with)
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), ValueError)
    assert "outer schedule" in str(error) and "'outer_scheduler'" in str(error)
    assert opt.averager.step == 0, "nothing was applied"


def test_ranks_at_different_points_of_the_warmup_raise_on_every_rank(world, rank):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3), outer=nesterov,
                      outer_scheduler=warmup)
    for s in range(4):
        train_step(param, opt, rank, s)
    saved = opt.state_dict()
    if rank == world - 1:
        saved["outer_scheduler"]["outer_steps_taken"] += 1
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), RuntimeError)
    assert "outer schedule" in str(error) and "differs across ranks" in str(error)
    assert opt.outer_scheduler.outer_steps_taken == 2


def test_bad_schedules_raise_on_every_rank_before_any_collective(world, rank):
    def averager():
        return hva.PeriodicModelAverager(period=3)

    error = expect_error_on_every_rank(
        lambda: make(world, averager, outer=nesterov, outer_scheduler=lambda o: object()),
        TypeError)
    assert "must return a schedule with step(), state_dict() and load_state_dict()" in str(error)
    error = expect_error_on_every_rank(
        lambda: make(world, averager, outer=nesterov, outer_scheduler=3), TypeError)
    assert "outer_scheduler must be a callable" in str(error)
    # one rank's bad warm-up: it raises its ValueError, the others a RuntimeError naming it
    start = 0.95 if rank == 0 else 0.0
    error = expect_error_on_every_rank(
        lambda: make(world, averager, outer=nesterov,
                     outer_scheduler=lambda o: hva.OuterMomentumWarmup(o, 3, start=start)),
        (ValueError, RuntimeError))
    assert "start=0.95" in str(error)
    assert isinstance(error, ValueError if rank == 0 else RuntimeError)
