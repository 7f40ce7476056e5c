"""What DiLoCo's outer step runs: the outer optimizers of DiLoCo and SlowMo, and the checked
making of an outer optimizer and its schedule from the factories a user passes."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from .averagers import ModelAverager, PeriodicModelAverager
from .hierarchical import HierarchicalModelAverager

__all__ = ["default_outer_optimizer", "slowmo_outer_optimizer", "outer_optimizer_and_schedule"]


def default_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def slowmo_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """SlowMo's outer optimizer: ``SGD(lr=1.0, momentum=0.5)``."""
    return torch.optim.SGD(params, lr=1.0, momentum=0.5)


def outer_optimizer_and_schedule(averager: ModelAverager, make_outer: Optional[Callable],
                make_scheduler: Optional[Callable], global_parameters: list) -> tuple:
    """The outer optimizer over ``global_parameters`` and its schedule (or None), checked.

    Raises:
        TypeError: an argument, or what a factory returned, is of the wrong kind.
        ValueError: raised by a factory (e.g. :class:`OuterMomentumWarmup`'s rules).
    """
    if not isinstance(averager, (PeriodicModelAverager, HierarchicalModelAverager)):
        raise TypeError("DiLoCo needs a PeriodicModelAverager or a HierarchicalModelAverager "
                        f"(its top level gets the outer step), got {type(averager).__name__}")
    make_outer = make_outer if make_outer is not None else default_outer_optimizer
    if not callable(make_outer):
        raise TypeError("outer_optimizer must be a callable params -> torch.optim.Optimizer, "
                        f"got {type(make_outer).__name__}")
    if make_scheduler is not None and not callable(make_scheduler):
        raise TypeError("outer_scheduler must be a callable outer optimizer -> schedule, got "
                        f"{type(make_scheduler).__name__}")
    outer = make_outer(global_parameters)
    if not isinstance(outer, torch.optim.Optimizer):
        raise TypeError(f"outer_optimizer(params) must return a torch.optim.Optimizer, got "
                        f"{type(outer).__name__}")
    if make_scheduler is None:
        return outer, None
    scheduler = make_scheduler(outer)
    lacking = [name for name in ("step", "state_dict", "load_state_dict")
               if not callable(getattr(scheduler, name, None))]
    if lacking:
        raise TypeError(f"outer_scheduler(outer optimizer) must return a schedule with step(), "
                        f"state_dict() and load_state_dict() (as torch.optim.lr_scheduler's), got "
                        f"{type(scheduler).__name__} without {', '.join(lacking)}")
    return outer, scheduler
