"""One allreduce of each buffer over the set: the way inside a node, and for any set."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from .base import Stages, Transport

__all__ = ["FlatAllreduce"]


class FlatAllreduce(Transport):
    """``hvd.allreduce_async_`` in place, ``op=Average``, over ``process_set``.

    Args:
        process_set: the set that averages.
        crosses_nodes: whether its members sit on more than one node (for traffic counters).
    """

    def __init__(self, process_set: hvd.ProcessSet, crosses_nodes: bool):
        self.process_set = process_set
        self.crosses_nodes = crosses_nodes

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        yield [hvd.allreduce_async_(b, op=hvd.Average, process_set=self.process_set,
                                    name=f"{n}.allreduce") for b, n in zip(buffers, names)]
        return buffers

    def writes_in_place(self) -> bool:
        return True

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.wire_bytes(buffers) if self.crosses_nodes else 0
