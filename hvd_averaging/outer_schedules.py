"""Schedules for the outer optimizer, stepped once per outer step by :class:`~hvd_averaging.DiLoCo`.

An outer optimizer sees one pseudo-gradient per top-level round, so a run has tens to thousands
of outer steps, and their first few come from a model far from any optimum. `Pier
<https://arxiv.org/abs/2511.17849>`_ warms the outer momentum up over the first outer steps
instead of applying the full momentum to the first, largest pseudo-gradients; with a delayed
(overlapped) outer step, whose pseudo-gradients are a round stale, a smaller early momentum is
also the more stable setting (CGAD, arXiv:2605.09126). :class:`OuterMomentumWarmup` is that
warm-up, with the interface of PyTorch's LR schedulers (``step``, ``state_dict``,
``load_state_dict``), so that any of those (e.g. ``LambdaLR`` on the outer learning rate) can be
given to DiLoCo's ``outer_scheduler=`` in its place.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

__all__ = ["OuterMomentumWarmup", "warmed_up_momentum"]


def warmed_up_momentum(target: float, start: float, outer_steps: int, taken: int) -> float:
    """The momentum of the outer step after ``taken`` earlier ones: ``start`` for the first,
    rising linearly to ``target``, which the step after ``outer_steps`` earlier ones and every
    later step use."""
    fraction = min(1.0, taken / outer_steps)
    return start + fraction * (target - start)


class OuterMomentumWarmup:
    r"""Linear warm-up of the outer optimizer's momentum over its first ``outer_steps`` steps.

    The outer step after ``k`` earlier ones uses momentum
    ``start + min(1, k / outer_steps) * (target - start)``, where ``target`` is each parameter
    group's momentum when the schedule is made (SGD's and RMSprop's ``momentum``, Adam's
    ``betas[0]``); it is kept in the group as ``"initial_momentum"``, as PyTorch's LR schedulers
    keep ``"initial_lr"``. PyTorch's SGD keeps no momentum buffer while its momentum is 0, so
    with ``start=0`` the buffer starts at the second outer step.

    Args:
        optimizer: the outer optimizer (DiLoCo passes its own).
        outer_steps: outer steps over which the momentum rises (``>= 1``).
        start: the first outer step's momentum, in ``[0, target]`` for every group.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: ``outer_steps`` or ``start`` breaks its rule, or a group has no momentum.

    Example::

        >>> opt = hva.DiLoCo(inner, averager,
        ...                  outer_scheduler=lambda outer: hva.OuterMomentumWarmup(outer, 8))
    """

    def __init__(self, optimizer: torch.optim.Optimizer, outer_steps: int, start: float = 0.0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OuterMomentumWarmup needs a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(outer_steps, bool) or not isinstance(outer_steps, int) or outer_steps < 1:
            raise ValueError(f"outer_steps={outer_steps!r}: must be an integer >= 1")
        if isinstance(start, bool) or not isinstance(start, numbers.Real) or not 0 <= start < 1:
            raise ValueError(f"start={start!r}: must be a number in [0, 1)")
        for index, group in enumerate(optimizer.param_groups):
            target = group.get("initial_momentum", _momentum_of(group, optimizer, index))
            if start > target:
                raise ValueError(f"start={start!r}: must not exceed parameter group #{index}'s "
                                 f"momentum {target!r} (the warm-up rises to it)")
        for index, group in enumerate(optimizer.param_groups):
            group.setdefault("initial_momentum", _momentum_of(group, optimizer, index))
        self.optimizer = optimizer
        self.outer_steps = outer_steps
        self.start = float(start)
        self.outer_steps_taken = 0
        self._apply()

    def step(self) -> None:
        """After an outer step: set the next one's momentum."""
        self.outer_steps_taken += 1
        self._apply()

    def state_dict(self) -> dict:
        """``{"outer_steps_taken", "outer_steps", "start"}``: plain numbers."""
        return {"outer_steps_taken": self.outer_steps_taken, "outer_steps": self.outer_steps,
                "start": self.start}

    def state_error(self, state: dict) -> Optional[ValueError]:
        """What :meth:`load_state_dict` would reject in ``state``, or None (checked on every rank
        before any rank applies a checkpoint)."""
        if not isinstance(state, dict) or not {"outer_steps_taken", "outer_steps", "start"} <= set(state):
            return ValueError("an OuterMomentumWarmup state needs 'outer_steps_taken', "
                              f"'outer_steps' and 'start', got {state!r}")
        taken = state["outer_steps_taken"]
        if isinstance(taken, bool) or not isinstance(taken, int) or taken < 0:
            return ValueError(f"outer_steps_taken={taken!r}: must be an integer >= 0")
        if (state["outer_steps"], state["start"]) != (self.outer_steps, self.start):
            return ValueError(f"the checkpoint's warm-up (outer_steps={state['outer_steps']!r}, "
                              f"start={state['start']!r}) is not this one's "
                              f"(outer_steps={self.outer_steps}, start={self.start})")
        return None

    def load_state_dict(self, state: dict) -> None:
        """Resume the warm-up where ``state`` left it (``ValueError`` as :meth:`state_error`)."""
        error = self.state_error(state)
        if error is not None:
            raise error
        self.outer_steps_taken = state["outer_steps_taken"]
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            momentum = warmed_up_momentum(group["initial_momentum"], self.start, self.outer_steps,
                                          self.outer_steps_taken)
            if "betas" in group:
                group["betas"] = (momentum, group["betas"][1])
            else:
                group["momentum"] = momentum


def _momentum_of(group: dict, optimizer: torch.optim.Optimizer, index: int) -> float:
    if "betas" in group:
        return float(group["betas"][0])
    if "momentum" in group:
        return float(group["momentum"])
    raise ValueError(f"{type(optimizer).__name__}'s parameter group #{index} has no 'momentum' "
                     "or 'betas': there is no momentum to warm up")
