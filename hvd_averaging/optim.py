"""Training integration: an optimizer that averages after each step.

``PostLocalSGDOptimizer`` is PyTorch's wrapper of the same name: inner ``step()`` then one
``averager.average_parameters``; :mod:`~hvd_averaging.post_local` and
:mod:`~hvd_averaging.outer` build on it. A ``step()`` that only creates the inner optimizer's
state (:mod:`~hvd_averaging.state_creation`) is no training step.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch

from .agreement import check_same_on_all_ranks
from .averagers import ModelAverager
from .checkpoint import optimizer_state_error, optimizer_trial_error, split_wrapper_state
from .state_creation import called_to_initialize_state, zero_gradient_state_step

__all__ = ["PostLocalSGDOptimizer"]


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
        self._state_initializations = 0  # > 0 inside state_initialization()

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

    def _creating_state(self) -> bool:
        """This ``step()`` only creates the inner optimizer's state (see :meth:`initialize_state`)."""
        return self._state_initializations > 0 or called_to_initialize_state()

    def _state_creation_step(self, closure=None):
        """The inner optimizer's own step alone: not through the scaler (a fresh scaler has no
        scale yet and Horovod's zero gradients are no scaled loss), nothing averaged or counted."""
        return self.optim.step(closure) if closure is not None else self.optim.step()

    @contextlib.contextmanager
    def state_initialization(self) -> Iterator[None]:
        """Every ``step()`` inside is state creation, not training: the inner optimizer's step
        alone (no scaler, no gradient or parameter averaging, the averager's step not counted).
        For recipes that create the state with a ``step()`` on zero gradients and that this
        wrapper cannot recognize: a copy of Horovod's ``broadcast_optimizer_state`` (0.28.1's
        has no ``process_set=``), PyTorch DCP's ``set_optimizer_state_dict``. Every rank must
        enter it alike (it changes what ``step()`` does)::

            with opt.state_initialization():
                my_broadcast_optimizer_state(opt, root_rank=0, process_set=ps)
        """
        self._state_initializations += 1
        try:
            yield
        finally:
            self._state_initializations -= 1

    def initialize_state(self) -> None:
        """Create the inner optimizer's state now, as ``hvd.broadcast_optimizer_state`` and
        PyTorch DCP do (zero gradients, one inner step), but with every group's learning rate 0
        for that step so that no parameter moves (weight decay included), without the scaler,
        and neither averaged nor counted. Local: no collective. Afterwards a stateful optimizer
        (momentum, Adam) has its state and the recipes above find it and take no step; a
        stateless one (SGD without momentum) keeps none, so wrap such recipes in
        :meth:`state_initialization`. Gradients are cleared (``None``) afterwards.

        Raises:
            ValueError: a parameter already has a gradient (this is no training step: call it
                before ``backward()``) and the state is empty.
        """
        if not self.optim.state:
            with self.state_initialization():
                zero_gradient_state_step(self.optim, self.step)

    def step(self, closure=None):
        """Inner optimizer step, then exactly one ``averager.average_parameters`` (not when the
        step only creates the state, :meth:`initialize_state`: then the inner step only)."""
        if self._creating_state():
            return self._state_creation_step(closure)
        loss = self._inner_step(closure)
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

        Every rank first checks what it loads (the inner optimizer's groups, state shapes and
        NaN/Inf, the averager's step, rounds in flight and residuals) and loads it into copies
        (the inner optimizer; DiLoCo's outer optimizer and schedule), so that what their own
        ``load_state_dict`` would raise is found before anything changes; the ranks agree, and
        only then is anything applied: a bad file on one rank raises on every rank, naming that rank and the cause,
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
            # Checks first, then trial loads into copies (what PyTorch's own load would raise),
            # all before the agreement: after it, applying cannot fail on one rank alone.
            error = optimizer_state_error(self.optim, parts.inner) \
                or self.averager.check_state_dict(parts.averager) or self._check_own_state(state_dict) \
                or optimizer_trial_error(self.optim, parts.inner) or self._trial_own_state(state_dict)
            agreed = None if error is not None else \
                (parts.averager["step"], self._own_state_digest(state_dict))
        except ValueError as bad:
            error, agreed = bad, None
        check_same_on_all_ranks(f"{type(self).__name__}.load_state_dict (step, {self._own_state_name})",
                                agreed, local_error=error, name="hva.agree.optimizer_load")
        if parts.step_missing:
            warnings.warn("loaded optimizer state has no averager step: the averager's step is reset "
                          "to 0, so the averaging schedule restarts", UserWarning, stacklevel=2)
        self.optim.load_state_dict(parts.inner)  # loaded into a copy above: it does not raise
        self.averager.apply_state_dict(parts.averager)
        self._apply_own_state(state_dict)

    # What a subclass keeps beside the inner optimizer and the averager (DiLoCo: its global copy).
    _own_state_name = "nothing else"

    def _check_own_state(self, state_dict: dict) -> Optional[ValueError]:
        return None

    def _trial_own_state(self, state_dict: dict) -> Optional[ValueError]:
        return None

    def _own_state_digest(self, state_dict: dict) -> Optional[int]:
        return None

    def _apply_own_state(self, state_dict: dict) -> None:
        pass
