"""Steps that only create an optimizer's state: Horovod's ``broadcast_optimizer_state`` and
PyTorch DCP's state initialisation call ``step()`` on zero gradients for that, and the wrappers
must neither average nor count such a step (nor pass it through a ``GradScaler``).
"""

from __future__ import annotations

import sys
from typing import Callable

import horovod.torch.functions as hvd_functions
import torch

__all__ = ["called_to_initialize_state", "zero_gradient_state_step"]


def _state_creators() -> list:
    """The code of the functions known to call ``step()`` only to create an optimizer's state:
    Horovod's ``broadcast_optimizer_state`` and, once loaded, PyTorch DCP's ``_init_optim_state``
    (not imported here: it costs seconds, and a job that never loaded it never calls it)."""
    found = [hvd_functions.broadcast_optimizer_state.__code__]
    dcp = sys.modules.get("torch.distributed.checkpoint.state_dict")
    creator = getattr(dcp, "_init_optim_state", None)
    if creator is not None:
        found.append(creator.__code__)
    return found


def called_to_initialize_state() -> bool:
    """True when Horovod's ``broadcast_optimizer_state`` (or DCP's state initialisation) is on
    the call stack, at any depth: on a fresh optimizer it sets zero gradients and calls
    ``step()`` once to create the state. That call is no training step. Decided from the
    function's code object, so every rank decides alike; a copy of the function is a different
    function and is not recognized: wrap it in :meth:`PostLocalSGDOptimizer.state_initialization`
    or call :meth:`PostLocalSGDOptimizer.initialize_state` first."""
    targets = _state_creators()
    frame = sys._getframe(1)
    while frame is not None:
        if any(frame.f_code is target for target in targets):
            return True
        frame = frame.f_back
    return False


def zero_gradient_state_step(optimizer: torch.optim.Optimizer, step: Callable[[], object]) -> None:
    """Create ``optimizer``'s state as Horovod and DCP do, by ``step()`` on zero gradients, with
    every group's learning rate 0 for that step so that no parameter moves (weight decay
    included); the learning rates are put back and the gradients cleared (``None``) after.

    Raises:
        ValueError: a parameter already has a gradient (call it before ``backward()``).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    if with_grad:
        raise ValueError(f"initialize_state(): parameter(s) #{with_grad[:4]} already have "
                         "gradients; call it before the first backward()")
    for param in params:
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    saved_lrs = [(group["lr"],) if "lr" in group else () for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) \
                    if isinstance(group["lr"], torch.Tensor) else 0.0
        step()
    finally:
        for group, saved in zip(optimizer.param_groups, saved_lrs):
            if saved:
                group["lr"] = saved[0]
        optimizer.zero_grad(set_to_none=True)
