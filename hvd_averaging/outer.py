"""Outer optimizers on averaged progress: DiLoCo and SlowMo, on any averager, hierarchies included.

`DiLoCo <https://arxiv.org/abs/2311.08105>`_ keeps a global copy of the parameters. Workers take
inner optimizer steps alone; at the averager's top-level firing steps the *pseudo-gradient*
``global_copy - average(local parameters)`` is handed to an outer optimizer as the gradient of the
global copy, the outer optimizer steps, and every rank's parameters become the new global copy.

What the top level averages is each rank's progress, ``local parameters - global_copy``, not the
parameters: the global copy is bit-identical on every rank (every rank computes it from the same
averaged bytes, and checkpoints and elastic restarts carry it), so ``average(local - global)`` is
the pseudo-gradient's negative exactly. On a lossy wire (int8) the rounding is then a fraction of
the progress made in one round rather than of the parameters' far larger values, as INTELLECT-1
quantizes pseudo-gradients (arXiv:2412.01152).

With Nesterov momentum (``SGD(lr=0.7, momentum=0.9, nesterov=True)``, the paper's and torchft's
setting) this trains far better per round than plain averaging. `SlowMo
<https://arxiv.org/abs/1910.00643>`_ is the same mechanism with ``SGD(lr=1.0, momentum=0.5)``.
With ``SGD(lr=1.0)`` and no momentum the outer step is plain averaging (``global + average(local -
global)``, up to float32 rounding).

On a :class:`~hvd_averaging.HierarchicalModelAverager` the lower levels average plainly at their
own periods (cheap, inside a node) and only the top level, across nodes, gets the outer step:
hierarchical DiLoCo.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .agreement import check_same_on_all_ranks, config_digest, tensor_digest
from .averagers import ModelAverager
from .diloco_start import check_global_copy_shared, start_extras
from .broadcast import broadcast_from_first_member
from .checkpoint import optimizer_state_error, optimizer_trial_error, schedule_trial_error, \
    tensors_error
from .optim import PostLocalSGDOptimizer
from .outer_optimizers import outer_optimizer_and_schedule
from .params import collect_parameters
from .startup import elastic_job
from .world import current_world

__all__ = ["DiLoCo"]


class DiLoCo(PostLocalSGDOptimizer):
    r"""Inner optimizer steps, plain averaging at lower levels, an outer step at the top level.

    Same contract as :class:`~hvd_averaging.PostLocalSGDOptimizer`: call ``step()`` after
    ``backward()``; ``zero_grad``, ``param_groups`` and ``state_dict`` are the wrapper's.

    Args:
        optim: the inner (local) optimizer, e.g. ``torch.optim.AdamW``.
        averager: a :class:`~hvd_averaging.PeriodicModelAverager` (its firing steps get the outer
            step) or :class:`~hvd_averaging.HierarchicalModelAverager` (its largest period does;
            smaller periods average plainly).
        outer_optimizer: ``params -> torch.optim.Optimizer`` over the global copy; default
            :func:`~hvd_averaging.default_outer_optimizer` (DiLoCo);
            :func:`~hvd_averaging.slowmo_outer_optimizer` for SlowMo.
        outer_scheduler: ``outer optimizer -> schedule``, stepped after every outer step and
            saved in ``state_dict()["outer_scheduler"]``: a
            :class:`~hvd_averaging.OuterMomentumWarmup` (Pier's momentum warm-up) or any of
            PyTorch's LR schedulers (e.g. ``LambdaLR`` on the outer learning rate).
        buffers, grad_scaler: as in :class:`~hvd_averaging.PostLocalSGDOptimizer`.
        model: optional ``torch.nn.Module``: the starting point then covers everything in its
            ``state_dict()`` as DDP's does, frozen parameters and buffers (BatchNorm running
            statistics, their counters) included, not only the optimizer's parameters; the
            ``buffers`` passed are covered in any case.
        global_on_cpu: keep the global copy (and the outer optimizer's state) in CPU memory, for
            GPU training where device memory is tight; the outer step then runs on the CPU.

    Overlapped (`Streaming DiLoCo <https://arxiv.org/abs/2501.18512>`_, torchft's
    ``fragment_sync_delay``): when the averager's top level has ``delay=d``, a top-level firing
    step ``s`` snapshots the parameters ``S`` and starts averaging them without waiting; at
    ``s + d`` the pseudo-gradient ``-average(S - global)`` goes to the outer optimizer, and every
    rank's parameters become ``new global + (parameters - S)``: the local progress made since
    ``s`` is kept. With ``SGD(lr=1.0)`` and no momentum this is
    ``PeriodicModelAverager(period, delay=d)``.

    Extra memory: one copy of the parameters (the global copy) plus the outer optimizer's state
    (one more copy for momentum); overlapped, also the delayed round's snapshot and the buffer
    its average arrives in.

    One starting point: construction is collective over all ranks, and every member of the
    averager's set takes the first member's parameters (rank 0's for all ranks), bit for bit, as
    DDP does at construction, with the ``buffers`` and, given ``model``, its whole
    ``state_dict()`` (frozen parameters too); the global copy starts from them. In elastic jobs
    ``DiLoCoStateHandler`` (``hvd.elastic.TorchState(..., diloco=opt)``) broadcasts rank 0's
    state instead; a DiLoCo that no handler synced compares a digest of its global copy across
    the set at its first top-level step in each world and raises ``RuntimeError`` with that
    recipe if they differ. ``load_state_dict`` compares a digest of the loaded global copy
    across ranks.

    Raises:
        TypeError: ``optim``, ``averager``, ``outer_optimizer`` or ``outer_scheduler`` (or what
            they return) is of the wrong kind; ``ValueError`` from the schedule's rules. On that
            rank; the others raise ``RuntimeError`` naming it.
        RuntimeError: ranks hold models of different shapes.

    Example::

        >>> import hvd_averaging as hva
        >>> hva.init(group_sizes=[4])
        >>> # 2 nodes x 4 ranks: the node every 4 steps, an outer step across nodes every 32
        >>> averager = hva.HierarchicalModelAverager({4: 4, 32: 8})
        >>> opt = hva.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), averager)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager, *,
                 outer_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
                 outer_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
                 buffers: Optional[Iterable[torch.Tensor]] = None,
                 grad_scaler: Optional[Any] = None, global_on_cpu: bool = False,
                 model: Optional[torch.nn.Module] = None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        super().__init__(optim, averager, buffers=buffers, grad_scaler=grad_scaler)
        self._params = [p for group in optim.param_groups for p in group["params"]]
        self.global_on_cpu = bool(global_on_cpu)
        self._shared_start_world: Optional[int] = None  # the world whose ranks share the copy
        with torch.no_grad():  # values again below, once the ranks share one starting point
            self.global_parameters = [
                torch.nn.Parameter(p.detach().to("cpu" if global_on_cpu else p.device, copy=True))
                for p in self._params]
        self._global_by_id = {id(p): g for p, g in zip(self._params, self.global_parameters)}
        error = None
        try:  # the outer optimizer and its schedule are made before any collective
            self.outer_optimizer, self.outer_scheduler = outer_optimizer_and_schedule(
                averager, outer_optimizer, outer_scheduler, self.global_parameters)
        except (TypeError, ValueError) as bad:
            error = bad
        if not elastic_job():  # elastic: DiLoCoStateHandler's sync broadcasts rank 0's state
            check_same_on_all_ranks("DiLoCo arguments", (global_on_cpu, outer_scheduler is None),
                                    local_error=error, name="hva.agree.DiLoCo")
            # One starting point, as DDP and torchft have: every rank takes the first member's
            # parameters, so that the global copy, and what is averaged against it, agree.
            broadcast_from_first_member(self._params + start_extras(self._params, self.buffers, model),
                                        averager.process_set, what="DiLoCo's starting point",
                                        name="hva.diloco.start")
            with torch.no_grad():
                for param, global_ in zip(self._params, self.global_parameters):
                    global_.copy_(param)
            self.confirm_shared_start()
        elif error is not None:
            raise error
        self.overlapped = bool(averager.level_delays.get(averager.top_level, 0))
        if self.overlapped:
            averager.transform_delayed_average(averager.top_level, self._outer_step_on_average,
                                               before_send=self._progress_to_send)

    def step(self, closure=None):
        """Inner step; then the averager's round, and at its top level the outer step (not when
        the step only creates the state, :meth:`initialize_state`: then the inner step only)."""
        if self._creating_state():
            return self._state_creation_step(closure)
        loss = self._inner_step(closure)
        if self.averager.level_at(self.averager.step) == self.averager.top_level:
            self._check_shared_start()
        # overlapped, the outer step runs inside the averager, when the delayed round is applied
        outer = not self.overlapped and \
            self.averager.level_at(self.averager.step) == self.averager.top_level
        if not outer:
            self.averager.average_parameters(self.param_groups, buffers=self.buffers)
            return loss
        # the parameters the round takes; it averages their progress since the global copy
        taken = {id(p): p for p in collect_parameters(self.param_groups)}
        params = list(taken.values())
        with torch.no_grad():
            self._relative_to_global(params, params, -1)
        try:
            self.averager.average_parameters(self.param_groups, buffers=self.buffers)
        except BaseException:
            with torch.no_grad():  # leave each rank's parameters as the round left them
                self._relative_to_global(params, params, 1)
            raise
        with torch.no_grad():
            for key, global_ in self._outer_step(taken).items():
                taken[key].copy_(global_)
        return loss

    def confirm_shared_start(self) -> None:
        """Record that every rank of the current world holds the same global copy (the
        construction's broadcast, an agreed ``load_state_dict``, ``DiLoCoStateHandler``'s sync)."""
        self._shared_start_world = current_world().generation

    def _check_shared_start(self) -> None:
        """At the first top-level step of a world in which nothing made the global copy the
        same on every rank (an elastic job whose DiLoCo no ``TorchState`` holds)."""
        if self._shared_start_world != current_world().generation:
            check_global_copy_shared(self.global_parameters, self.averager.process_set)
            self.confirm_shared_start()

    @torch.no_grad()
    def _outer_step(self, progress: dict) -> dict:
        """Pseudo-gradient ``-average(local - global)`` into the outer optimizer (``progress``:
        by parameter id, the averaged progress of each parameter the round took); returns the
        new global copy by parameter id, for the caller to put in place. Parameters the round
        skipped (no gradient) get a zero pseudo-gradient and are reset to the global copy here."""
        for local, global_ in zip(self._params, self.global_parameters):
            average = progress.get(id(local))
            global_.grad = torch.neg(average.detach().to(global_.device, dtype=global_.dtype)) \
                if average is not None else torch.zeros_like(global_)
        self.outer_optimizer.step()
        if self.outer_scheduler is not None:
            self.outer_scheduler.step()
        new_globals = {}
        for local, global_ in zip(self._params, self.global_parameters):
            global_.grad = None
            if id(local) in progress:
                new_globals[id(local)] = global_
            else:
                local.copy_(global_)
        return new_globals

    def _relative_to_global(self, tensors: list, targets: list, sign: int) -> None:
        """``target += sign * global copy`` for each of ``tensors`` that is a parameter
        (``targets``: the tensors themselves, or the places they travel from)."""
        for tensor, target in zip(tensors, targets):
            global_ = self._global_by_id.get(id(tensor))
            if global_ is not None:
                target.add_(global_.to(target.device, non_blocking=True), alpha=sign)

    def _progress_to_send(self, tensors: list, wire_views: list) -> None:
        """Overlapped: the delayed round sends ``snapshot - global`` (the snapshot itself stays
        as it is, for the local progress made since)."""
        self._relative_to_global(tensors, wire_views, -1)

    def _outer_step_on_average(self, tensors: list, averages: list) -> None:
        """The overlapped outer step, given the top level's averaged progress of the snapshot:
        the new global copy replaces it, and the averager applies ``global + (p - snapshot)``."""
        by_id = {id(t): a for t, a in zip(tensors, averages)}
        progress = {id(p): by_id[id(p)] for p in self._params if id(p) in by_id}
        for key, global_ in self._outer_step(progress).items():
            by_id[key].copy_(global_)

    def state_dict(self) -> dict:
        """The inner optimizer's state, ``"step"``, ``"averager"``, ``"outer_optimizer"`` and
        ``"global_parameters"``: enough to resume bit-identically on or off a firing step."""
        state = super().state_dict()
        state["outer_optimizer"] = self.outer_optimizer.state_dict()
        state["global_parameters"] = [g.detach().clone() for g in self.global_parameters]
        if self.outer_scheduler is not None:
            state["outer_scheduler"] = self.outer_scheduler.state_dict()
        return state

    # load_state_dict (the wrapper's) checks, agrees and applies these beside the rest.
    _own_state_name = "digest of the global copy and outer schedule"

    def _check_own_state(self, state_dict: dict) -> Optional[ValueError]:
        if "outer_optimizer" not in state_dict or "global_parameters" not in state_dict:
            return ValueError("DiLoCo.load_state_dict needs 'outer_optimizer' and "
                              "'global_parameters' (a checkpoint of DiLoCo.state_dict())")
        return tensors_error("global_parameters", state_dict["global_parameters"],
                             self.global_parameters) or optimizer_state_error(
            self.outer_optimizer, state_dict["outer_optimizer"], "the outer optimizer's state") \
            or self._schedule_state_error(state_dict)

    def _schedule_state_error(self, state_dict: dict) -> Optional[ValueError]:
        saved = state_dict.get("outer_scheduler")
        if self.outer_scheduler is None:
            return None if saved is None else ValueError(
                "the checkpoint has an outer schedule ('outer_scheduler') and this DiLoCo has "
                "none: pass outer_scheduler= as when it was saved")
        if saved is None:
            return ValueError("this DiLoCo has an outer schedule and the checkpoint has no "
                              "'outer_scheduler' to resume it from")
        state_error = getattr(self.outer_scheduler, "state_error", None)
        return state_error(saved) if callable(state_error) else None

    def _trial_own_state(self, state_dict: dict) -> Optional[ValueError]:
        saved = state_dict.get("outer_scheduler")
        return optimizer_trial_error(self.outer_optimizer, state_dict["outer_optimizer"],
                                     "the outer optimizer's state") or \
            (schedule_trial_error(self.outer_scheduler, saved, "state_dict['outer_scheduler']")
             if self.outer_scheduler is not None else None)

    def _own_state_digest(self, state_dict: dict) -> int:
        # Ranks that load different global copies would average progress against different
        # points and drift apart without any error.
        # The schedule's position too: ranks at different outer steps of it diverge as silently.
        return config_digest((tensor_digest(state_dict["global_parameters"]),
                              state_dict.get("outer_scheduler")))

    def _apply_own_state(self, state_dict: dict) -> None:
        with torch.no_grad():
            for global_, value in zip(self.global_parameters, state_dict["global_parameters"]):
                global_.copy_(value)
        self.outer_optimizer.load_state_dict(state_dict["outer_optimizer"])
        if self.outer_scheduler is not None:
            self.outer_scheduler.load_state_dict(state_dict["outer_scheduler"])
        self.confirm_shared_start()  # the ranks agreed on its digest

