"""How a round's flat buffers (one per dtype) travel to their average: one small module per way,
one interface.

Every way is a :class:`~.base.Transport`: ``stages(buffers, names)`` is a generator that
launches one stage's Horovod collectives, yields their handles, receives their results and
finally returns the tensors holding the averages. :class:`~.base.Transfer` drives those stages without blocking
(``advance``), so a round can stay in flight while training goes on. Bookkeeping (layouts,
traffic counters, finite checks, bounded waits) is the caller's, in :mod:`hvd_averaging.rounds`.

- :mod:`.flat_allreduce`: one allreduce over the whole set (one node, or any set).
- :mod:`.node_aware`: reduce-scatter inside each node, reduce-scatter and allgather between
  nodes along rails, allgather inside each node (each node's link carries one model).
- :mod:`.fp16_wire`: any of the above with the buffer in float16 on the wire, scaled so that
  nothing overflows.
"""

from .base import Transfer, Transport
from .flat_allreduce import FlatAllreduce
from .fp16_wire import FP16_MAX, Fp16Wire, fp16_error_bound, fp16_scale
from .node_aware import NodeAware

__all__ = ["Transport", "Transfer", "FlatAllreduce", "NodeAware", "Fp16Wire", "fp16_scale",
           "fp16_error_bound", "FP16_MAX"]
