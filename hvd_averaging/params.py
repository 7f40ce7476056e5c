"""Which tensors an averaging round takes, and the checks a rank can make on them alone."""

from __future__ import annotations

from typing import Iterable, Optional, Union

import horovod.torch as hvd
import torch

from .flat_storage import Packing

__all__ = ["TensorsLike", "collect_parameters", "floating_buffers", "check_local_layout",
           "first_non_finite"]

TensorsLike = Union[Iterable[torch.nn.Parameter], Iterable[dict]]


def floating_buffers(buffers) -> list[torch.Tensor]:
    """The floating-point tensors of ``buffers`` (e.g. ``model.buffers()``: BatchNorm running
    statistics yes, its integer ``num_batches_tracked`` no)."""
    if buffers is None:
        return []
    selected = []
    for index, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffers entry #{index}: expected torch.Tensor, got {type(buf).__name__}")
        if buf.is_floating_point():
            selected.append(buf)
    return selected


def collect_parameters(params: TensorsLike) -> list[torch.Tensor]:
    """The parameters to average from parameters or optimizer param groups.

    As in PyTorch, a parameter whose ``.grad`` is None is skipped (this optimizer did not update
    it). A parameter listed twice (tied weights) is averaged once.

    Raises:
        TypeError: an entry is neither a ``torch.nn.Parameter`` nor a param-group dict.
    """
    selected: list[torch.Tensor] = []
    seen: set[int] = set()

    def take(param, where: str) -> None:
        if not isinstance(param, torch.nn.Parameter):
            raise TypeError(
                f"{where}: expected torch.nn.Parameter, got {type(param).__name__}; pass "
                "model.parameters() or optimizer.param_groups")
        if param.grad is not None and id(param) not in seen:
            seen.add(id(param))
            selected.append(param)

    for index, entry in enumerate(params):
        if isinstance(entry, dict):
            if "params" not in entry:
                raise TypeError(f"param group #{index} is a dict without a 'params' key")
            for param in entry["params"]:
                take(param, f"param group #{index}")
        else:
            take(entry, f"params entry #{index}")
    return selected


def check_local_layout(tensors: list[torch.Tensor]) -> None:
    """Raise if ``tensors`` cannot be averaged: several devices, sparse or integer tensors."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"tensors to average lie on several devices {sorted(map(str, devices))}: keep a "
            "model's averaged parameters on one device")
    for i, t in enumerate(tensors):
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"tensor #{i} has layout {t.layout}: only dense tensors can be averaged")
        if not t.is_floating_point():
            raise TypeError(
                f"tensor #{i} has dtype {t.dtype}: an average of integers is not an integer; "
                "only floating-point tensors can be averaged")


def first_non_finite(packing: Packing) -> Optional[str]:
    """Where the first NaN/Inf is, or None. One reduction per dtype slab, then per tensor only
    in the slab that has one."""
    index = {id(t): i for i, t in enumerate(packing.tensors)}
    for slab in packing.slabs:
        if bool(torch.isfinite(slab.flat).all()):
            continue
        for t in slab.bound + slab.copied:
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                return (f"tensor #{index[id(t)]} (shape {tuple(t.shape)}, dtype {t.dtype}) has "
                        f"{bad} NaN/Inf value(s) on rank {hvd.rank()}")
    return None
