"""Horovod's and PyTorch's recipes on the wrappers, as a new user tries them (issue 40): state
creation that counts no step (Horovod's function with a GradScaler, a copy of it, PyTorch DCP's),
a zero-gradient step that counts as in PyTorch, DiLoCo's one starting point for buffers and
frozen parameters, and loading that is all or nothing (including a file one rank cannot read).
"""
import copy

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import OutOfBand, expect_error_on_every_rank

WRAPPERS = ["PostLocalSGDOptimizer", "PostLocalSGD", "DiLoCo"]


def make_model(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 1)


def wrap(kind, model, inner, period=2, **kwargs):
    averager = hva.PeriodicModelAverager(period=period)
    if kind == "PostLocalSGDOptimizer":
        return hva.PostLocalSGDOptimizer(inner, averager, **kwargs)
    if kind == "PostLocalSGD":
        return hva.PostLocalSGD(inner, model.named_parameters(), start_localSGD_iter=0,
                                averager=averager, **kwargs)
    return hva.DiLoCo(inner, averager, **kwargs)


def train(model, opt, steps, rank, scaler=None, first=0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 5, generator=g)),
                                            torch.randn(8, 1, generator=g))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        opt.step()
        if scaler is not None:
            scaler.update()


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def same_on_every_rank(tensor, name):
    everyone = hvd.allgather(tensor.reshape(1, -1), name=name)
    return all(torch.equal(everyone[0], row) for row in everyone)


def copied_broadcast_optimizer_state(optimizer, root_rank, process_set=hvd.global_process_set):
    """Horovod 0.28.1's broadcast_optimizer_state re-typed, as users do to add ``process_set=``
    (its state creation step and the tensor broadcast; its scalar options are left out)."""
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
        optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return
    for pid, per_param in sorted(state_dict["state"].items()):
        for name, value in sorted(per_param.items()):
            if torch.is_tensor(value) and value.dim() > 0:
                hvd.broadcast_(value, root_rank, name=f"copied.bos.{pid}.{name}",
                               process_set=process_set)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_broadcast_optimizer_state_with_grad_scaler(world, rank, kind):
    """Horovod's recipe with grad_scaler=: at 93134b6 it went through GradScaler.step on a fresh
    scaler and raised AssertionError ("Attempted step but _scale is None"). Now the state is
    created by the inner step alone: no scaler step, nothing counted or averaged; training then
    runs through the scaler and every rank counts the same steps."""
    model = make_model()
    with torch.no_grad():
        model.weight.add_(float(rank))  # ranks differ: an averaging would show
    scaler = torch.amp.GradScaler("cpu")
    opt = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
               grad_scaler=scaler)
    before = model.weight.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.averager.step == 0 and torch.equal(model.weight.detach(), before)
    assert scaler._scale is None, "the scaler took no step"
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())
    train(model, opt, 3, rank, scaler=scaler)
    assert opt.averager.step == 3
    assert hvd.allgather_object(opt.averager.step, name=f"test.recipes.scaler.{kind}") == [3] * world


@pytest.mark.parametrize("kind", WRAPPERS)
@pytest.mark.parametrize("inner", ["SGD", "Adam"])
def test_copied_broadcast_optimizer_state_inside_state_initialization(world, rank, kind, inner):
    """A re-typed copy of Horovod's function is no function the wrapper can recognize: at
    93134b6 the averager counted its step (1 before training) and averaged. Inside
    ``opt.state_initialization()`` its step creates the state only, also for a stateless SGD
    (whose state stays empty, so the copy steps again)."""
    model = make_model()
    with torch.no_grad():
        model.weight.add_(float(rank))
    inner_opt = torch.optim.SGD(model.parameters(), lr=0.1) if inner == "SGD" else \
        torch.optim.Adam(model.parameters(), lr=0.1)
    opt = wrap(kind, model, inner_opt)
    before = model.weight.detach().clone()
    with opt.state_initialization():
        copied_broadcast_optimizer_state(opt, root_rank=0)
    assert opt.averager.step == 0
    assert torch.equal(model.weight.detach(), before), "zero gradients and nothing averaged"
    if inner == "Adam":
        assert all("exp_avg" in opt.state[p] for p in model.parameters())
    train(model, opt, 2, rank)
    assert hvd.allgather_object(opt.averager.step, name=f"test.recipes.copy.{kind}.{inner}") == [2] * world


@pytest.mark.parametrize("kind", WRAPPERS)
def test_initialize_state_then_copied_recipe_takes_no_step(world, rank, kind):
    """``opt.initialize_state()`` creates Adam's state with learning rate 0 (AdamW's weight decay
    moves nothing either) and counts nothing; the copied recipe then finds a state and takes no
    step at all."""
    model = make_model()
    opt = wrap(kind, model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
    before = flat(model.parameters())
    opt.initialize_state()
    assert all("exp_avg" in opt.state[p] for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(flat(model.parameters()), before), "lr 0: nothing moved"
    assert opt.param_groups[0]["lr"] == 0.1, "the learning rate is back"
    copied_broadcast_optimizer_state(opt, root_rank=0)
    assert opt.averager.step == 0
    train(model, opt, 2, rank)
    assert hvd.allgather_object(opt.averager.step, name=f"test.recipes.init.{kind}") == [2] * world


@pytest.mark.parametrize("kind", WRAPPERS)
def test_dcp_state_initialisation_counts_no_step(world, rank, kind):
    """PyTorch DCP creates a missing state with a zero-gradient step() at learning rate 0
    (``set_optimizer_state_dict`` -> ``_init_optim_state``): recognized like Horovod's function,
    nothing counted or averaged (at 93134b6 it counted one step and averaged)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    model = make_model()
    with torch.no_grad():
        model.weight.add_(float(rank))
    opt = wrap(kind, model, torch.optim.Adam(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    _init_optim_state(opt)
    assert opt.averager.step == 0 and torch.equal(model.weight.detach(), before)
    assert all("exp_avg" in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("kind", WRAPPERS)
def test_deliberately_zero_gradient_step_counts_as_in_pytorch(world, rank, kind):
    """A training step whose gradients are all zero is a training step: PyTorch's optimizer and
    scheduler count it, and so does the averager (here its first step, a firing step, averages
    the ranks' differing weights). Guards against telling state creation apart by the values."""
    model = make_model()
    with torch.no_grad():
        model.weight.add_(float(rank))
    opt = wrap(kind, model, torch.optim.Adam(model.parameters(), lr=0.1))
    opt.zero_grad()
    (0.0 * model(torch.ones(2, 5)).sum()).backward()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    opt.step()
    assert opt.averager.step == 1
    assert same_on_every_rank(model.weight.detach(), f"test.recipes.zero.{kind}")
    assert all("exp_avg" in opt.state[p] for p in model.parameters())


class FrozenAndNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.frozen(x)))


def test_diloco_start_covers_buffers_and_frozen_parameters(world, rank):
    """Ranks seeded apart, with BatchNorm statistics that differ: DiLoCo's start takes the first
    member's buffers and, given ``model=``, frozen parameters outside the optimizer too, as DDP
    does (at 93134b6 the running mean kept each rank's value)."""
    torch.manual_seed(50 + rank)
    model = FrozenAndNormed()
    model.train()
    model(torch.randn(16, 4) + rank)  # running statistics of this rank's data
    assert not same_on_every_rank(model.norm.running_mean, "test.recipes.bn.before")
    opt = hva.DiLoCo(torch.optim.SGD(model.head.parameters(), lr=0.1),
                     hva.PeriodicModelAverager(period=2), buffers=model.buffers(), model=model)
    for name, tensor in model.state_dict().items():
        assert same_on_every_rank(tensor.float(), f"test.recipes.start.{name}"), name
    assert same_on_every_rank(flat(opt.global_parameters), "test.recipes.start.global")


def test_diloco_in_elastic_job_without_handler_compares_its_global_copy(world, rank, monkeypatch):
    """A DiLoCo built in an elastic job (construction skips its broadcast: the elastic handler
    syncs it) that no ``TorchState`` holds: ranks seeded apart would average progress against
    different global copies and drift apart silently (at 93134b6). At its first outer step the
    digests are compared and every rank raises, naming the recipe; ranks whose copies agree go
    on."""
    for seeded_apart in (True, False):
        torch.manual_seed(70 + (rank if seeded_apart else 0))
        model = torch.nn.Linear(4, 2)
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")  # what horovodrun sets in an elastic job
        opt = hva.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1),
                         hva.PeriodicModelAverager(period=2))
        monkeypatch.delenv("HOROVOD_ELASTIC")
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        if seeded_apart:
            error = expect_error_on_every_rank(opt.step, RuntimeError)
            assert "global copy (digest) at its first outer step" in str(error)
            assert "hvd.elastic.TorchState" in str(error)
            assert opt.averager.step == 0, "nothing averaged or counted"
        else:
            opt.step()
            assert opt.averager.step == 1
            assert same_on_every_rank(flat(model.parameters()), "test.recipes.elastic.agree")


def trained(kind, rank, steps, inner="Adam", **kwargs):
    model = make_model()
    inner_opt = torch.optim.Adam(model.parameters(), lr=0.01) if inner == "Adam" else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = wrap(kind, model, inner_opt, **kwargs)
    train(model, opt, steps, rank)
    return model, opt


def unchanged(opt, inner_before, step_before):
    now = opt.optim.state_dict()
    return opt.averager.step == step_before and now["param_groups"] == inner_before["param_groups"] \
        and all(torch.equal(now["state"][k][n], inner_before["state"][k][n])
                for k in inner_before["state"] for n in inner_before["state"][k])


@pytest.mark.parametrize("kind", WRAPPERS)
def test_adam_state_without_step_is_refused_before_anything_is_applied(world, rank, kind):
    """A checkpoint saved at step 2 whose Adam state lacks "step" (one rank's file): at 93134b6
    the averager's step became 2 (was 6) and then Adam's own load raised KeyError, half loaded.
    Now the inner optimizer is trial-loaded into a copy before the agreement: every rank
    raises and keeps step 6 and its Adam state."""
    model, opt = trained(kind, rank, 2)
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, 4, rank, first=2)
    inner_before = copy.deepcopy(opt.optim.state_dict())
    bad = world - 1
    if rank == bad:
        del saved["state"][0]["step"]
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), (ValueError, RuntimeError))
    assert "does not load into Adam: KeyError" in str(error)
    if rank != bad:
        assert f"rank(s) [{bad}] raised an error" in str(error)
    assert unchanged(opt, inner_before, 6)


@pytest.mark.parametrize("kind", WRAPPERS)
def test_state_of_another_shape_is_refused(world, rank, kind):
    """PyTorch's load takes a momentum buffer of any shape (and fails at the next step, or
    broadcasts it): compared with the parameter's before the agreement (at 93134b6 it loaded)."""
    model, opt = trained(kind, rank, 3, inner="SGD")
    saved = copy.deepcopy(opt.state_dict())
    inner_before = copy.deepcopy(opt.optim.state_dict())
    if rank == 0:
        saved["state"][0]["momentum_buffer"] = torch.zeros(5, 1)
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), (ValueError, RuntimeError))
    assert "has shape (5, 1), the parameter's state needs (1, 5)" in str(error)
    assert unchanged(opt, inner_before, 3)


def test_outer_lr_scheduler_of_another_kind_is_refused(world, rank):
    """A DiLoCo with a LambdaLR outer schedule given a checkpoint of one with StepLR: at
    93134b6 the inner optimizer and averager were applied, then LambdaLR's load raised KeyError.
    Now every rank refuses it naming both kinds, and nothing changed."""
    def diloco(schedule):
        model = make_model()
        return model, hva.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                 hva.PeriodicModelAverager(period=2), outer_scheduler=schedule)
    model, step_lr = diloco(lambda outer: torch.optim.lr_scheduler.StepLR(outer, step_size=2))
    train(model, step_lr, 3, rank)
    saved = copy.deepcopy(step_lr.state_dict())
    model, lambda_lr = diloco(lambda outer: torch.optim.lr_scheduler.LambdaLR(outer, lambda s: 0.9 ** s))
    train(model, lambda_lr, 5, rank)
    inner_before = copy.deepcopy(lambda_lr.optim.state_dict())
    global_before = flat(lambda_lr.global_parameters)
    error = expect_error_on_every_rank(lambda: lambda_lr.load_state_dict(saved), ValueError)
    assert "is not a LambdaLR's state" in str(error) and "a LambdaLR saves" in str(error)
    assert unchanged(lambda_lr, inner_before, 5)
    assert torch.equal(flat(lambda_lr.global_parameters), global_before)


@pytest.mark.parametrize("residual", ["list", "shape"])
def test_int8_residual_that_is_no_tensor_or_of_another_shape_is_refused(world, rank, residual):
    """Error feedback's residuals: at 93134b6 a list passed (torch.as_tensor took it) and a
    tensor of another shape was dropped silently at the next round."""
    averager = hva.PeriodicModelAverager(period=2, compression="int8", error_feedback=True)
    model = make_model()
    opt = hva.PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), averager)
    train(model, opt, 3, rank)
    saved = copy.deepcopy(opt.state_dict())
    kept = saved["averager"]["wire"][2]["residuals"]
    name = sorted(kept)[0]
    if rank == 0:
        kept[name] = kept[name].tolist() if residual == "list" else torch.zeros(kept[name].numel() + 1)
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), (ValueError, RuntimeError))
    assert ("must be a floating-point tensor, got list" if residual == "list"
            else "this level keeps") in str(error)
    assert opt.averager.step == 3


def test_load_checkpoint_names_a_missing_or_damaged_file_on_every_rank(world, rank):
    """``hva.load_checkpoint``: one rank's file missing, then damaged. That rank raises what
    torch.load raised, the others a RuntimeError naming it and the cause, at once (not an
    AveragingTimeoutError after hva.timeout() blaming a dead rank); a good file loads on every
    rank."""
    folder = OutOfBand("load_checkpoint")
    model, opt = trained("PostLocalSGDOptimizer", rank, 3, inner="SGD")
    good = folder.path / f"good.{rank}.pt"
    torch.save(opt.state_dict(), good)
    bad = world - 1
    missing = folder.path / f"missing.{rank}.pt" if rank == bad else good
    error = expect_error_on_every_rank(lambda: hva.load_checkpoint(missing), (OSError, RuntimeError))
    if rank == bad:
        assert isinstance(error, FileNotFoundError)
    else:
        assert isinstance(error, RuntimeError) and f"rank(s) [{bad}] raised an error" in str(error)
        assert "FileNotFoundError" in str(error) and "missing" in str(error)
    damaged = folder.path / f"damaged.{rank}.pt"
    damaged.write_bytes(good.read_bytes()[: 40] if rank == bad else good.read_bytes())
    error = expect_error_on_every_rank(lambda: hva.load_checkpoint(damaged), Exception)
    assert not isinstance(error, hva.AveragingTimeoutError)
    if rank != bad:
        assert f"rank(s) [{bad}] raised an error" in str(error)
    loaded = hva.load_checkpoint(good)
    opt.load_state_dict(loaded)
    assert opt.averager.step == 3
    folder.close()


@pytest.mark.parametrize("kind", WRAPPERS)
def test_elastic_state_restores_a_wrapper_locally_and_syncs_it_from_rank_0(world, rank, kind):
    """``hvd.elastic.TorchState`` holding a wrapper as its optimizer: ``restore()`` runs right
    after a ``HorovodInternalError``, when no collective can run, so it must be local. Here rank
    0 alone restores while the others wait outside Horovod: it gets back the committed step and
    inner state at once (at 93134b6 Horovod's optimizer handler called the wrapper's collective
    ``load_state_dict``, which waited for the other ranks and timed out). ``sync()`` then gives
    every rank rank 0's step and inner state."""
    timeout = hva.timeout()
    hva.set_timeout(10)
    oob = OutOfBand(f"restore.{kind}")
    model = make_model()
    opt = wrap(kind, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    train(model, opt, 3, rank)
    state = hvd.elastic.TorchState(model, optimizer=opt)
    committed = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    train(model, opt, 2, rank, first=3)
    if rank == 0:
        state.restore()
        oob.tell("restored")
    oob.wait_for("restored", [0], limit_s=60)
    assert opt.averager.step == (3 if rank == 0 else 5)
    if rank == 0:
        assert all(torch.equal(opt.state[p]["momentum_buffer"], c)
                   for p, c in zip(model.parameters(), committed))
    state.sync()
    assert hvd.allgather_object(opt.averager.step, name=f"test.recipes.sync.{kind}") == [3] * world
    assert same_on_every_rank(flat(opt.state[p]["momentum_buffer"] for p in model.parameters()),
                              f"test.recipes.sync.state.{kind}")
    train(model, opt, 1, rank, first=3)
    assert hvd.allgather_object(opt.averager.step, name=f"test.recipes.sync.after.{kind}") == [4] * world
    hva.set_timeout(timeout)
    oob.close()
