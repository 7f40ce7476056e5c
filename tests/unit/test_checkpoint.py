"""hvd_averaging.checkpoint: every checkpoint form splits to the same parts, and every check
finds what it must before anything is applied (pure logic, one process)."""
import pytest
import torch

import copy

from hvd_averaging.checkpoint import (averager_state_error, non_finite_error,
                                      optimizer_state_error, optimizer_trial_error,
                                      schedule_trial_error, split_wrapper_state, step_error,
                                      tensors_error)


def inner_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return opt, opt.state_dict()


@pytest.mark.parametrize("form", ["pytorch", "step in averager", "top step and iteration",
                                  "plain optimizer"])
def test_every_form_splits_to_inner_and_averager_parts(form):
    _, inner = inner_state()
    if form == "pytorch":
        saved = {**inner, "step": 7, "averager": {"config": {"period": 2}}}
    elif form == "step in averager":
        saved = {**inner, "averager": {"step": 7, "config": {"period": 2}}}
    elif form == "top step and iteration":
        saved = {**inner, "step": 7, "iteration": 7, "averager": {}}
    else:
        saved = dict(inner)
    parts = split_wrapper_state(saved)
    assert set(parts.inner) == {"state", "param_groups"}
    assert parts.averager["step"] == (0 if form == "plain optimizer" else 7)
    assert parts.step_missing is (form == "plain optimizer")


def test_split_refuses_what_is_no_state_dict():
    with pytest.raises(ValueError, match="must be a dict, got list"):
        split_wrapper_state([1, 2])
    with pytest.raises(ValueError, match=r"state_dict\['averager'\] must be a dict"):
        split_wrapper_state({"state": {}, "param_groups": [], "averager": 3})


@pytest.mark.parametrize("step", [-1, 1.5, True, None, "3"])
def test_bad_steps(step):
    assert "must be an integer >= 0" in str(step_error(step))


def test_optimizer_state_checks_groups_counts_and_values():
    opt, state = inner_state()
    assert optimizer_state_error(opt, state) is None
    assert "needs 'state' and 'param_groups'" in str(optimizer_state_error(opt, {"state": {}}))
    two_groups = {**state, "param_groups": state["param_groups"] * 2}
    assert "2 parameter group(s), the optimizer has 1" in str(optimizer_state_error(opt, two_groups))
    fewer = {**state, "param_groups": [{**state["param_groups"][0], "params": [0]}]}
    assert "has 1 parameters, the optimizer's has 2" in str(optimizer_state_error(opt, fewer))
    state["state"][1]["momentum_buffer"][0] = float("inf")
    assert "holds 1 NaN/Inf" in str(optimizer_state_error(opt, state))


def test_averager_state_checks_rounds_in_flight_and_residuals():
    delays = {4: 2}
    snapshot = {"fired_at": 8, "layout": 1, "snapshots": [torch.zeros(3)]}
    assert averager_state_error({"step": 9, "in_flight": {4: snapshot}}, delays, set()) is None
    assert "does not fit this averager at step 11" in str(
        averager_state_error({"step": 11, "in_flight": {4: snapshot}}, delays, set()))
    assert "does not fit" in str(averager_state_error({"step": 9, "in_flight": {2: snapshot}},
                                                      delays, set()))
    nan = {**snapshot, "snapshots": [torch.tensor([0.0, float("nan")])]}
    assert "NaN/Inf" in str(averager_state_error({"step": 9, "in_flight": {4: nan}}, delays, set()))
    residual = {"residuals": {"params.float32": torch.tensor([float("inf")])}}
    assert "NaN/Inf" in str(averager_state_error({"step": 9, "wire": {4: residual}}, delays, {4: {}}))
    # saved with error feedback, loaded without: not this averager's state to check
    assert averager_state_error({"step": 9, "wire": {4: residual}}, delays, {}) is None


@pytest.mark.parametrize("value, match", [
    ([0.5, 0.25], "must be a floating-point tensor, got list"),
    (torch.tensor([1, 2]), "must be a floating-point tensor, got Tensor"),
    (torch.zeros(5), r"has shape \(5,\), this level keeps \(4,\) there"),
])
def test_residuals_must_be_float_tensors_shaped_as_kept(value, match):
    """A residual that is no tensor (torch.as_tensor took a list before) or of another shape
    than the level keeps under its name (Residuals.get dropped it silently) is refused."""
    state = {"step": 9, "wire": {4: {"residuals": {"0.sent": value}}}}
    assert averager_state_error(state, {}, {4: {"0.sent": (4,)}}) is not None
    assert __import__("re").search(match, str(averager_state_error(state, {}, {4: {"0.sent": (4,)}})))
    fits = {"step": 9, "wire": {4: {"residuals": {"0.sent": torch.zeros(4)}}}}
    assert averager_state_error(fits, {}, {4: {"0.sent": (4,)}}) is None
    assert averager_state_error(fits, {}, {4: {}}) is None  # nothing kept yet: any shape


def adam_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_trial_load_finds_what_the_real_load_raises_and_changes_nothing():
    """An Adam state without its per-parameter "step" passes the count checks but fails in
    Adam's own load (KeyError): the trial finds it on a copy, and the optimizer keeps its state."""
    model, opt = adam_state()
    saved = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    assert optimizer_trial_error(opt, saved) is None
    del saved["state"][0]["step"]
    assert optimizer_state_error(opt, saved) is None
    error = optimizer_trial_error(opt, saved)
    assert "does not load into Adam: KeyError" in str(error)
    with pytest.raises(KeyError):
        copy.deepcopy(opt).load_state_dict(saved)  # what the real load does
    now = opt.state_dict()
    assert now["param_groups"] == before["param_groups"]
    assert all(torch.equal(now["state"][k][n], before["state"][k][n])
               for k in before["state"] for n in before["state"][k])


def test_state_shaped_unlike_the_parameter_is_refused():
    model, opt = adam_state()
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"] = torch.zeros(3, 2)  # the weight is (2, 3)
    assert "['exp_avg'] has shape (3, 2), the parameter's state needs (2, 3)" in \
        str(optimizer_state_error(opt, saved))
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)  # no state of its own: the parameter's
    assert "needs (2, 3)" in str(optimizer_state_error(fresh, saved))


def test_schedule_of_another_kind_or_broken_state_is_refused_and_nothing_changes():
    model, opt = adam_state()
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    assert schedule_trial_error(step_lr, step_lr.state_dict(), "s") is None
    error = schedule_trial_error(lambda_lr, step_lr.state_dict(), "s")
    assert "s is not a LambdaLR's state" in str(error)
    assert "s is not a StepLR's state" in str(schedule_trial_error(step_lr, lambda_lr.state_dict(), "s"))
    broken = {**lambda_lr.state_dict(), "lr_lambdas": "no list"}
    assert "does not load into LambdaLR" in str(schedule_trial_error(lambda_lr, broken, "s"))
    assert opt.param_groups[0]["lr"] == lambda_lr.get_last_lr()[0]


def test_schedule_trial_leaves_the_optimizer_groups_alone():
    """OuterMomentumWarmup sets its optimizer's momentum on load: the trial does so on a stand-in."""
    from hvd_averaging.outer_schedules import OuterMomentumWarmup
    outer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.7, momentum=0.9)
    warmup = OuterMomentumWarmup(outer, 8)
    momentum = outer.param_groups[0]["momentum"]
    saved = {**warmup.state_dict(), "outer_steps_taken": 4}
    assert schedule_trial_error(warmup, saved, "s") is None
    assert outer.param_groups[0]["momentum"] == momentum and warmup.outer_steps_taken == 0


def test_tensor_lists_must_match_and_be_finite():
    own = [torch.zeros(2, 3), torch.zeros(4)]
    assert tensors_error("g", [torch.ones(2, 3), torch.ones(4)], own) is None
    assert "has 1 tensors" in str(tensors_error("g", [torch.ones(2, 3)], own))
    assert "must be a list of tensors" in str(tensors_error("g", "x", own))
    assert "NaN/Inf" in str(tensors_error("g", [torch.ones(2, 3), torch.full((4,), float("nan"))], own))
    assert non_finite_error("x", {"a": torch.ones(1), "b": 3}) is None
