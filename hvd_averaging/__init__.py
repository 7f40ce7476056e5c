"""hvd_averaging: PyTorch's model averaging (post-local SGD, hierarchical SGD, DiLoCo) on Horovod.

Layers, each importing only the ones before it (the README's layout lists what each module owns):

- who: ``topology`` (groups from a placement, pure);
- runtime: ``watchdog``, ``collective_round`` (one polled, bounded collective), ``deadlines``
  (the timeout, the watchdog), ``world`` (one Horovod world
  and what belongs to it), ``gather_text`` (strings as bytes in tensors), ``placement`` (the
  node of every rank), ``process_sets`` (the shared registry), ``agreement`` (cross-rank
  checks), ``horovod_patch`` (whether Horovod carries the runner patch), ``startup`` (``init``);
- storage and transports: ``flat_storage``, ``params``, ``checkpoint`` (checkpoint forms and
  checks, pure), ``broadcast`` (one rank's tensors or state to all), ``traffic``, ``transports`` (one
  module per way), ``routes`` (which sets a round crosses, the way in the buffers' dtype),
  ``wire`` (one module per wire format: as is, float16, int8; registered by name);
- rounds: ``rounds`` (one round now), ``abandoned_rounds`` (rounds a rank stopped waiting for),
  ``delayed`` (rounds left in flight);
- when: ``schedule`` (pure), ``membership`` (an averager's process sets per level, following
  the world), ``levels`` (each level's wire format and rounds in flight), ``averagers``,
  ``hierarchical``;
- training integration: ``loading`` (a checkpoint file read on every rank),
  ``state_creation`` (steps that only create an optimizer's state), ``optim`` (the wrapper),
  ``post_local`` (post-local SGD), ``outer_optimizers`` and ``outer_schedules``
  (what the outer step runs), ``diloco_start`` (its starting point), ``outer`` (DiLoCo),
  ``elastic``;
- ``examples``.
"""

from . import elastic as _elastic  # noqa: F401  (registers the handlers with TorchState)
from .averagers import ModelAverager, PeriodicModelAverager
from .deadlines import AveragingTimeoutError, set_timeout, timeout
from .hierarchical import HierarchicalModelAverager
from .loading import load_checkpoint
from .optim import PostLocalSGDOptimizer
from .outer import DiLoCo
from .outer_optimizers import default_outer_optimizer, slowmo_outer_optimizer
from .outer_schedules import OuterMomentumWarmup
from .post_local import PostLocalSGD
from .process_sets import local_process_set, process_set
from .rounds import NonFiniteError, average_parameters
from .startup import init
from .traffic import TrafficCounters, reset_traffic, traffic
from .wire import Int8

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
    "load_checkpoint",
    "default_outer_optimizer",
    "OuterMomentumWarmup",
    "slowmo_outer_optimizer",
    "local_process_set",
    "timeout",
    "set_timeout",
    "AveragingTimeoutError",
    "NonFiniteError",
    "traffic",
    "reset_traffic",
    "TrafficCounters",
    "Int8",
]
