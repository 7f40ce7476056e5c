"""Elastic training (``horovod.torch.elastic``) with averagers and wrappers in the committed state.

``import hvd_averaging`` teaches Horovod's ``TorchState`` (this module registers the handlers;
``import hvd_averaging.elastic`` is no longer needed, and harmless) to hold averagers: pass one as
a keyword and its step is saved at ``state.commit()``, restored after a failure, and broadcast
from rank 0 when workers join. When the world changes, Horovod's reset shuts Horovod down and
initializes it again, which drops every process set (horovod#4021): the handler starts a new
:class:`~hvd_averaging.world.World`, and the averager's sets are re-created for it at the
averager's next firing step (or a ``ValueError`` says why the hierarchy no longer fits), also
when a replaced worker left the size unchanged.

A :class:`~hvd_averaging.PostLocalSGDOptimizer` or :class:`~hvd_averaging.PostLocalSGD` passed
as the optimizer (``TorchState(model, opt)``) is held by :class:`WrapperStateHandler`: its inner
optimizer's state and its averager's step are saved at ``commit()``, restored locally after a
failure (Horovod's own optimizer handler called the wrapper's collective ``load_state_dict``
there, and the job died), and taken from rank 0 at each sync. PostLocalSGD makes its node-local
gradient group for each new world at its first local step (its construction, like an
averager's, makes no collective in an elastic job).

A :class:`~hvd_averaging.DiLoCo` passed to ``TorchState`` is held whole: its inner optimizer's
state (as Horovod holds an optimizer's), its averager's step, its global copy and its outer
optimizer's state are saved at ``commit()``, restored locally after a failure, and broadcast from
rank 0 when workers join, so every rank, a new worker included, holds the same global copy (DiLoCo
averages the progress since it, which is only right if the copy is the same everywhere). Pass the
wrapper alone (``TorchState(model, diloco=opt)``), not its averager again.

Horovod over MPI cannot initialize again after a shutdown, so elastic runs use Gloo
(``horovodrun --gloo`` with ``--host-discovery-script``; see ``docs/launch.md``).

Example::

    >>> import horovod.torch as hvd
    >>> import hvd_averaging as hva
    >>> hva.init()
    >>> averager = hva.PeriodicModelAverager(period=4)
    >>> state = hvd.elastic.TorchState(model, optimizer, averager=averager, epoch=0)
    >>> @hvd.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         ...  # optimizer.step(); state.averager.average_parameters(model.parameters())
    ...         state.commit()
"""

from __future__ import annotations

import copy

from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry
import horovod.torch as hvd
import torch

from .averagers import ModelAverager
from .broadcast import broadcast_from_first_member, broadcast_state
from .deadlines import bounded_collective, recovered_from_timeout
from .optim import PostLocalSGDOptimizer
from .outer import DiLoCo
from .world import renew_world

__all__ = ["AveragerStateHandler", "WrapperStateHandler", "DiLoCoStateHandler"]


class AveragerStateHandler(StateHandler):
    """Saves, restores and synchronizes a :class:`ModelAverager` inside ``TorchState``."""

    def __init__(self, averager: ModelAverager):
        super().__init__(averager)
        self._saved_step = averager.step

    def save(self) -> None:
        self._saved_step = self.value.step

    def restore(self) -> None:
        # Local only: restore runs right after a HorovodInternalError, when collectives fail.
        # The elastic reset recovers, so the exit armed after an AveragingTimeoutError goes.
        recovered_from_timeout()
        self.value.step = self._saved_step

    def sync(self) -> None:
        """Collective, after each (re)start that syncs: Horovod was (re)initialized, so a new
        :class:`~hvd_averaging.world.World` begins (the averager makes its process sets for it
        at its next firing step, even when the world kept its size); then take rank 0's step."""
        renew_world()
        step = torch.tensor([self.value.step], dtype=torch.int64)
        with bounded_collective("the averager's step from rank 0 (elastic sync)") as collective:
            collective.wait([hvd.broadcast_async_(step, root_rank=0, name="hva.elastic.step")])
        self.value.step = int(step.item())
        self._saved_step = self.value.step


class WrapperStateHandler(StateHandler):
    """Saves, restores and synchronizes a :class:`~hvd_averaging.PostLocalSGDOptimizer` or
    :class:`~hvd_averaging.PostLocalSGD` inside ``TorchState``: its inner optimizer's state and
    its averager's step. Horovod's own optimizer handler would call the wrapper's collective
    ``load_state_dict`` in ``restore()``, right after a ``HorovodInternalError``, when no
    collective can run: the job died instead of recovering. Here ``restore()`` is local and
    ``sync()`` brings every rank to rank 0's state and step."""

    def __init__(self, wrapper: PostLocalSGDOptimizer):
        super().__init__(wrapper)
        self._averager = AveragerStateHandler(wrapper.averager)
        self._saved: dict = {}
        self.save()

    def set_value(self, value: PostLocalSGDOptimizer) -> None:
        self._averager = AveragerStateHandler(value.averager)
        super().set_value(value)

    def _optimizers(self) -> list:
        """The optimizers whose states travel: the inner one (DiLoCo adds its outer one)."""
        return [self.value.optim]

    def save(self) -> None:
        self._averager.save()
        self._saved = {"optimizers": [copy.deepcopy(o.state_dict()) for o in self._optimizers()]}

    def restore(self) -> None:
        # Local only: collectives fail right after a HorovodInternalError.
        self._averager.restore()
        for optimizer, saved in zip(self._optimizers(), self._saved["optimizers"]):
            optimizer.load_state_dict(copy.deepcopy(saved))

    def sync(self) -> None:
        """Collective: the averager's world and step, then rank 0's optimizer states, each bounded
        by ``hva.timeout()``. The states travel whole, as data
        (:func:`~hvd_averaging.broadcast.broadcast_state`): Horovod's
        ``broadcast_optimizer_state`` would first make a missing state by a step with zero
        gradients, which moves parameters under weight decay."""
        self._averager.sync()
        for index, optimizer in enumerate(self._optimizers()):
            state = broadcast_state(optimizer.state_dict() if hvd.rank() == 0 else None,
                                    what=f"{type(self.value).__name__} optimizer {index}'s state "
                                         "from rank 0 (elastic sync)",
                                    name=f"hva.elastic.wrapper.optimizer{index}")
            if hvd.rank() != 0:
                optimizer.load_state_dict(state)
        self._sync_own()
        self.save()

    def _sync_own(self) -> None:
        """What a subclass keeps beside the optimizers (DiLoCo: its schedule and global copy)."""


class DiLoCoStateHandler(WrapperStateHandler):
    """Saves, restores and synchronizes a :class:`~hvd_averaging.DiLoCo` inside ``TorchState``:
    inner optimizer, averager step, global copy, outer optimizer and its schedule."""

    def _optimizers(self) -> list:
        return [self.value.optim, self.value.outer_optimizer]

    def save(self) -> None:
        super().save()
        self._saved["global"] = [g.detach().clone() for g in self.value.global_parameters]
        self._saved["schedule"] = _schedule_state(self.value)

    def restore(self) -> None:
        super().restore()
        if self.value.outer_scheduler is not None:
            self.value.outer_scheduler.load_state_dict(copy.deepcopy(self._saved["schedule"]))
        with torch.no_grad():
            for global_, saved in zip(self.value.global_parameters, self._saved["global"]):
                global_.copy_(saved)

    def _sync_own(self) -> None:
        if self.value.outer_scheduler is not None:  # one script on every rank; the wait is bounded
            schedule = broadcast_state(_schedule_state(self.value) if hvd.rank() == 0 else None,
                                       what="DiLoCo's outer schedule from rank 0 (elastic sync)",
                                       name="hva.elastic.diloco.schedule")
            if hvd.rank() != 0:
                self.value.outer_scheduler.load_state_dict(schedule)
        broadcast_from_first_member(self.value.global_parameters,
                                    what="DiLoCo's global copy from rank 0 (elastic sync)",
                                    name="hva.elastic.diloco.global")
        self.value.confirm_shared_start()


def _schedule_state(diloco: DiLoCo):
    return copy.deepcopy(diloco.outer_scheduler.state_dict()) \
        if diloco.outer_scheduler is not None else None


def _register_handlers() -> None:
    """Put the handlers in Horovod's registry once: DiLoCo's first, then the other wrappers'
    (Horovod takes the first handler whose type matches, and the wrappers are Optimizers), the
    averagers' last."""
    registry = list(get_handler_registry())
    if not any(handler is WrapperStateHandler for _, handler in registry):
        registry.insert(0, (PostLocalSGDOptimizer, WrapperStateHandler))
    if not any(handler is DiLoCoStateHandler for _, handler in registry):
        registry.insert(0, (DiLoCo, DiLoCoStateHandler))
    if not any(handler is AveragerStateHandler for _, handler in registry):
        registry.append((ModelAverager, AveragerStateHandler))
    set_handler_registry(registry)


_register_handlers()
