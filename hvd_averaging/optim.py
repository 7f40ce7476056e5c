"""Training integration: an optimizer that averages after each step, and post-local SGD.

``PostLocalSGDOptimizer`` is PyTorch's wrapper of the same name: inner ``step()`` then one
``averager.average_parameters``. ``PostLocalSGD`` adds the gradient path that DDP's
``post_localSGD_hook`` gives PyTorch users, done Horovod's way (there are no comm hooks): during
warm-up gradients are averaged over the whole process set every step, as
``hvd.DistributedOptimizer`` does; from ``start_localSGD_iter`` on only inside the node-local
group (or not at all), while the averager averages parameters on its schedule.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Iterable, Optional

import horovod.torch as hvd
import horovod.torch.functions as hvd_functions
import torch

from .agreement import check_same_on_all_ranks
from .averagers import ModelAverager, PeriodicModelAverager
from .checkpoint import optimizer_state_error, split_wrapper_state
from .process_sets import local_process_set
from .rounds import average_tensors
from .schedule import check_int

# How far up the stack Horovod's broadcast_optimizer_state may be when it calls step() (the
# wrapper's own step, an LR scheduler's step counter and a subclass's step lie in between).
_STATE_INIT_FRAMES = 6


def called_to_initialize_state() -> bool:
    """True when ``hvd.broadcast_optimizer_state`` is the caller: on a fresh optimizer it sets zero
    gradients and calls ``step()`` once to create the state. That call is no training step: the
    wrapper runs the inner step only (the state is created as Horovod expects), and neither
    averages nor counts it. Decided from the call stack, so every rank decides alike."""
    frame = sys._getframe(1)
    target = hvd_functions.broadcast_optimizer_state.__code__
    for _ in range(_STATE_INIT_FRAMES):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code is target:
            return True
    return False

__all__ = ["PostLocalSGDOptimizer", "PostLocalSGD"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    r"""Wraps any optimizer: ``step()`` runs the inner step, then averages on the schedule.

    Args:
        optim: the local optimizer (e.g. ``torch.optim.SGD``).
        averager: a :class:`~hvd_averaging.ModelAverager`; its ``average_parameters`` runs exactly
            once per ``step()`` on ``param_groups``.
        buffers: optional ``model.buffers()`` (a list is kept); floating-point buffers such as
            BatchNorm running statistics are averaged at the same moments as the parameters.
            Off by default, as in PyTorch.
        grad_scaler: optional ``torch.amp.GradScaler``. Call ``step()`` instead of
            ``scaler.step(optimizer)``: the inner step goes through the scaler (skipped on
            inf/NaN gradients, as usual), but the averager advances and averages on every call
            all the same. A skipped step therefore never shifts the schedule (PyTorch's wrapper,
            driven by ``scaler.step``, loses that step's averaging and lets ranks that skipped
            drift out of step with those that did not). Call ``scaler.update()`` afterwards.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> local = torch.optim.SGD(model.parameters(), lr=0.01)
        >>> opt = hva.PostLocalSGDOptimizer(local, hva.PeriodicModelAverager(4, 100))
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()  # local step, then averages every 4 steps from step 100 on
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager, *,
                 buffers: Optional[Iterable[torch.Tensor]] = None,
                 grad_scaler: Optional[Any] = None):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        if not isinstance(averager, ModelAverager):
            raise TypeError(f"averager must be a hvd_averaging.ModelAverager, got {type(averager).__name__}")
        # No super().__init__: state and param_groups are the inner optimizer's own objects.
        self.optim = optim
        self.averager = averager
        self.buffers = list(buffers) if buffers is not None else None
        self.grad_scaler = grad_scaler
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r}, averager={type(self.averager).__name__})"

    def _inner_step(self, closure=None):
        if self.grad_scaler is not None:
            return self.grad_scaler.step(self.optim) if closure is None else \
                self.grad_scaler.step(self.optim, closure)
        return self.optim.step(closure) if closure is not None else self.optim.step()

    def step(self, closure=None):
        """Inner optimizer step, then exactly one ``averager.average_parameters`` (not when
        ``hvd.broadcast_optimizer_state`` calls it to create the state: then the inner step only)."""
        loss = self._inner_step(closure)
        if not called_to_initialize_state():
            self.averager.average_parameters(self.param_groups, buffers=self.buffers)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict:
        """PyTorch's form: the inner optimizer's state with the averager's step at the top level
        (``"step"``), plus ``"averager"``: its config and any round in flight (everything to
        resume exactly)."""
        state = self.optim.state_dict()
        averager = self.averager.state_dict()
        state["step"] = averager.pop("step")
        state["averager"] = averager
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the inner optimizer and the averager (collective: every rank calls it).

        Every rank first checks what it loads (the inner optimizer's groups and NaN/Inf, the
        averager's step and rounds in flight), the ranks agree, and only then is anything
        applied: a bad file on one rank raises on every rank, naming that rank and the cause,
        and leaves every rank's state as it was. Checkpoints of this project's older forms load
        (:mod:`hvd_averaging.checkpoint`); one without any step (a plain optimizer's) warns and
        resets the averager's step to 0, as PyTorch's wrapper does.

        Raises:
            ValueError: this rank's state does not fit (named).
            RuntimeError: another rank's does not (naming it and why), or ranks loaded different
                steps.
        """
        error, parts = None, None
        try:
            parts = split_wrapper_state(state_dict)
            error = optimizer_state_error(self.optim, parts.inner) \
                or self.averager.check_state_dict(parts.averager) or self._check_own_state(state_dict)
        except ValueError as bad:
            error = bad
        agreed = None if error is not None else (parts.averager["step"], self._own_state_digest(state_dict))
        check_same_on_all_ranks(f"{type(self).__name__}.load_state_dict (step, {self._own_state_name})",
                                agreed, local_error=error, name="hva.agree.optimizer_load")
        if parts.step_missing:
            warnings.warn("loaded optimizer state has no averager step: the averager's step is reset "
                          "to 0, so the averaging schedule restarts", UserWarning, stacklevel=2)
        self.averager.apply_state_dict(parts.averager)
        self.optim.load_state_dict(parts.inner)
        self._apply_own_state(state_dict)

    # What a subclass keeps beside the inner optimizer and the averager (DiLoCo: its global copy).
    _own_state_name = "nothing else"

    def _check_own_state(self, state_dict: dict) -> Optional[ValueError]:
        return None

    def _own_state_digest(self, state_dict: dict) -> Optional[int]:
        return None

    def _apply_own_state(self, state_dict: dict) -> None:
        pass


class PostLocalSGD(PostLocalSGDOptimizer):
    r"""Post-local SGD (`Lin et al. <https://arxiv.org/abs/1808.07217>`_) in one wrapper.

    Every ``step()``:

    1. averages the gradients: over the averager's whole process set while
       ``iteration < start_localSGD_iter`` (synchronous SGD warm-up); afterwards only inside the
       node-local group, or not at all when ``post_local_gradient_allreduce=False``;
    2. runs the inner optimizer step;
    3. calls ``averager.average_parameters`` (its warm-up should be ``start_localSGD_iter``:
       before that the models are identical anyway).

    The switch happens at exactly ``start_localSGD_iter`` without rebuilding anything: the
    process sets are created once, at construction (collective on every rank).

    Args:
        optimizer: the local optimizer.
        named_parameters: ``model.named_parameters()``, the parameters whose gradients travel.
        start_localSGD_iter (int): first iteration of the local phase, >= 0.
        averager: default ``PeriodicModelAverager(period=4, warmup_steps=start_localSGD_iter)``.
        post_local_gradient_allreduce (bool): average gradients inside the node-local group in
            the local phase (PyTorch's default); False makes the local phase purely local.
        local_group_size: size of the node-local gradient group; default: ranks per node (from
            the MPI shared-memory split, or Horovod's host information under Gloo).
        buffers, grad_scaler: as in :class:`PostLocalSGDOptimizer`.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> opt = hva.PostLocalSGD(opt, model.named_parameters(), start_localSGD_iter=100,
        ...                        averager=hva.PeriodicModelAverager(8, warmup_steps=100))
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters,
                 start_localSGD_iter: int, averager: Optional[ModelAverager] = None, *,
                 post_local_gradient_allreduce: bool = True,
                 local_group_size: Optional[int] = None,
                 buffers: Optional[Iterable[torch.Tensor]] = None,
                 grad_scaler: Optional[Any] = None):
        error = None
        try:
            check_int("start_localSGD_iter", start_localSGD_iter, 0)
            if local_group_size is not None:
                check_int("local_group_size", local_group_size, 1)
            if not isinstance(post_local_gradient_allreduce, bool):
                raise ValueError("post_local_gradient_allreduce must be True or False, got "
                                 f"{post_local_gradient_allreduce!r}")
        except ValueError as bad:
            error = bad
        # Ranks that disagree would average gradients in different sets from different steps on.
        check_same_on_all_ranks("PostLocalSGD arguments", (start_localSGD_iter, post_local_gradient_allreduce,
                                local_group_size), local_error=error, name="hva.agree.PostLocalSGD")
        if averager is None:
            averager = PeriodicModelAverager(period=4, warmup_steps=start_localSGD_iter)
        super().__init__(optimizer, averager, buffers=buffers, grad_scaler=grad_scaler)
        named = list(named_parameters)
        for entry in named:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
                raise TypeError(f"named_parameters must yield (name, parameter) pairs, got {entry!r:.80}")
        self._gradient_params = [p for _, p in named]
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        warmup = getattr(averager, "warmup_steps", None)
        if warmup is not None and warmup < start_localSGD_iter:
            warnings.warn(
                f"averager warmup_steps={warmup} < start_localSGD_iter={start_localSGD_iter}: "
                "parameters get averaged while gradients are still averaged every step",
                UserWarning, stacklevel=2)
        self.global_set = averager.process_set
        self.local_set = local_process_set(self.global_set, local_group_size) \
            if self.post_local_gradient_allreduce else None

    @property
    def iteration(self) -> int:
        """The number of ``step()`` calls so far: the averager's step (stored once)."""
        return self.averager.step

    def gradient_process_set(self, iteration: Optional[int] = None) -> Optional[hvd.ProcessSet]:
        """The set that averages gradients at ``iteration`` (default: the next one), or None."""
        iteration = self.iteration if iteration is None else iteration
        if iteration < self.start_localSGD_iter:
            return self.global_set
        return self.local_set

    def _average_gradients(self) -> None:
        process_set = self.gradient_process_set()
        if process_set is None:
            return
        grads = [p.grad for p in self._gradient_params if p.grad is not None]
        average_tensors(grads, process_set, name="grads", bind=False,
                        context=f"PostLocalSGD gradient allreduce at iteration {self.iteration}")

    def step(self, closure=None):
        """Average gradients (global in warm-up, local after), inner step, then average params."""
        if closure is not None:
            raise ValueError("PostLocalSGD.step does not take a closure: gradients must be averaged "
                             "between backward and the optimizer step")
        if called_to_initialize_state():  # hvd.broadcast_optimizer_state: no training step
            return self._inner_step()
        self._average_gradients()
        return super().step()
