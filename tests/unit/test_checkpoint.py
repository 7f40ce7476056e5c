"""hvd_averaging.checkpoint: every checkpoint form splits to the same parts, and every check
finds what it must before anything is applied (pure logic, one process)."""
import pytest
import torch

from hvd_averaging.checkpoint import (averager_state_error, non_finite_error,
                                      optimizer_state_error, split_wrapper_state, step_error,
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
    assert "NaN/Inf" in str(averager_state_error({"step": 9, "wire": {4: residual}}, delays, {4}))
    # saved with error feedback, loaded without: not this averager's state to check
    assert averager_state_error({"step": 9, "wire": {4: residual}}, delays, set()) is None


def test_tensor_lists_must_match_and_be_finite():
    own = [torch.zeros(2, 3), torch.zeros(4)]
    assert tensors_error("g", [torch.ones(2, 3), torch.ones(4)], own) is None
    assert "has 1 tensors" in str(tensors_error("g", [torch.ones(2, 3)], own))
    assert "must be a list of tensors" in str(tensors_error("g", "x", own))
    assert "NaN/Inf" in str(tensors_error("g", [torch.ones(2, 3), torch.full((4,), float("nan"))], own))
    assert non_finite_error("x", {"a": torch.ones(1), "b": 3}) is None
