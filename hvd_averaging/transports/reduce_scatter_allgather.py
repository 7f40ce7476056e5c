"""A reduce-scatter, then an allgather, of each buffer over the set: the average in two
collectives. Across the link with one rank per node (a rail), Open MPI runs these faster than
its allreduce (see :mod:`.node_aware`)."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from .base import Stages, Transport

__all__ = ["ReduceScatterAllgather"]


class ReduceScatterAllgather(Transport):
    """``hvd.reducescatter_async`` (``op=Average``) then ``hvd.allgather_async`` over ``process_set``.

    Args:
        process_set: the set that averages.
        members: its number of members.
        crosses_nodes: whether its members sit on more than one node (for traffic counters).
    """

    def __init__(self, process_set: hvd.ProcessSet, members: int, crosses_nodes: bool):
        self.process_set = process_set
        self.members = members
        self.crosses_nodes = crosses_nodes

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        # Horovod splits the first dimension as evenly as it can, in member order, and the
        # allgather concatenates in the same order, so any length comes back in place.
        pieces = yield [hvd.reducescatter_async(b, op=hvd.Average, process_set=self.process_set,
                                                name=f"{n}.reducescatter")
                        for b, n in zip(buffers, names)]
        return (yield [hvd.allgather_async(p, process_set=self.process_set, name=f"{n}.allgather")
                       for p, n in zip(pieces, names)])

    def writes_in_place(self) -> bool:
        return False  # both collectives return new tensors

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        # payload handed to the collectives: the whole buffer to the reduce-scatter, this
        # rank's piece to the allgather
        whole = self.wire_bytes(buffers)
        return whole + whole // self.members if self.crosses_nodes else 0
