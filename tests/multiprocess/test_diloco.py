"""DiLoCo / SlowMo outer steps on real ranks, against a reference computed by hand that
simulates every rank (each rank's gradient depends on its rank and step, so every comparison
checks values that came from the other ranks)."""
import copy

import horovod.torch as hvd
import pytest
import torch

import hvd_averaging as hva
from helpers import OutOfBand, expect_error_on_every_rank

LR = 0.1
SHAPE = (5,)


def target(rank, step):
    """The point rank ``rank`` pulls towards at ``step`` (its local gradient is p - target)."""
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * rank + step))


def make(world, averager_factory, outer=None, **kwargs):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(SHAPE))
    inner = torch.optim.SGD([param], lr=LR)
    opt = hva.DiLoCo(inner, averager_factory(), outer_optimizer=outer, **kwargs)
    return param, opt


def train_step(param, opt, rank, step):
    opt.zero_grad()
    param.grad = param.detach() - target(rank, step)
    opt.step()


def resume(build, saved, rank, start, steps):
    """A fresh ``build()`` that loads ``saved`` (``{"param", "opt"}``) and trains steps
    ``start..steps-1``; its parameter."""
    param, opt = build()
    with torch.no_grad():
        param.copy_(saved["param"])
    opt.load_state_dict(saved["opt"])
    for s in range(start, steps):
        train_step(param, opt, rank, s)
    return param


def assert_same_as_uninterrupted(param, uninterrupted, world, name):
    """Bit-identical to the uninterrupted run, on every rank (each rank's verdict gathered)."""
    assert torch.equal(param.detach(), uninterrupted)
    assert hvd.allgather_object(torch.equal(param.detach(), uninterrupted), name=name) == [True] * world


def reference(world, steps, top_fires, level_fires=lambda s: False, group_of=None,
              outer_lr=0.7, momentum=0.9, nesterov=True):
    """Every rank's parameters after every step, by hand: inner SGD, plain group averages at
    the lower level, the outer SGD (Nesterov) step at the top level."""
    torch.manual_seed(0)
    start = torch.randn(SHAPE).double()
    local = [start.clone() for _ in range(world)]
    global_copy, buf = start.clone(), None
    history = []
    for s in range(steps):
        local = [w - LR * (w - target(r, s).double()) for r, w in enumerate(local)]
        if top_fires(s):
            average = sum(local) / world
            pseudo = global_copy - average
            buf = pseudo.clone() if buf is None else momentum * buf + pseudo
            update = pseudo + momentum * buf if nesterov else (buf if momentum else pseudo)
            global_copy = global_copy - outer_lr * update
            local = [global_copy.clone() for _ in range(world)]
        elif level_fires(s):
            local = [sum(local[q] for q in group_of(r)) / len(group_of(r)) for r in range(world)]
        history.append([w.clone() for w in local])
    return history


def check_against(history, param, opt, world, rank, steps):
    for s in range(steps):
        train_step(param, opt, rank, s)
        expected = history[s][rank].float()
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-6)
        everyone = hvd.allgather(param.detach().reshape(1, -1), name=f"test.diloco.{s}")
        for r in range(world):
            torch.testing.assert_close(everyone[r], history[s][r].float(), rtol=0, atol=1e-6)


def test_diloco_periodic_matches_reference(world, rank):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3))
    history = reference(world, 13, top_fires=lambda s: s % 3 == 0)
    check_against(history, param, opt, world, rank, 13)


def test_slowmo_settings_match_reference(world, rank):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=4, warmup_steps=2),
                      outer=hva.slowmo_outer_optimizer)
    history = reference(world, 15, top_fires=lambda s: s >= 2 and (s - 2) % 4 == 0,
                        outer_lr=1.0, momentum=0.5, nesterov=False)
    check_against(history, param, opt, world, rank, 15)


def test_hierarchical_diloco_matches_reference(world, rank):
    pair = min(2, world)
    param, opt = make(world, lambda: hva.HierarchicalModelAverager({2: pair, 4: world}))
    history = reference(world, 14, top_fires=lambda s: s % 4 == 0,
                        level_fires=lambda s: s % 2 == 0,
                        group_of=lambda r: list(range(r // pair * pair, r // pair * pair + pair)))
    check_against(history, param, opt, world, rank, 14)


def test_outer_sgd_lr_one_is_plain_periodic_averaging(world, rank):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3),
                      outer=lambda p: torch.optim.SGD(p, lr=1.0))
    plain = torch.nn.Parameter(param.detach().clone())
    plain_opt = hva.PostLocalSGDOptimizer(torch.optim.SGD([plain], lr=LR),
                                          hva.PeriodicModelAverager(period=3))
    for s in range(10):
        train_step(param, opt, rank, s)
        train_step(plain, plain_opt, rank, s)
        # global + average(local - global): the average, up to float32 rounding
        torch.testing.assert_close(param.detach(), plain.detach(), rtol=0, atol=1e-6)
    gathered = hvd.allgather(param.detach().reshape(1, -1), name="test.diloco.plain")
    assert torch.equal(gathered.min(0).values, gathered.max(0).values)


@pytest.mark.parametrize("checkpoint_after", [6, 7])  # 6: right after a firing step (period 3)
def test_resume_is_bit_identical(world, rank, checkpoint_after):
    steps = 12
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3))
    for s in range(steps):
        train_step(param, opt, rank, s)
    uninterrupted = param.detach().clone()

    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3))
    for s in range(checkpoint_after):
        train_step(param, opt, rank, s)
    saved = {"param": param.detach().clone(), "opt": opt.state_dict()}
    assert {"averager", "outer_optimizer", "global_parameters"} <= set(saved["opt"])
    assert saved["opt"]["step"] == checkpoint_after and "step" not in saved["opt"]["averager"]
    param = resume(lambda: make(world, lambda: hva.PeriodicModelAverager(period=3)), saved, rank,
                   checkpoint_after, steps)
    assert_same_as_uninterrupted(param, uninterrupted, world,
                                 f"test.diloco.resume.{checkpoint_after}")


def test_bad_arguments_raise_on_every_rank(world):
    param = torch.nn.Parameter(torch.zeros(SHAPE))
    inner = torch.optim.SGD([param], lr=LR)
    averager = hva.PeriodicModelAverager(period=3)
    error = expect_error_on_every_rank(lambda: hva.DiLoCo(inner, averager, outer_optimizer=5),
                                       TypeError)
    assert "outer_optimizer must be a callable" in str(error)
    error = expect_error_on_every_rank(
        lambda: hva.DiLoCo(inner, averager, outer_optimizer=lambda p: "not an optimizer"),
        TypeError)
    assert "must return a torch.optim.Optimizer, got str" in str(error)
    error = expect_error_on_every_rank(lambda: hva.DiLoCo(inner, object()), TypeError)
    assert "averager must be a hvd_averaging.ModelAverager" in str(error)


# -- overlapped (Streaming DiLoCo): the top level's round in flight for `delay` steps ----------

def overlapped_reference(world, steps, top_fires, delay, outer_lr, momentum,
                         level_fires=lambda s: False, group_of=None):
    """Every rank's parameters after every step, by hand: inner SGD; at a top-level firing step
    s the snapshots S_r are taken; at s + delay the outer SGD step on global - mean(S) gives the
    new global copy G and every rank becomes G + (w_r - S_r); lower levels average plainly."""
    torch.manual_seed(0)
    start = torch.randn(SHAPE).double()
    local = [start.clone() for _ in range(world)]
    global_copy, buf, in_flight = start.clone(), None, None
    history = []
    for s in range(steps):
        local = [w - LR * (w - target(r, s).double()) for r, w in enumerate(local)]
        if in_flight is not None and in_flight[0] == s:
            snapshots = in_flight[1]
            pseudo = global_copy - sum(snapshots) / world
            buf = pseudo.clone() if buf is None else momentum * buf + pseudo
            global_copy = global_copy - outer_lr * (buf if momentum else pseudo)
            local = [global_copy + (w - snap) for w, snap in zip(local, snapshots)]
            in_flight = None
        if top_fires(s):
            in_flight = (s + delay, [w.clone() for w in local])
        elif level_fires(s):
            local = [sum(local[q] for q in group_of(r)) / len(group_of(r)) for r in range(world)]
        history.append([w.clone() for w in local])
    return history


def halfway_momentum(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


@pytest.mark.parametrize("delay", [1, 2])
def test_overlapped_diloco_matches_reference(world, rank, delay):
    """Outer lr 0.5 moves the global copy halfway; momentum carries across rounds."""
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3, delay=delay),
                      outer=halfway_momentum)
    assert opt.overlapped
    history = overlapped_reference(world, 14, lambda s: s % 3 == 0, delay, 0.5, 0.9)
    check_against(history, param, opt, world, rank, 14)


def test_overlapped_hierarchical_diloco_matches_reference(world, rank):
    """The lower level (pairs every 2 steps) averages plainly inside the top level's window."""
    pair = min(2, world)
    param, opt = make(world, lambda: hva.HierarchicalModelAverager({2: pair, 8: world}, delay=3),
                      outer=halfway_momentum)
    history = overlapped_reference(
        world, 20, lambda s: s % 8 == 0, 3, 0.5, 0.9, level_fires=lambda s: s % 2 == 0,
        group_of=lambda r: list(range(r // pair * pair, r // pair * pair + pair)))
    check_against(history, param, opt, world, rank, 20)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_overlapped_outer_sgd_lr_one_is_the_delayed_averager(world, rank, hierarchical):
    def averager():
        if hierarchical:
            return hva.HierarchicalModelAverager({2: min(2, world), 4: world}, delay=2)
        return hva.PeriodicModelAverager(period=4, delay=2)

    param, opt = make(world, averager, outer=lambda p: torch.optim.SGD(p, lr=1.0))
    plain = torch.nn.Parameter(param.detach().clone())
    plain_opt = hva.PostLocalSGDOptimizer(torch.optim.SGD([plain], lr=LR), averager())
    for s in range(13):
        train_step(param, opt, rank, s)
        train_step(plain, plain_opt, rank, s)
        # global + average(local - global): the average, up to float32 rounding
        torch.testing.assert_close(param.detach(), plain.detach(), rtol=0, atol=1e-6)
    everyone = hvd.allgather(param.detach().reshape(1, -1), name=f"test.diloco.ovl.{hierarchical}")
    assert not torch.equal(everyone.min(0).values, everyone.max(0).values), \
        "ranks differ between rounds: each keeps its own progress since the snapshot"


@pytest.mark.parametrize("saved_after", [1, 2])  # fired at 3, applied at 5: mid-window, due now
@pytest.mark.parametrize("wire", [{}, {"compression": "int8", "error_feedback": True}],
                         ids=["float32", "int8-feedback"])
def test_overlapped_resume_is_bit_identical(world, rank, saved_after, wire):
    """The restarted round sends the saved snapshot's progress since the loaded global copy:
    the same bytes as the interrupted one (int8 with error feedback: the same residuals too)."""
    steps, fired = 11, 3

    def build():
        return make(world, lambda: hva.PeriodicModelAverager(period=3, delay=2, **wire),
                    outer=halfway_momentum)

    param, opt = build()
    for s in range(steps):
        train_step(param, opt, rank, s)
    uninterrupted = param.detach().clone()
    param, opt = build()
    for s in range(fired + saved_after):
        train_step(param, opt, rank, s)
    saved = {"param": param.detach().clone(), "opt": opt.state_dict()}
    assert saved["opt"]["averager"]["in_flight"][3]["fired_at"] == fired
    param = resume(build, saved, rank, fired + saved_after, steps)
    assert_same_as_uninterrupted(param, uninterrupted, world,
                                 f"test.diloco.ovl.resume.{saved_after}.{bool(wire)}")


def test_overlapped_fp16_on_the_wire_stays_close(world, rank):
    exact, opt32 = make(world, lambda: hva.PeriodicModelAverager(period=3, delay=1),
                        outer=halfway_momentum)
    wire16, opt16 = make(world, lambda: hva.PeriodicModelAverager(
        period=3, delay=1, compression=hvd.Compression.fp16), outer=halfway_momentum)
    hva.reset_traffic()
    for s in range(10):
        train_step(exact, opt32, rank, s)
    float32_bytes = hva.traffic().bytes
    hva.reset_traffic()
    for s in range(10):
        train_step(wire16, opt16, rank, s)
    assert hva.traffic().bytes * 2 == float32_bytes  # float16 on the wire
    torch.testing.assert_close(wire16.detach(), exact.detach(), rtol=0, atol=5e-3)
    assert not torch.equal(wire16.detach(), exact.detach())  # it did round


def test_overlapped_late_rank_times_out_at_the_apply_step(world, rank):
    late = world - 1
    signals = OutOfBand("diloco-stall")
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3, delay=1),
                      outer=halfway_momentum)
    for s in range(3):  # step 0 starts a round, step 1 applies it (the outer step)
        train_step(param, opt, rank, s)
    hva.set_timeout(3, exit_after=None)  # this test recovers from the stall
    try:
        if rank == late:
            signals.wait_for("raised", [r for r in range(world) if r != late])
            train_step(param, opt, rank, 3)  # starts its round; the others gave up
            train_step(param, opt, rank, 4)  # applies it: complete, since all started
            raised = None
        else:
            train_step(param, opt, rank, 3)  # fires: returns without waiting
            with pytest.raises(hva.AveragingTimeoutError) as info:
                train_step(param, opt, rank, 4)  # the apply step: the outer step waits
            signals.tell("raised")
            raised = str(info.value)
            assert "PeriodicModelAverager step 3 (delay 1)" in raised
    finally:
        hva.set_timeout(None)
    signals.close()
    assert hvd.allgather_object(raised is None, name="test.diloco.stall") == \
        [r == late for r in range(world)]


# -- int8 on the wire: the progress since the global copy travels, not the parameters ----------

FAR = 4096  # 4 int8 blocks


def far_target(rank, step):
    """Targets near 100: parameters far larger than the progress one round makes."""
    noise = torch.randn(FAR, generator=torch.Generator().manual_seed(1000 * rank + step))
    return 100.0 + 0.01 * noise


@pytest.mark.parametrize("delay", [0, 1])
def test_int8_rounds_the_progress_not_the_parameters(world, rank, delay):
    """Parameters near 100 moving by about 1e-3 per round: int8 of the parameters would be off
    by up to 100/254 per element; of the progress since the global copy, by far less."""
    def run(compression):
        torch.manual_seed(0)
        param = torch.nn.Parameter(100.0 + 0.01 * torch.randn(FAR))
        opt = hva.DiLoCo(torch.optim.SGD([param], lr=LR), hva.PeriodicModelAverager(
            period=3, delay=delay, compression=compression), outer_optimizer=halfway_momentum)
        for s in range(13):
            opt.zero_grad()
            param.grad = param.detach() - far_target(rank, s)
            opt.step()
        return param.detach().clone(), opt.global_parameters[0].detach().clone()

    exact, exact_global = run(None)
    int8, int8_global = run("int8")
    error = (int8 - exact).abs().max().item()
    # rounding the progress (|progress| < 0.05): a few 1e-4 after momentum; the parameters: ~0.4
    assert error < 2e-3, f"int8 DiLoCo is {error} away from float32 DiLoCo"
    assert not torch.equal(int8_global, exact_global)  # it did round
    globals_ = hvd.allgather(int8_global.reshape(1, -1), name=f"test.diloco.int8.{delay}")
    assert torch.equal(globals_.min(0).values, globals_.max(0).values), \
        "the global copies differ across ranks"


@pytest.mark.parametrize("kind", ["periodic", "hierarchical", "overlapped"])
def test_ranks_seeded_apart_start_from_one_point(world, rank, kind):
    """Ranks that initialize their models with different seeds (as examples/slurm/train.py
    does) hold rank 0's weights after construction and bit-identical parameters after the first
    outer step. Before construction broadcast them, the global copies differed and the ranks'
    parameters stayed apart after every outer step (up to 0.58 measured)."""
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    first = hvd.broadcast(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), 0,
                          name=f"test.diloco.seeded.first.{kind}")
    if kind == "periodic":
        averager = hva.PeriodicModelAverager(period=3)
    elif kind == "hierarchical":
        averager = hva.HierarchicalModelAverager({2: min(2, world), 4: world})
    else:
        averager = hva.PeriodicModelAverager(period=4, delay=1)
    opt = hva.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.05), averager)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), first)
    assert torch.equal(torch.cat([g.detach().reshape(-1) for g in opt.global_parameters]), first)
    outer_done = {"periodic": 1, "hierarchical": 1, "overlapped": 2}[kind]  # applied at 0 + delay
    generator = torch.Generator().manual_seed(rank)
    for step in range(outer_done):
        opt.zero_grad()
        x = torch.randn(8, 4, generator=generator)
        model(x).square().mean().backward()
        opt.step()
        # overlapped, each rank keeps its progress made after the snapshot: make it none
        opt.param_groups[0]["lr"] = 0.0
    for name, tensors in (("params", model.parameters()), ("global", opt.global_parameters)):
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        everyone = hvd.allgather(flat.reshape(1, -1), name=f"test.diloco.seeded.{kind}.{name}")
        assert all(torch.equal(everyone[0], row) for row in everyone), name
        assert not torch.equal(flat, first), "an outer step moved them"


def test_diloco_global_copies_that_differ_on_load_raise_on_every_rank(world, rank):
    param, opt = make(world, lambda: hva.PeriodicModelAverager(period=3))
    for s in range(4):
        train_step(param, opt, rank, s)
    saved = opt.state_dict()
    before = [g.detach().clone() for g in opt.global_parameters]
    inner_before = copy.deepcopy(opt.optim.state_dict())
    if rank == world - 1:
        saved["global_parameters"] = [g + 1 for g in saved["global_parameters"]]
    error = expect_error_on_every_rank(lambda: opt.load_state_dict(saved), RuntimeError)
    assert "digest of the global copy" in str(error) and "differs across ranks" in str(error)
    others = [r for r in range(world) if r != world - 1]
    assert (f"ranks {[world - 1]} have something else" in str(error)) if rank != world - 1 else \
        (f"ranks {others} have something else" in str(error))
    # nothing was applied on any rank
    assert all(torch.equal(g, b) for g, b in zip(opt.global_parameters, before))
    assert opt.averager.step == 4 and opt.optim.state_dict() == inner_before
