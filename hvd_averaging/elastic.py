"""Elastic training (``horovod.torch.elastic``) with an averager in the committed state.

Importing this module teaches Horovod's ``TorchState`` to hold averagers: pass one as a keyword
and its step is saved at ``state.commit()``, restored after a failure, and broadcast from rank 0
when workers join. When the world changes, Horovod's reset shuts Horovod down and initializes it
again, which drops every process set (horovod#4021): the handler starts a new
:class:`~hvd_averaging.world.World`, and the averager's sets are re-created for it at the
averager's next firing step (or a ``ValueError`` says why the hierarchy no longer fits), also
when a replaced worker left the size unchanged.
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
from .world import renew_world

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
        """Collective, after each (re)start that syncs: Horovod was (re)initialized, so a new
        :class:`~hvd_averaging.world.World` begins (the averager makes its process sets for it
        at its next firing step, even when the world kept its size); then take rank 0's step."""
        renew_world()
        self.value.step = hvd.broadcast_object(self.value.step, root_rank=0, name="hva.elastic.step")
        self._saved_step = self.value.step


if not any(handler is AveragerStateHandler for _, handler in get_handler_registry()):
    set_handler_registry(list(get_handler_registry()) + [(ModelAverager, AveragerStateHandler)])
