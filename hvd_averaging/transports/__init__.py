"""How a round's flat buffers (one per dtype) travel to their average: one small module per way,
one interface.

Every way is a :class:`~.base.Transport`: ``stages(buffers, names)`` is a generator that
launches one stage's Horovod collectives, yields their handles, receives their results and
finally returns the tensors holding the averages. :class:`~.base.Transfer` drives those stages
without blocking (``advance``), so a round can stay in flight while training goes on.
Which way a round takes is :mod:`hvd_averaging.routes`' choice, what the buffers become on the
wire (float16, int8) :mod:`hvd_averaging.wire`'s; a round's bookkeeping (layouts, traffic
counters, finite checks) is :mod:`hvd_averaging.rounds`', its bounded wait
:mod:`hvd_averaging.deadlines`'.

- :mod:`.flat_allreduce`: one allreduce over the whole set (one node, or any set).
- :mod:`.reduce_scatter_allgather`: a reduce-scatter then an allgather over the set.
- :mod:`.node_aware`: reduce-scatter inside each node, the rail's averaging across nodes,
  allgather inside each node (each node's link carries one model).
- :mod:`.in_pieces`: any of them over pieces of the buffers in turn (a delayed round that the
  node rounds must be able to pass).
"""

from .base import Transfer, Transport
from .flat_allreduce import FlatAllreduce
from .in_pieces import InPieces
from .node_aware import NodeAware
from .reduce_scatter_allgather import ReduceScatterAllgather

__all__ = ["Transport", "Transfer", "FlatAllreduce", "ReduceScatterAllgather", "NodeAware",
           "InPieces"]
