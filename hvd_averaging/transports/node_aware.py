"""Averaging across nodes in three parts, so that each node's link carries one model.

A flat allreduce over ranks on several nodes makes every rank's share cross the link: with
``k`` ranks per node each node receives about ``k`` times what it needs. Here:

1. reduce-scatter inside the node: each of the node's ``k`` ranks holds the node's average of
   ``1/k`` of the buffer (shared memory or loopback);
2. the rail (the ranks of the same local position on every node) averages that share across
   the link: the ``k`` rails of a node cross it in parallel, each with ``1/k`` of the buffer, so
   the node sends and receives ``2 (n-1)/n`` of one buffer in all, the least any averaging
   across ``n`` nodes can;
3. allgather inside the node: every rank has the whole average.

How the rail averages is a transport of its own (:mod:`.reduce_scatter_allgather`, an
allreduce, or int8 in :mod:`hvd_averaging.wire.int8`), so the stages inside a node stay in the
buffer's dtype whatever crosses the link. Which collective crosses the link best depends on the
controller, as measured on the emulated cluster (16 MiB between 2 nodes with one rank each,
200 Mbit/s, ``make bench``): OpenMPI's reduce-scatter plus allgather took 721 ms where its
allreduce took 1048 ms, while Gloo's allreduce took 705 ms where its reduce-scatter plus
allgather took 1074 ms. Inside a node Gloo's reduce-scatter is slow (16 MiB between 2 ranks of a
node, 2 nodes x 2 ranks: 183 ms, where an alltoall of the same buffer took 34 ms), so over Gloo
stage 1 is an alltoall and a local sum. With one rank per node, stages 1 and 3 have nothing to
do. Results equal the flat average up to the order of the float additions.
"""

from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch

from .base import Stages, Transport

__all__ = ["NodeAware"]


class NodeAware(Transport):
    """Node-local reduce-scatter, the rail's averaging, node-local allgather.

    Args:
        node_set: this rank's node group (its set's ranks on this node); None with one rank per
            node (stages 1 and 3 are skipped).
        rail: how this rank's rail (the ranks of its local position on every node) averages
            the node's share across the link.
        ranks_per_node: members of ``node_set``.
        whole_set: the set being averaged; a last one-element collective over it ends the round
            on every rank together.
        scatter_by_alltoall: reduce-scatter inside the node as an alltoall and a local sum
            (faster than Gloo's reduce-scatter) instead of Horovod's reduce-scatter.
    """

    def __init__(self, node_set: Optional[hvd.ProcessSet], rail: Transport, ranks_per_node: int,
                 whole_set: Optional[hvd.ProcessSet] = None, scatter_by_alltoall: bool = False):
        self.node_set = node_set
        self.rail = rail
        self.ranks_per_node = ranks_per_node
        self.whole_set = whole_set
        self.scatter_by_alltoall = scatter_by_alltoall

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        # Horovod splits the first dimension as evenly as it can, in member order, and the
        # allgathers concatenate in the same order, so any length comes back in place.
        shares = buffers
        if self.node_set is not None:
            shares = yield [self._scatter(b, n) for b, n in zip(buffers, names)]
            shares = [self._summed(b, share) for b, share in zip(buffers, shares)]
        shares = yield from self.rail.stages(shares, [f"{n}.rail" for n in names])
        wholes = shares
        if self.node_set is not None:
            wholes = yield [hvd.allgather_async(s, process_set=self.node_set,
                                                name=f"{n}.node_allgather")
                            for s, n in zip(shares, names)]
        if self.node_set is not None and self.whole_set is not None:
            # The last stage ran inside each node, so one node can be done while another is
            # still in it; a rank that then exits shuts Horovod down under the others (measured:
            # node 1's ranks got "Horovod has been shut down"). One tiny collective over the
            # whole set ends the round at once everywhere, as a flat allreduce does.
            yield [hvd.allreduce_async_(torch.zeros(1), op=hvd.Sum, process_set=self.whole_set,
                                        name=f"{names[0]}.end")]
        for buffer, whole in zip(buffers, wholes):
            if whole is not buffer:
                buffer.copy_(whole)
        return buffers

    def _by_alltoall(self, buffer: torch.Tensor) -> bool:
        return self.scatter_by_alltoall and buffer.numel() >= self.ranks_per_node

    def _split(self, numel: int) -> list[int]:
        """Share lengths in member order: as even as possible, the first ones one longer."""
        k = self.ranks_per_node
        return [numel // k + (1 if member < numel % k else 0) for member in range(k)]

    def _scatter(self, buffer: torch.Tensor, name: str):
        if not self._by_alltoall(buffer):
            return hvd.reducescatter_async(buffer, op=hvd.Average, process_set=self.node_set,
                                           name=f"{name}.node_reducescatter")
        splits = torch.tensor(self._split(buffer.numel()), dtype=torch.int32)
        return hvd.alltoall_async(buffer, splits=splits, process_set=self.node_set,
                                  name=f"{name}.node_alltoall")

    def _summed(self, buffer: torch.Tensor, received) -> torch.Tensor:
        """This rank's share averaged: the alltoall brought every member's copy of it, in
        member order (a reduce-scatter's result is already that)."""
        if not self._by_alltoall(buffer):
            return received
        rows = received[0] if isinstance(received, (tuple, list)) else received
        rows = rows.view(self.ranks_per_node, -1)
        return rows.sum(dim=0, dtype=rows.dtype).div_(self.ranks_per_node)

    def writes_in_place(self) -> bool:
        # with one rank per node the rail averages the buffers themselves
        return self.node_set is None and self.rail.writes_in_place()

    def forget_buffers(self) -> None:
        self.rail.forget_buffers()

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.rail.wire_bytes(buffers)  # the model's size in the format the link carries

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.rail.cross_node_bytes(self._shares(buffers))

    def _shares(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stand-ins (no storage) for the node shares the rail averages."""
        k = self.ranks_per_node
        return [torch.empty(-(-b.numel() // k), dtype=b.dtype, device="meta") for b in buffers]
