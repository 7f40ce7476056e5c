"""The main job's own collectives, each bounded by ``hva.timeout()`` and none of them pickled:
numbers travel as float64 tensors, tokens as bytes. A rank that dies or a link that is cut ends
the job with a named error instead of a hang in the race's bookkeeping."""

from __future__ import annotations

from typing import Sequence

import horovod.torch as hvd
import torch

from hvd_averaging.deadlines import blocking_call, bounded_collective

__all__ = ["barrier", "allreduce", "agreed_max", "allgather_rows"]


def barrier(what: str) -> None:
    """``hvd.barrier()``, ended by the watchdog if it blocks past the timeout (it has no handle
    to poll)."""
    with blocking_call(f"barrier: {what}"):
        hvd.barrier()


def allreduce(tensor: torch.Tensor, op, name: str, what: str) -> torch.Tensor:
    """``hvd.allreduce`` (out of place) with a polled, bounded wait."""
    with bounded_collective(what, tensor.numel() * tensor.element_size()) as collective:
        return collective.wait([hvd.allreduce_async(tensor, op=op, name=name)])[0]


def agreed_max(value: float, name: str) -> float:
    """The largest ``value`` over all ranks."""
    return float(allreduce(torch.tensor([value], dtype=torch.float64), hvd.Max, name,
                           "the race's clock agreement").item())


def allgather_rows(values: Sequence[float], name: str, what: str) -> list[list[float]]:
    """Every rank's ``values`` (same length on every rank), in rank order."""
    row = torch.tensor([list(values)], dtype=torch.float64)
    with bounded_collective(what) as collective:
        gathered = collective.wait([hvd.allgather_async(row, name=name)])[0]
    return gathered.tolist()
