"""The main job's own collectives, each bounded by ``hva.timeout()`` and none of them pickled:
numbers travel as float64 tensors, tokens as bytes. A rank that dies or a link that is cut ends
the job with a named error instead of a hang in the race's bookkeeping."""

from __future__ import annotations

import time
from typing import Sequence

import horovod.torch as hvd
import torch

from hvd_averaging.deadlines import blocking_call, bounded_collective, guarded_enqueue

__all__ = ["barrier", "allreduce", "PendingMax", "allgather_rows"]


def barrier(what: str) -> None:
    """``hvd.barrier()``, ended by the watchdog if it blocks past the timeout (it has no handle
    to poll)."""
    with blocking_call(f"barrier: {what}"):
        hvd.barrier()


def allreduce(tensor: torch.Tensor, op, name: str, what: str) -> torch.Tensor:
    """``hvd.allreduce`` (out of place) with a polled, bounded wait."""
    with bounded_collective(what, tensor.numel() * tensor.element_size()) as collective:
        return collective.wait([hvd.allreduce_async(tensor, op=op, name=name)])[0]


class PendingMax:
    """The largest ``value`` over all ranks, launched now and read later (:meth:`result`), so
    that nobody waits for it while it travels. Every rank launches it at the same point; the
    launch is bounded by the watchdog (Horovod can block an enqueue), the wait by polling."""

    def __init__(self, value: float, name: str):
        self._launched = time.monotonic()
        with guarded_enqueue("the race's clock agreement (enqueue)"):
            self._handle = hvd.allreduce_async(torch.tensor([value], dtype=torch.float64),
                                               op=hvd.Max, name=name)

    def result(self) -> float:
        """The agreed value, bounded by ``hva.timeout()`` counted from the launch."""
        with bounded_collective("the race's clock agreement", started_at=self._launched) as collective:
            return float(collective.wait([self._handle])[0].item())


def allgather_rows(values: Sequence[float], name: str, what: str) -> list[list[float]]:
    """Every rank's ``values`` (same length on every rank), in rank order."""
    row = torch.tensor([list(values)], dtype=torch.float64)
    with bounded_collective(what) as collective:
        gathered = collective.wait([hvd.allgather_async(row, name=name)])[0]
    return gathered.tolist()
