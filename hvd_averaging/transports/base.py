"""The interface every way of moving tensors implements, and the driver of its stages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generator, Optional

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

__all__ = ["Stages", "Transport", "Transfer"]

# A generator that yields the Horovod handles of one stage (one per buffer, or one for the whole
# round), is sent their results, and returns the tensors that hold the averages (one per buffer).
Stages = Generator[list, list, list]


class Transport(ABC):
    """A way of averaging flat buffers (one per dtype) over the members of a process set.

    All buffers of a round move stage by stage together, so every rank takes the same decision
    at every stage for all of them (a float16 round that finds a NaN stops before any buffer
    moves, on every rank).
    """

    @abstractmethod
    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        """The collectives that average ``buffers`` (collective over the set, same ``names``
        on every member, one per buffer). Buffers may be overwritten; the averages are the
        generator's value."""

    @abstractmethod
    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        """Payload bytes of a round over ``buffers`` that this rank hands to collectives whose
        members sit on more than one node."""

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        """Payload bytes of one round over ``buffers`` (their size in the dtype that travels)."""
        return sum(b.numel() * b.element_size() for b in buffers)

    def writes_in_place(self) -> bool:
        """Whether Horovod's background thread writes the average straight into the buffers
        handed to :meth:`stages` (so a round abandoned after a timeout still writes there when
        a late rank arrives), rather than into tensors of its own that the caller's thread
        copies back. True unless a transport says otherwise: the safe answer."""
        return True

    def forget_buffers(self) -> None:
        """Drop the buffers kept for the next round (staging copies): a round abandoned after
        a timeout may still be written into them. The next round allocates fresh ones."""

    def start(self, buffers: list[torch.Tensor], names: list[str], what: str) -> "Transfer":
        """Launch the first stage; ``what`` names the round in errors."""
        return Transfer(self.stages(buffers, names), what)


class Transfer:
    """One round in flight: its stages, advanced without blocking.

    Each stage's collectives run on Horovod's background thread; :meth:`advance` collects a
    finished stage and launches the next one, so a caller that calls it now and then (once per
    training step) keeps the round moving without ever waiting.
    """

    def __init__(self, stages: Stages, what: str):
        self._stages = stages
        self.what = what
        self.result: Optional[list[torch.Tensor]] = None
        self._handles: Optional[list] = None
        self._step(None, first=True)

    def _step(self, value, first: bool = False) -> None:
        try:
            self._handles = next(self._stages) if first else self._stages.send(value)
        except StopIteration as finished:
            self._handles = None
            self.result = finished.value
        except BaseException:
            self._handles = None  # the round is over on every rank alike (e.g. a NaN agreed on)
            raise

    @property
    def in_flight(self) -> bool:
        """True while a stage's collectives are queued in Horovod (launched, not collected)."""
        return self._handles is not None

    @property
    def handles(self) -> list:
        """The Horovod handles of the stage in flight (empty when none is)."""
        return list(self._handles or [])

    def abandon(self) -> None:
        """Stop the round where it is (after a timeout or an interrupt): no later stage is
        launched, and no result is copied anywhere. The stage in flight stays queued in
        Horovod; :attr:`handles` are still to be synchronized once it completes, which
        releases what Horovod holds of it."""
        self._stages.close()

    def ready(self) -> bool:
        """True when the current stage finished (so :meth:`advance` would launch the next one);
        one poll per handle, no waiting."""
        return self._handles is not None and all(hvd.poll(h) for h in self._handles)

    def advance(self) -> bool:
        """Collect every finished stage and launch the next; True when the round is complete.

        Raises:
            HorovodInternalError: Horovod failed or shut down during a stage (named by ``what``).
        """
        while self.ready():
            try:
                values = [hvd.synchronize(h) for h in self._handles]
            except HorovodInternalError as error:
                self._handles = None
                self._stages.close()
                raise HorovodInternalError(f"{self.what}: {error}") from error
            self._step(values)
        return self._handles is None
