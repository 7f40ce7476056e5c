"""float16 on the wire: half the bytes on the link, on any route (inside nodes too).

Horovod's ``Compression.fp16`` casts as it is: a parameter above 65504, or a sum of ranks'
values above it, becomes inf in every model, silently. Here the ranks first agree on the largest
magnitude in the buffer (one small Max-allreduce), then every value is multiplied by the same
power of two, chosen so that the sum of all ranks' values stays far from overflow and small
values keep as many bits as float16 allows; the average is divided by it again (exact: a power of two).
Parameters keep their own dtype; only the wire is float16. A NaN or Inf on any rank stops the
round on every rank before data moves (:class:`~.base.NonFiniteOnWire`).

Error against averaging exactly: float16 keeps 11 significant bits (unit roundoff ``u = 2**-11``).
Casting, the additions of a reduction over ``R`` ranks (in whatever order and stages the inner
way uses) and the division round at most ``R + 2`` times on the path of every element, so
``|fp16 average - exact average| <= (R + 2) * (u * mean_j |x_j| + 2**-25 / scale)`` elementwise
(:func:`fp16_error_bound`; the second term is float16's smallest step, scaled back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import horovod.torch as hvd
import torch

from ..routes import Route
from ..transports.base import Stages, Transport
from .base import NonFiniteOnWire, WireFormat
from .registry import WIRE_FORMATS

__all__ = ["FP16_MAX", "FP16_SUM_LIMIT", "fp16_scale", "fp16_error_bound", "Fp16Wire", "Fp16"]

FP16_MAX = 65504.0
# The scaled sum of all ranks' values stays below this. Not FP16_MAX: Horovod 0.28.1's float16
# sums over Gloo go wrong once partial sums pass about 2**14 (measured on 4 ranks: relative error
# 0.74 with sums near 32000, exact near 15800; MPI exact at both). Two bits of range lower
# cost no precision (float16 keeps 11 significant bits at any magnitude).
FP16_SUM_LIMIT = 2.0 ** 14
_SMALLEST_EXPONENT, _LARGEST_EXPONENT = -126, 100  # scale and 1/scale stay normal float32 numbers


def fp16_scale(absmax: float, ranks: int) -> float:
    """The power of two that brings ``ranks`` values of magnitude up to ``absmax`` into float16
    with their sum at most ``FP16_SUM_LIMIT`` (2**14), as large as that allows.

    Raises:
        ValueError: ``absmax`` is negative or not finite, or ``ranks`` < 1, or the values are
            too large for any float32 scale (float64 parameters beyond ~1e42).

    Example::

        >>> fp16_scale(1e6, 4)  # 4 * 1e6 * 2**-8 = 15625 <= 2**14
        0.00390625
    """
    if not (math.isfinite(absmax) and absmax >= 0):
        raise ValueError(f"absmax must be a finite number >= 0, got {absmax!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
    if absmax == 0:
        return 1.0
    exponent = math.floor(math.log2(FP16_SUM_LIMIT / (ranks * absmax)))
    exponent = max(_SMALLEST_EXPONENT, min(_LARGEST_EXPONENT, exponent))
    while exponent > _SMALLEST_EXPONENT and ranks * absmax * 2.0 ** exponent > FP16_SUM_LIMIT:
        exponent -= 1  # log2's rounding at an exact power of two
    if ranks * absmax * 2.0 ** exponent > FP16_SUM_LIMIT:
        raise ValueError(f"values of magnitude {absmax:g} on {ranks} ranks do not fit float16 at "
                         "any scale: average them without compression")
    return 2.0 ** exponent


def fp16_error_bound(mean_abs: torch.Tensor, ranks: int, scale: float) -> torch.Tensor:
    """Elementwise bound on ``|fp16 average - exact average|`` for ``ranks`` ranks whose values
    have mean magnitude ``mean_abs`` (see the module docstring)."""
    return (ranks + 2) * (2.0 ** -11 * mean_abs + 2.0 ** -25 / scale)


class Fp16Wire(Transport):
    """Wrap ``inner``: agree on a scale, average a scaled float16 copy, scale back.

    Args:
        inner: the way the float16 buffer travels (flat or node-aware).
        process_set: the set ``inner`` averages over (the scale is agreed over it).
        ranks: its number of members.
    """

    def __init__(self, inner: Transport, process_set: hvd.ProcessSet, ranks: int):
        self.inner = inner
        self.process_set = process_set
        self.ranks = ranks
        self.last_scales: list[float] = []
        self._wires: dict[tuple, torch.Tensor] = {}  # one float16 buffer per round name

    def _wire(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        key = (name, buffer.numel(), buffer.device)
        wire = self._wires.get(key)
        if wire is None:
            wire = self._wires[key] = torch.empty(buffer.numel(), dtype=torch.float16,
                                                  device=buffer.device)
        return wire

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        # One agreement for the whole round: every buffer's largest magnitude, and the highest
        # rank holding a NaN/Inf anywhere (-1: none), so all ranks stop or go on together.
        absmax = [float(b.abs().max()) if b.numel() else 0.0 for b in buffers]
        bad = not all(math.isfinite(a) for a in absmax)
        local = [0.0 if bad else a for a in absmax] + [hvd.rank() if bad else -1.0]
        (agreed,) = yield [hvd.allreduce_async(torch.tensor(local, dtype=torch.float64),
                                               op=hvd.Max, process_set=self.process_set,
                                               name=f"{names[0]}.fp16_absmax")]
        if agreed[-1] >= 0:
            raise NonFiniteOnWire(int(agreed[-1]), "float16")
        scales = [fp16_scale(float(a), self.ranks) for a in agreed[:-1]]
        self.last_scales = scales
        wires = []
        for buffer, name, scale in zip(buffers, names, scales):
            wire = self._wire(buffer, name)
            torch.mul(buffer, scale, out=wire)
            wires.append(wire)
        averages = yield from self.inner.stages(wires, [f"{n}.fp16" for n in names])
        for buffer, average, scale in zip(buffers, averages, scales):
            buffer.copy_(average)
            buffer.mul_(1.0 / scale)
        return buffers

    def writes_in_place(self) -> bool:
        return False  # the float16 copies travel; the caller's thread scales the average back

    def forget_buffers(self) -> None:
        self._wires = {}  # a late write may still land in the float16 copies
        self.inner.forget_buffers()

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return sum(b.numel() * 2 for b in buffers)

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.cross_node_bytes(
            [torch.empty(b.numel(), dtype=torch.float16, device="meta") for b in buffers])


@dataclass(frozen=True)
class Fp16(WireFormat):
    """float16 on the wire (``compression="fp16"`` or ``hvd.Compression.fp16``): the whole
    route, inside nodes too, carries the scaled float16 copy."""

    name = "fp16"
    round_name = "a float16 round"

    def build(self, route: Route, state: Optional[Any]) -> Transport:
        return Fp16Wire(route.float_transport(), route.process_set, route.members)


WIRE_FORMATS.register(Fp16(), {"hvd.Compression.fp16": hvd.Compression.fp16})
