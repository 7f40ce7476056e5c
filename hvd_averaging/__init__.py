"""hvd_averaging: PyTorch's model averaging (post-local SGD, hierarchical SGD) on Horovod.

Layers, each importing only the ones before it:
``topology`` (who averages with whom) -> ``runtime`` (Horovod start-up, process sets, placement)
-> ``communication`` (how tensors travel) -> ``averagers`` (when) -> ``optim`` (training
integration) -> ``examples``.
"""

from .averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from .communication import average_parameters
from .optim import PostLocalSGD, PostLocalSGDOptimizer
from .runtime import init, local_process_set, process_set

__all__ = [
    "init",
    "process_set",
    "average_parameters",
    "ModelAverager",
    "PeriodicModelAverager",
    "HierarchicalModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGD",
    "local_process_set",
]
