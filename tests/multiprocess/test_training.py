"""Training integration on real ranks: parity with a hand-computed reference, resume, the
gradient switch of post-local SGD, GradScaler skips and buffers."""
import copy
import time

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import expect_error_on_every_rank, gathered


def rank_data(r, steps, n=8):
    g = torch.Generator().manual_seed(100 + r)
    return [(torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)) for _ in range(steps)]


def make_model():
    torch.manual_seed(3)
    return torch.nn.Linear(5, 1)


def local_step(model, opt, batch):
    x, y = batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()


def reference_run(world, steps, groups_at):
    """Every rank's model, computed in this process alone: local SGD steps, then at the steps
    where ``groups_at(step)`` gives groups, each group's models replaced by their mean."""
    models = [make_model() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = [rank_data(r, steps) for r in range(world)]
    history = []
    for step in range(steps):
        for r in range(world):
            local_step(models[r], opts[r], data[r][step])
            opts[r].step()
        for group in groups_at(step) or []:
            with torch.no_grad():
                for tensors in zip(*(list(models[r].parameters()) for r in group)):
                    mean = torch.stack(tensors).mean(dim=0)
                    for t in tensors:
                        t.copy_(mean)
        history.append([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models])
    return history


def run_wrapped(averager, steps, start=0, model=None, opt=None):
    model = model or make_model()
    opt = opt or hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)
    data = rank_data(hvd.rank(), steps)
    history = []
    for step in range(start, steps):
        local_step(model, opt, data[step])
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return model, opt, history


def test_periodic_parity_with_hand_computed_reference(world, rank):
    steps = 14
    expected = reference_run(
        world, steps, lambda s: [list(range(world))] if s >= 2 and (s - 2) % 3 == 0 else None)
    _, opt, history = run_wrapped(hva.PeriodicModelAverager(period=3, warmup_steps=2), steps)
    for step, mine in enumerate(history):
        assert torch.allclose(mine, expected[step][rank], atol=1e-6, rtol=0), step
    # PyTorch's PostLocalSGDOptimizer form: the step at the top level, stored once
    assert opt.averager.step == steps == opt.state_dict()["step"]
    assert "step" not in opt.state_dict()["averager"]


def test_hierarchical_parity_with_hand_computed_reference(world, rank):
    steps = 13
    pairs = [[r, r + 1] for r in range(0, world, 2)]

    def groups_at(s):
        if s < 1:
            return None
        if s % 4 == 0:
            return [list(range(world))]
        return pairs if s % 2 == 0 else None

    expected = reference_run(world, steps, groups_at)
    _, _, history = run_wrapped(hva.HierarchicalModelAverager({2: 2, 4: world}, warmup_steps=1), steps)
    for step, mine in enumerate(history):
        assert torch.allclose(mine, expected[step][rank], atol=1e-6, rtol=0), step


def test_step_counts_of_wrapper_and_bare_averager_agree(world):
    bare = hva.PeriodicModelAverager(period=2)
    _, opt, _ = run_wrapped(hva.PeriodicModelAverager(period=2), 7)
    model = make_model()
    for _ in range(7):
        bare.average_parameters(model.parameters())
    assert opt.averager.step == bare.step == 7
    assert hvd.allgather_object(opt.averager.step) == [7] * world


@pytest.mark.parametrize("kind", ["periodic", "hierarchical"])
@pytest.mark.parametrize("k", [5, 6])  # periodic fires at 2, 5, 8 (k=5 on, 6 off a firing step)
def test_checkpoint_resume_is_bit_identical(world, kind, k):
    def averager():
        if kind == "periodic":
            return hva.PeriodicModelAverager(period=3, warmup_steps=2)
        return hva.HierarchicalModelAverager({2: min(2, world), 3: world}, warmup_steps=1)

    steps = 12
    _, _, full = run_wrapped(averager(), steps)
    model, opt, _ = run_wrapped(averager(), k)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert saved_opt["step"] == k
    resumed_model = make_model()
    resumed_model.load_state_dict(saved_model)
    resumed_opt = hva.PostLocalSGDOptimizer(
        torch.optim.SGD(resumed_model.parameters(), lr=0.1), averager())
    resumed_opt.load_state_dict(saved_opt)
    _, _, tail = run_wrapped(None, steps, start=k, model=resumed_model, opt=resumed_opt)
    assert all(torch.equal(a, b) for a, b in zip(full[k:], tail))


def test_missing_step_in_checkpoint_warns_and_resets():
    model, opt, _ = run_wrapped(hva.PeriodicModelAverager(period=2), 3)
    plain = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    with pytest.warns(UserWarning, match="no averager step"):
        opt.load_state_dict(plain)
    assert opt.averager.step == 0


@pytest.mark.parametrize("form", ["pytorch", "step in averager", "step and iteration at top"])
def test_every_checkpoint_form_loads(world, form):
    """PyTorch's form (the step at the top level, as written now), this project's form of
    2026-12-03/04 (the step only inside "averager") and the oldest one (the step at the top
    level and PostLocalSGD's "iteration", the averager's config beside) resume at that step."""
    model, opt, _ = run_wrapped(hva.PeriodicModelAverager(period=2), 5)
    saved = opt.state_dict()
    assert saved["step"] == 5 and "step" not in saved["averager"]
    if form == "step in averager":
        saved["averager"]["step"] = saved.pop("step")
    elif form == "step and iteration at top":
        saved["iteration"] = saved["step"]
        saved["averager"].pop("config")
    fresh = hva.PostLocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                             start_localSGD_iter=0,
                             averager=hva.PeriodicModelAverager(period=2))
    fresh.load_state_dict(saved)
    assert fresh.averager.step == fresh.iteration == 5
    assert hvd.allgather_object(fresh.iteration, name="test.legacy.step") == [5] * world


def test_gradient_switch_happens_exactly_at_start(world, rank):
    model = torch.nn.Linear(2, 1, bias=False)
    start = 3
    opt = hva.PostLocalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                           start_localSGD_iter=start, local_group_size=min(2, world))
    pair_mean = rank // 2 * 2 + 0.5 if world >= 2 else 0.0
    seen = []
    for it in range(6):
        model.weight.grad = torch.full_like(model.weight, float(rank))
        opt.step()
        seen.append(model.weight.grad[0, 0].item())
    world_mean = (world - 1) / 2
    assert seen == [world_mean] * start + [pair_mean] * (6 - start)
    assert opt.gradient_process_set(start - 1) is hvd.global_process_set
    assert opt.iteration == 6 and opt.averager.step == 6


def test_gradient_switch_off_means_purely_local(rank):
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hva.PostLocalSGD(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                           start_localSGD_iter=1, post_local_gradient_allreduce=False)
    seen = []
    for _ in range(3):
        model.weight.grad = torch.full_like(model.weight, float(rank))
        opt.step()
        seen.append(model.weight.grad[0, 0].item())
    assert seen[1:] == [rank, rank]
    assert seen[0] == (hvd.size() - 1) / 2


def test_grad_scaler_skip_does_not_lose_an_averaging_step(world, rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    hva.PeriodicModelAverager(period=2), grad_scaler=scaler)
    with torch.no_grad():
        model.weight.fill_(float(rank))
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if rank == 0 and step == 2:
            model.weight.grad[0, 0] = float("inf")  # rank 0 skips its inner step at a firing step
        opt.step()
        scaler.update()
    assert opt.averager.step == 3
    assert hvd.allgather_object(opt.averager.step) == [3] * world
    w = model.weight.detach().clone()
    # step 2 fired on every rank, including the one whose inner step was skipped
    everyone = hvd.allgather(w.reshape(1, -1), name="test.scaler_weights")
    assert all(torch.equal(everyone[0], row) for row in everyone)


@pytest.mark.parametrize("with_buffers", [True, False])
def test_buffers_averaged_at_the_same_moments_only_when_asked(world, rank, with_buffers):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    bn = model[1]
    opt = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                    hva.PeriodicModelAverager(period=2),
                                    buffers=model.buffers() if with_buffers else None)
    values = []
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(4, 2)).sum().backward()  # train mode: also updates running stats
        with torch.no_grad():
            bn.running_mean.fill_(float(rank + step))
        opt.step()
        values.append(bn.running_mean[0].item())
    if with_buffers:  # fires at step 0 only
        assert values == [(world - 1) / 2, rank + 1]
    else:
        assert values == [rank, rank + 1]
    assert bn.num_batches_tracked.item() == 2  # integer buffer never averaged
    assert gathered(bn.running_mean[0])[rank] == rank + 1


WRAPPERS = ["PostLocalSGDOptimizer", "PostLocalSGD", "DiLoCo"]


def wrap(kind, model, inner, period=2):
    averager = hva.PeriodicModelAverager(period=period)
    if kind == "PostLocalSGDOptimizer":
        return hva.PostLocalSGDOptimizer(inner, averager)
    if kind == "PostLocalSGD":
        return hva.PostLocalSGD(inner, model.named_parameters(), start_localSGD_iter=0,
                                averager=averager)
    return hva.DiLoCo(inner, averager)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_broadcast_optimizer_state_counts_no_step(world, rank, kind):
    """Horovod's recipe on a fresh wrapper: hvd.broadcast_optimizer_state creates the state with
    a step on zero gradients. That step is not training: the averager counts nothing and
    averages nothing (at the commit before this test it counted one step, so a 28-step run
    ended at averager step 29), and the inner state exists afterwards, as Horovod expects. Also
    with an LR scheduler attached, which wraps step()."""
    model = make_model()
    with torch.no_grad():
        model.weight.add_(float(rank))  # differ: an averaging would show
    opt = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = model.weight.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.averager.step == 0
    assert torch.equal(model.weight.detach(), before), "zero gradients and nothing averaged"
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    data = rank_data(rank, 3)
    for step in range(3):
        local_step(model, opt, data[step])
        opt.step()
        scheduler.step()
    assert opt.averager.step == 3 and opt.state_dict()["step"] == 3
    assert opt.optim.param_groups[0]["lr"] == 0.1 * 0.5 ** 3  # the scheduler drives the inner lr
    assert hvd.allgather_object(opt.averager.step, name=f"test.bos.{kind}") == [3] * world


@pytest.mark.parametrize("kind", WRAPPERS)
def test_bad_checkpoint_on_one_rank_raises_everywhere_and_changes_nothing(world, rank, kind):
    """A NaN in one rank's file: that rank raises ValueError naming it, the others a
    RuntimeError naming that rank and the cause, within seconds (not at the 45 s timeout), and
    every rank's inner optimizer and averager are as they were."""
    model = make_model()
    opt = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = rank_data(rank, 3)
    for step in range(3):
        local_step(model, opt, data[step])
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.optim.state_dict())
    bad = world - 1
    if rank == bad:
        saved["state"][0]["momentum_buffer"][0, 1] = float("nan")
        saved["step"] = 9  # loaded as a whole or not at all
    start = time.monotonic()
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), (ValueError, RuntimeError))
    assert time.monotonic() - start < 10
    if rank == bad:
        assert isinstance(error, ValueError) and "NaN/Inf" in str(error)
    else:
        assert f"rank(s) [{bad}] raised an error" in str(error) and "NaN/Inf" in str(error)
    assert opt.averager.step == 3
    now = opt.optim.state_dict()
    assert torch.equal(now["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_post_local_sgd_arguments_agreed_across_ranks(world, rank):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    error = expect_error_on_every_rank(
        lambda: hva.PostLocalSGD(inner, model.named_parameters(), start_localSGD_iter=rank + 1),
        RuntimeError)
    assert "PostLocalSGD arguments differs across ranks" in str(error)
    error = expect_error_on_every_rank(
        lambda: hva.PostLocalSGD(inner, model.named_parameters(), start_localSGD_iter=1,
                                 local_group_size=0 if rank == 0 else 1), (ValueError, RuntimeError))
    assert ("local_group_size must be >= 1" in str(error)) if rank == 0 else "rank(s) [0]" in str(error)
