"""hvd_averaging: PyTorch's model averaging (post-local SGD, hierarchical SGD) on Horovod.

Layers, each importing only the ones before it:
``topology`` (who averages with whom) -> ``runtime`` (Horovod start-up, process sets, placement,
bounded waits) -> ``flat_storage`` (where averaged tensors live) -> ``transports`` (how one
buffer travels: flat, node-aware, float16 on the wire) -> ``routes`` (which way each set takes)
-> ``communication`` (what every round does) -> ``averagers`` (when) -> ``optim`` and ``outer``
(training integration: post-local SGD, DiLoCo) -> ``examples``.
"""

from .averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from .communication import NonFiniteError, TrafficCounters, average_parameters, reset_traffic, traffic
from .optim import PostLocalSGD, PostLocalSGDOptimizer
from .outer import DiLoCo, default_outer_optimizer, slowmo_outer_optimizer
from .runtime import AveragingTimeoutError, init, local_process_set, process_set, set_timeout, timeout

__all__ = [
    "init",
    "process_set",
    "average_parameters",
    "ModelAverager",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGD",
    "DiLoCo",
    "default_outer_optimizer",
    "slowmo_outer_optimizer",
    "local_process_set",
    "timeout",
    "set_timeout",
    "AveragingTimeoutError",
    "NonFiniteError",
    "traffic",
    "reset_traffic",
    "TrafficCounters",
]
