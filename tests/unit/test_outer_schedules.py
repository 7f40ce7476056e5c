"""The outer momentum warm-up's rule, by hand, on PyTorch's own optimizers (single process: the
schedule talks to no other rank; DiLoCo's use of it is tested multi-process)."""
import pytest
import torch

from hvd_averaging.outer_schedules import OuterMomentumWarmup, warmed_up_momentum


def sgd(momentum=0.9, **kwargs):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.5, momentum=momentum,
                           **kwargs)


@pytest.mark.parametrize("outer_steps", [1, 2, 3, 5])
@pytest.mark.parametrize("start", [0.0, 0.5])
def test_rule_starts_at_start_and_reaches_the_target_after_outer_steps(outer_steps, start):
    values = [warmed_up_momentum(0.9, start, outer_steps, k) for k in range(outer_steps + 3)]
    assert values[0] == start
    for k in range(1, outer_steps):
        assert values[k] == pytest.approx(start + k / outer_steps * (0.9 - start))
        assert values[k - 1] < values[k] < 0.9
    assert values[outer_steps:] == [0.9] * 3


def test_sgd_momentum_follows_the_rule_step_by_step():
    opt = sgd(nesterov=True)
    warmup = OuterMomentumWarmup(opt, outer_steps=4)
    seen = [opt.param_groups[0]["momentum"]]
    for _ in range(6):
        opt.step()
        warmup.step()
        seen.append(opt.param_groups[0]["momentum"])
    assert seen == pytest.approx([0.0, 0.225, 0.45, 0.675, 0.9, 0.9, 0.9])
    assert opt.param_groups[0]["initial_momentum"] == 0.9


def test_adam_warms_up_beta1_and_keeps_beta2():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], betas=(0.8, 0.95))
    warmup = OuterMomentumWarmup(opt, outer_steps=2, start=0.2)
    assert opt.param_groups[0]["betas"] == (0.2, 0.95)
    warmup.step()
    assert opt.param_groups[0]["betas"] == pytest.approx((0.5, 0.95))
    warmup.step()
    assert opt.param_groups[0]["betas"] == pytest.approx((0.8, 0.95))


def test_each_group_rises_to_its_own_momentum():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.9}, {"params": [b], "momentum": 0.5}],
                          lr=1.0)
    warmup = OuterMomentumWarmup(opt, outer_steps=2)
    warmup.step()
    assert [g["momentum"] for g in opt.param_groups] == pytest.approx([0.45, 0.25])


def test_state_dict_resumes_where_it_left_off():
    opt = sgd()
    warmup = OuterMomentumWarmup(opt, outer_steps=4)
    for _ in range(3):
        warmup.step()
    saved_opt, saved = opt.state_dict(), warmup.state_dict()
    assert saved == {"outer_steps_taken": 3, "outer_steps": 4, "start": 0.0}
    fresh_opt = sgd()
    fresh_opt.load_state_dict(saved_opt)  # keeps "initial_momentum" in its groups, as saved
    fresh = OuterMomentumWarmup(fresh_opt, outer_steps=4)
    assert fresh_opt.param_groups[0]["momentum"] == 0.0
    fresh.load_state_dict(saved)
    assert fresh_opt.param_groups[0]["momentum"] == pytest.approx(0.675)
    fresh.step()
    assert fresh_opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("kwargs, words", [
    ({"outer_steps": 0}, ["outer_steps=0", ">= 1"]),
    ({"outer_steps": 2.5}, ["outer_steps=2.5", "integer"]),
    ({"outer_steps": True}, ["outer_steps=True", "integer"]),
    ({"outer_steps": 4, "start": 1.0}, ["start=1.0", "[0, 1)"]),
    ({"outer_steps": 4, "start": -0.1}, ["start=-0.1", "[0, 1)"]),
    ({"outer_steps": 4, "start": 0.95}, ["start=0.95", "must not exceed", "0.9"]),
])
def test_bad_arguments_name_the_value_and_the_rule(kwargs, words):
    opt = sgd()
    before = opt.param_groups[0].copy()
    with pytest.raises(ValueError) as raised:
        OuterMomentumWarmup(opt, **kwargs)
    for word in words:
        assert word in str(raised.value)
    assert opt.param_groups[0] == before, "a rejected schedule leaves the optimizer as it was"


def test_an_optimizer_without_momentum_is_refused():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="Adagrad's parameter group #0 has no 'momentum'"):
        OuterMomentumWarmup(opt, 3)
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer, got list"):
        OuterMomentumWarmup([], 3)


@pytest.mark.parametrize("state, words", [
    ({"outer_steps_taken": 1}, ["needs 'outer_steps_taken'"]),
    ({"outer_steps_taken": -1, "outer_steps": 4, "start": 0.0}, ["outer_steps_taken=-1"]),
    ({"outer_steps_taken": 1, "outer_steps": 8, "start": 0.0}, ["outer_steps=8", "not this one's"]),
])
def test_a_checkpoint_of_another_schedule_is_refused_unapplied(state, words):
    opt = sgd()
    warmup = OuterMomentumWarmup(opt, outer_steps=4)
    warmup.step()
    with pytest.raises(ValueError) as raised:
        warmup.load_state_dict(state)
    for word in words:
        assert word in str(raised.value)
    assert warmup.outer_steps_taken == 1 and opt.param_groups[0]["momentum"] == 0.225
