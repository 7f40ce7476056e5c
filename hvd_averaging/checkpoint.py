"""Checkpoint forms and their checks: what a state dict must hold before any state changes.

Loading is collective and must leave nothing half loaded: each rank first checks what it read
(the functions here are local and change nothing), the ranks agree on the outcome, and only
then is anything applied. Pure logic, no collectives.

The wrappers' form is PyTorch's ``PostLocalSGDOptimizer`` one: the inner optimizer's state dict
with the averager's step at the top level (``sd["step"]``). Older forms of this project still
load: the step inside ``sd["averager"]`` (2026-12-03 to 2026-12-04), and the top-level step with
PostLocalSGD's ``"iteration"`` beside it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["WrapperState", "split_wrapper_state", "non_finite_error", "step_error",
           "optimizer_state_error", "optimizer_trial_error", "schedule_trial_error",
           "averager_state_error", "tensors_error"]

# Adafactor's factored second moments: per-parameter state that is not shaped like the parameter.
_NOT_PARAMETER_SHAPED = frozenset({"row_var", "col_var"})


class WrapperState(NamedTuple):
    """A wrapper's state dict taken apart."""

    inner: dict  # the inner optimizer's state dict
    averager: dict  # the averager's state (its step included)
    step_missing: bool  # no step anywhere (a plain optimizer's checkpoint): restart at 0


def split_wrapper_state(state_dict: Mapping) -> WrapperState:
    """The inner optimizer's part and the averager's part of a wrapper's ``state_dict``, in any
    form this project or PyTorch wrote (see the module's docstring).

    Raises:
        ValueError: ``state_dict`` is not a dict, or its ``"averager"`` entry is not one.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"an optimizer state_dict must be a dict, got {type(state_dict).__name__}")
    inner = dict(state_dict)
    top_step = inner.pop("step", None)
    inner.pop("iteration", None)  # PostLocalSGD's copy of the step in older checkpoints
    averager = inner.pop("averager", None) or {}
    if not isinstance(averager, Mapping):
        raise ValueError(f"state_dict['averager'] must be a dict, got {type(averager).__name__}")
    averager = dict(averager)
    missing = top_step is None and "step" not in averager
    if top_step is not None:
        averager["step"] = top_step
    elif missing:
        averager["step"] = 0
    return WrapperState(inner, averager, missing)


def non_finite_error(where: str, tensors) -> Optional[ValueError]:
    """A ``ValueError`` naming the first floating-point tensor of ``tensors`` (a list or dict)
    that holds NaN/Inf, or None."""
    items = tensors.items() if isinstance(tensors, Mapping) else enumerate(tensors)
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_floating_point() \
                and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            return ValueError(f"{where}[{key!r}] (shape {tuple(value.shape)}) holds {bad} NaN/Inf "
                              "value(s): the checkpoint is damaged or was saved after a diverged step")
    return None


def step_error(step: Any) -> Optional[ValueError]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return ValueError(f"state_dict['step'] must be an integer >= 0, got {step!r}")
    return None


def optimizer_state_error(optimizer: torch.optim.Optimizer, state: Mapping,
                          where: str = "the optimizer state") -> Optional[ValueError]:
    """What ``optimizer.load_state_dict(state)`` would reject (group and parameter counts), or a
    NaN/Inf in its tensors; None when it fits."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), Mapping):
        return ValueError(f"{where} needs 'state' and 'param_groups' (an optimizer's state_dict())")
    own = optimizer.param_groups
    if len(groups) != len(own):
        return ValueError(f"{where} has {len(groups)} parameter group(s), the optimizer has "
                          f"{len(own)}")
    for index, (saved, group) in enumerate(zip(groups, own)):
        count = len(saved.get("params", ())) if isinstance(saved, Mapping) else -1
        if count != len(group["params"]):
            return ValueError(f"{where}: parameter group #{index} has {count} parameters, the "
                              f"optimizer's has {len(group['params'])}")
    params = [p for group in own for p in group["params"]]
    for key, per_param in state["state"].items():
        if isinstance(per_param, Mapping):
            error = non_finite_error(f"{where}['state'][{key!r}]", per_param) \
                or _state_shape_error(f"{where}['state'][{key!r}]", per_param,
                                      params[key] if isinstance(key, int) and 0 <= key < len(params) else None,
                                      optimizer)
            if error is not None:
                return error
    return None


def _state_shape_error(where: str, per_param: Mapping, param: Optional[torch.Tensor],
                       optimizer: torch.optim.Optimizer) -> Optional[ValueError]:
    """A state tensor that is not shaped like what it belongs to: the shape the optimizer's own
    state has under that name, else (a fresh optimizer) the parameter's shape for every tensor
    that is not a scalar (PyTorch's load takes any shape and fails at the next step, or not at all
    and broadcasts wrongly)."""
    if param is None:
        return None
    own = optimizer.state.get(param, {})
    for name, value in per_param.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        held = own.get(name)
        expected = tuple(held.shape) if isinstance(held, torch.Tensor) else \
            (None if name in _NOT_PARAMETER_SHAPED else tuple(param.shape))
        if expected is not None and tuple(value.shape) != expected:
            return ValueError(f"{where}[{name!r}] has shape {tuple(value.shape)}, the parameter's "
                              f"state needs {expected}: the checkpoint is of another model")
    return None


def optimizer_trial_error(optimizer: torch.optim.Optimizer, state: Mapping,
                          where: str = "the optimizer state") -> Optional[ValueError]:
    """What ``optimizer.load_state_dict(state)`` raises, found by loading ``state`` into a
    shallow copy of ``optimizer`` (the same parameters, a state and groups of its own): local,
    ``optimizer`` itself unchanged. Memory: one more copy of the loaded state, until return."""
    trial = copy.copy(optimizer)
    trial.state = type(optimizer.state)() if isinstance(optimizer.state, dict) else {}
    trial.param_groups = [dict(group) for group in optimizer.param_groups]
    try:
        trial.load_state_dict(state)
    except Exception as bad:  # noqa: BLE001  (any failure of the real load is this rank's error)
        return ValueError(f"{where} does not load into {type(optimizer).__name__}: "
                          f"{type(bad).__name__}: {bad}")
    return None


def schedule_trial_error(schedule: Any, state: Any, where: str) -> Optional[ValueError]:
    """What ``schedule.load_state_dict(state)`` would raise, or a state of another kind of
    schedule (its keys are not the schedule's own), found on a copy whose optimizer is a stand-in
    with groups of its own (the parameters shared): local, ``schedule`` and its optimizer
    unchanged."""
    own = schedule.state_dict()
    if isinstance(own, Mapping) and (not isinstance(state, Mapping) or set(state) != set(own)):
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        return ValueError(f"{where} is not a {type(schedule).__name__}'s state: it holds {got}, "
                          f"a {type(schedule).__name__} saves {sorted(own)}")
    optimizer = getattr(schedule, "optimizer", None)
    memo = {}
    if isinstance(optimizer, torch.optim.Optimizer):  # a schedule may set its groups on load
        stand_in = copy.copy(optimizer)
        stand_in.param_groups = [dict(group) for group in optimizer.param_groups]
        memo[id(optimizer)] = stand_in
    try:
        trial = copy.deepcopy(schedule, memo)
        trial.load_state_dict(copy.deepcopy(state))
    except Exception as bad:  # noqa: BLE001
        return ValueError(f"{where} does not load into {type(schedule).__name__}: "
                          f"{type(bad).__name__}: {bad}")
    return None


def _section(state: Mapping, key: str) -> tuple[Mapping, Optional[ValueError]]:
    """``state[key]`` (empty if absent), or the error when it is not a dict."""
    found = state.get(key) or {}
    if not isinstance(found, Mapping):
        return {}, ValueError(f"state_dict[{key!r}] must be a dict, got {type(found).__name__}")
    return found, None


def averager_state_error(state: Mapping, delays: Mapping[int, int],
                         levels_with_state: Mapping) -> Optional[ValueError]:
    """What an averager's :meth:`load_state_dict` would reject: the step, a round in flight that
    does not fit ``delays`` at that step, NaN/Inf in its snapshot, a wire residual that is not a
    finite floating-point tensor or not shaped like the one the level keeps under that name
    (``levels_with_state``: ``{level: {name: shape}}`` of the levels that keep residuals)."""
    if not isinstance(state, Mapping):
        return ValueError(f"an averager state must be a dict, got {type(state).__name__}")
    return (step_error(state.get("step")) or _in_flight_error(state, delays)
            or _wire_error(state, levels_with_state))


def _in_flight_error(state: Mapping, delays: Mapping[int, int]) -> Optional[ValueError]:
    in_flight, error = _section(state, "in_flight")
    step = state["step"]
    for level, saved in in_flight.items():
        if error is not None:
            break
        delay = delays.get(level, 0)
        fired_at = saved.get("fired_at") if isinstance(saved, Mapping) else None
        if not delay or not isinstance(fired_at, int) or not fired_at < step <= fired_at + delay:
            return ValueError(
                f"state_dict['in_flight'][{level!r}] (fired at {fired_at!r}) does not fit this "
                f"averager at step {step} (delays per level {dict(delays)})")
        error = non_finite_error(f"state_dict['in_flight'][{level!r}]['snapshots']",
                                 list(saved.get("snapshots") or []))
    return error


def _wire_error(state: Mapping, levels_with_state: set) -> Optional[ValueError]:
    wire, error = _section(state, "wire")
    for level, kept in wire.items():
        if error is not None:
            break
        residuals = kept.get("residuals", {}) if isinstance(kept, Mapping) else None
        if not isinstance(residuals, Mapping):
            return ValueError(f"state_dict['wire'][{level!r}] must be a dict of residuals")
        if level in levels_with_state:  # else: saved with error feedback, loaded without
            error = _residuals_error(f"state_dict['wire'][{level!r}]['residuals']", residuals,
                                     levels_with_state[level])
    return error


def _residuals_error(where: str, residuals: Mapping, kept: Mapping) -> Optional[ValueError]:
    for name, value in residuals.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return ValueError(f"{where}[{name!r}] must be a floating-point tensor, got "
                              f"{type(value).__name__}")
        shape = kept.get(name)
        if shape is not None and tuple(value.shape) != tuple(shape):
            return ValueError(f"{where}[{name!r}] has shape {tuple(value.shape)}, this level keeps "
                              f"{tuple(shape)} there: the checkpoint is of another model")
    return non_finite_error(where, residuals)


def tensors_error(where: str, saved: Any, own: list[torch.Tensor]) -> Optional[ValueError]:
    """``saved`` must be a list of finite tensors shaped like ``own``."""
    if not isinstance(saved, (list, tuple)) or not all(isinstance(s, torch.Tensor) for s in saved):
        return ValueError(f"{where} must be a list of tensors, got {type(saved).__name__}")
    if len(saved) != len(own) or any(tuple(s.shape) != tuple(o.shape) for s, o in zip(saved, own)):
        return ValueError(f"{where} has {len(saved)} tensors of shapes "
                          f"{[tuple(s.shape) for s in saved][:4]}..., the model has {len(own)} of "
                          f"shapes {[tuple(o.shape) for o in own][:4]}...")
    return non_finite_error(where, list(saved))

