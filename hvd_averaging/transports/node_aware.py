"""Averaging across nodes in four stages, so that each node's link carries one model.

A flat allreduce over ranks on several nodes makes every rank's share cross the link: with
``k`` ranks per node each node receives about ``k`` times what it needs. Here:

1. reduce-scatter inside the node: each of the node's ``k`` ranks holds the node's average of
   ``1/k`` of the buffer (shared memory or loopback);
2. reduce-scatter along the rail (the ranks of the same local position on every node) and
3. allgather along the rail (or one allreduce, see below): the ``k`` rails of a node cross the link in parallel, each with
   ``1/k`` of the buffer, so the node sends and receives ``2 (n-1)/n`` of one buffer in all,
   the least any averaging across ``n`` nodes can;
4. allgather inside the node: every rank has the whole average.

Along the rail, which collective crosses the link depends on the controller, as measured on the
emulated cluster (16 MiB between 2 nodes with one rank each, 200 Mbit/s, ``make bench``):
OpenMPI's reduce-scatter plus allgather took 721 ms where its allreduce took 1048 ms, while
Gloo's allreduce took 705 ms where its reduce-scatter plus allgather took 1074 ms. With one rank
per node, stages 1 and 4 have nothing to do. Results equal the flat average up to the order of
the float additions.
"""

from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch

from .base import Stages, Transport

__all__ = ["NodeAware"]


class NodeAware(Transport):
    """Node-local reduce-scatter, rail reduce-scatter + allgather, node-local allgather.

    Args:
        node_set: this rank's node group (its set's ranks on this node); None with one rank per
            node (stages 1 and 4 are skipped).
        rail_set: this rank's rail (the ranks of its local position on every node).
        ranks_per_node: members of ``node_set``.
        nodes: members of ``rail_set``.
        whole_set: the set being averaged; a last one-element collective over it ends the round
            on every rank together.
        rail_allreduce: cross the link with one allreduce (Gloo's is at the link's rate, its
            reduce-scatter plus allgather are slower) instead of reduce-scatter plus allgather
            (OpenMPI's allreduce is the slower one).
    """

    def __init__(self, node_set: Optional[hvd.ProcessSet], rail_set: hvd.ProcessSet,
                 ranks_per_node: int, nodes: int, rail_allreduce: bool = False,
                 whole_set: Optional[hvd.ProcessSet] = None):
        self.rail_allreduce = rail_allreduce
        self.whole_set = whole_set
        self.node_set = node_set
        self.rail_set = rail_set
        self.ranks_per_node = ranks_per_node
        self.nodes = nodes

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        # Horovod splits the first dimension as evenly as it can, in member order, and the
        # allgathers concatenate in the same order, so any length comes back in place.
        shares = buffers
        if self.node_set is not None:
            shares = yield [hvd.reducescatter_async(b, op=hvd.Average, process_set=self.node_set,
                                                    name=f"{n}.node_reducescatter")
                            for b, n in zip(buffers, names)]
        if self.rail_allreduce:
            shares = yield [hvd.allreduce_async_(s, op=hvd.Average, process_set=self.rail_set,
                                                 name=f"{n}.rail_allreduce")
                            for s, n in zip(shares, names)]
        else:
            pieces = yield [hvd.reducescatter_async(s, op=hvd.Average, process_set=self.rail_set,
                                                    name=f"{n}.rail_reducescatter")
                            for s, n in zip(shares, names)]
            shares = yield [hvd.allgather_async(p, process_set=self.rail_set,
                                                name=f"{n}.rail_allgather")
                            for p, n in zip(pieces, names)]
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

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        # payload handed to the rail's collectives: the node share to the reduce-scatter (or
        # allreduce), the rail share to the allgather
        total = 0
        for buffer in buffers:
            node_share = buffer.numel() * buffer.element_size() // self.ranks_per_node
            total += node_share if self.rail_allreduce else node_share + node_share // self.nodes
        return total
