"""The interface every way of moving tensors implements, and the driver of its stages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generator, Optional

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

__all__ = ["Stages", "Transport", "Transfer"]

# A generator that yields a Horovod handle per stage, is sent that handle's result, and returns
# the tensor that holds the average (the buffer itself or a tensor Horovod allocated).
Stages = Generator[int, torch.Tensor, torch.Tensor]


class Transport(ABC):
    """A way of averaging one flat buffer over the members of a process set."""

    @abstractmethod
    def stages(self, buffer: torch.Tensor, name: str) -> Stages:
        """The collectives that average ``buffer`` (collective over the set, same ``name`` on
        every member). ``buffer`` may be overwritten; the average is the generator's value."""

    @abstractmethod
    def cross_node_bytes(self, buffer: torch.Tensor) -> int:
        """Payload bytes of ``buffer``'s round that this rank hands to collectives whose members
        sit on more than one node."""

    def wire_bytes(self, buffer: torch.Tensor) -> int:
        """Payload bytes of one round over ``buffer`` (its size in the dtype that travels)."""
        return buffer.numel() * buffer.element_size()

    def start(self, buffer: torch.Tensor, name: str, what: str) -> "Transfer":
        """Launch the first stage; ``what`` names the round in errors."""
        return Transfer(self.stages(buffer, name), what)


class Transfer:
    """One buffer's round in flight: its stages, advanced without blocking.

    Each stage's collective runs on Horovod's background thread; :meth:`advance` collects a
    finished stage and launches the next one, so a caller that calls it now and then (once per
    training step) keeps the round moving without ever waiting.
    """

    def __init__(self, stages: Stages, what: str):
        self._stages = stages
        self.what = what
        self.result: Optional[torch.Tensor] = None
        self._handle: Optional[int] = None
        self._step(None, first=True)

    @property
    def done(self) -> bool:
        return self._handle is None

    def _step(self, value, first: bool = False) -> None:
        try:
            self._handle = next(self._stages) if first else self._stages.send(value)
        except StopIteration as finished:
            self._handle = None
            self.result = finished.value

    def ready(self) -> bool:
        """True when the current stage finished (so :meth:`advance` would launch the next one);
        one poll, no waiting."""
        return self._handle is not None and hvd.poll(self._handle)

    def advance(self) -> bool:
        """Collect every finished stage and launch the next; True when the round is complete.

        Raises:
            HorovodInternalError: Horovod failed or shut down during a stage (named by ``what``).
        """
        while self._handle is not None and hvd.poll(self._handle):
            try:
                value = hvd.synchronize(self._handle)
            except HorovodInternalError as error:
                self._handle = None
                self._stages.close()
                raise HorovodInternalError(f"{self.what}: {error}") from error
            self._step(value)
        return self._handle is None
