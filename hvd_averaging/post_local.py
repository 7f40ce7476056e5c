"""Post-local SGD in one wrapper: ``PostLocalSGD`` adds to
:class:`~hvd_averaging.PostLocalSGDOptimizer` the gradient path that DDP's
``post_localSGD_hook`` gives PyTorch users, done Horovod's way (there are no comm hooks): during
warm-up gradients are averaged over the whole process set every step, as
``hvd.DistributedOptimizer`` does; from ``start_localSGD_iter`` on only inside the node-local
group (or not at all), while the averager averages parameters on its schedule.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

import horovod.torch as hvd
import torch

from .agreement import check_same_on_all_ranks
from .averagers import ModelAverager, PeriodicModelAverager
from .optim import PostLocalSGDOptimizer
from .process_sets import local_process_set
from .rounds import average_tensors
from .schedule import check_int
from .startup import elastic_job
from .world import current_world

__all__ = ["PostLocalSGD"]


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
        if not elastic_job():
            # Ranks that disagree would average gradients in different sets from different steps on.
            check_same_on_all_ranks("PostLocalSGD arguments", (start_localSGD_iter, post_local_gradient_allreduce,
                                    local_group_size), local_error=error, name="hva.agree.PostLocalSGD")
        elif error is not None:  # elastic: a joining worker's construction is matched by no call
            raise error
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
        self.local_group_size = local_group_size
        self.local_set: Optional[hvd.ProcessSet] = None
        self._local_set_world: Optional[int] = None
        if not elastic_job():  # elastic: made at the first local step, which all ranks reach alike
            self._make_local_set()

    def _make_local_set(self) -> None:
        """The node-local gradient group of the current world (collective over all ranks)."""
        self.local_set = local_process_set(self.global_set, self.local_group_size) \
            if self.post_local_gradient_allreduce else None
        self._local_set_world = current_world().generation

    @property
    def iteration(self) -> int:
        """The number of ``step()`` calls so far: the averager's step (stored once)."""
        return self.averager.step

    def gradient_process_set(self, iteration: Optional[int] = None) -> Optional[hvd.ProcessSet]:
        """The set that averages gradients at ``iteration`` (default: the next one), or None."""
        iteration = self.iteration if iteration is None else iteration
        if iteration < self.start_localSGD_iter:
            return self.global_set
        if self._local_set_world != current_world().generation:
            # every rank at the same step: an elastic reset dropped the group (or none was made)
            self._make_local_set()
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
        if self._creating_state():  # hvd.broadcast_optimizer_state & co.: no training step
            return self._state_creation_step()
        self._average_gradients()
        return super().step()
