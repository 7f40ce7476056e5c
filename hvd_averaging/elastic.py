"""Elastic training (``horovod.torch.elastic``) with an averager in the committed state.

Importing this module teaches Horovod's ``TorchState`` to hold averagers: pass one as a keyword
and its step is saved at ``state.commit()``, restored after a failure, and broadcast from rank 0
when workers join. When the world changes, Horovod's reset shuts Horovod down and initializes it
again, which drops every process set (horovod#4021); the averager's sets are re-created for the
new world at the averager's next firing step (or a ``ValueError`` says why the hierarchy no
longer fits).
Horovod over MPI cannot initialize again after a shutdown, so elastic runs use Gloo
(``horovodrun --gloo`` with ``--host-discovery-script``; see ``docs/launch.md``).

Example::

    >>> import horovod.torch as hvd
    >>> import hvd_averaging as hva
    >>> import hvd_averaging.elastic  # registers the averager state handler
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

from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry
import horovod.torch as hvd

from .averagers import ModelAverager
from .communication import forget_layout_agreements

__all__ = ["AveragerStateHandler"]


class AveragerStateHandler(StateHandler):
    """Saves, restores and synchronizes a :class:`ModelAverager` inside ``TorchState``."""

    def __init__(self, averager: ModelAverager):
        super().__init__(averager)
        self._saved_step = averager.step

    def save(self) -> None:
        self._saved_step = self.value.step

    def restore(self) -> None:
        # Local only: restore runs right after a HorovodInternalError, when collectives fail.
        self.value.step = self._saved_step

    def sync(self) -> None:
        """Collective, after each (re)start that syncs: take rank 0's step. (The process sets a
        reset dropped are re-created by the averager itself at its next firing step.)"""
        forget_layout_agreements()
        self.value.step = hvd.broadcast_object(self.value.step, root_rank=0, name="hva.elastic.step")
        self._saved_step = self.value.step


if not any(handler is AveragerStateHandler for _, handler in get_handler_registry()):
    set_handler_registry(list(get_handler_registry()) + [(ModelAverager, AveragerStateHandler)])
