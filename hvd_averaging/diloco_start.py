"""DiLoCo's one starting point: what it covers, and the check where no broadcast made it.

DDP broadcasts a module's whole state at construction, frozen parameters and buffers included;
DiLoCo's start covers as much. In an elastic job the handler of ``hvd.elastic.TorchState``
broadcasts rank 0's state at each sync instead; a DiLoCo that no handler holds compares a digest
of its global copy at its first outer step, so that ranks averaging their progress against
different copies raise instead of drifting apart silently.
"""

from __future__ import annotations

from typing import Iterable, Optional

import horovod.torch as hvd
import torch

from .agreement import check_same_on_all_ranks, tensor_digest

__all__ = ["start_extras", "check_global_copy_shared"]


def start_extras(params: list[torch.Tensor], buffers: Optional[Iterable[torch.Tensor]],
                 model: Optional[torch.nn.Module]) -> list[torch.Tensor]:
    """What the starting point covers beside ``params``: the ``buffers`` and ``model``'s whole
    state (frozen parameters, buffers), each tensor once (booleans and complex numbers, which
    Horovod does not broadcast, left out)."""
    seen = {id(p) for p in params}
    extras = []
    candidates = list(buffers or []) + \
        (list(model.state_dict(keep_vars=True).values()) if model is not None else [])
    for tensor in candidates:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen and \
                tensor.dtype != torch.bool and not tensor.is_complex():
            seen.add(id(tensor))
            extras.append(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
    return extras


def check_global_copy_shared(global_parameters: list[torch.Tensor],
                             process_set: hvd.ProcessSet) -> None:
    """Compare a digest of the global copy across ``process_set`` (collective over it; ranks
    outside return).

    Raises:
        RuntimeError: the copies differ (on every member), with the recipe that shares them.
    """
    if not process_set.included():
        return
    try:
        check_same_on_all_ranks("DiLoCo's global copy (digest) at its first outer step",
                                tensor_digest(global_parameters), process_set=process_set,
                                name="hva.agree.diloco.global_copy", summary="its global copy")
    except RuntimeError as differ:
        raise RuntimeError(
            f"{differ}. In an elastic job nothing broadcast it: pass the DiLoCo to "
            "hvd.elastic.TorchState (TorchState(model, diloco=opt)) so that every rank, a "
            "joining one too, takes rank 0's global copy at each sync") from differ
