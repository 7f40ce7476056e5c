"""The buffers travel as they are (float32 stays float32): the default wire format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import horovod.torch as hvd

from ..routes import Route
from ..transports.base import Transport
from .base import WireFormat
from .registry import WIRE_FORMATS

__all__ = ["AsIs"]


@dataclass(frozen=True)
class AsIs(WireFormat):
    """No compression (``compression=None``, ``"none"`` or ``hvd.Compression.none``)."""

    name = "none"

    def build(self, route: Route, state: Optional[Any]) -> Transport:
        return route.float_transport()


WIRE_FORMATS.register(AsIs(), {"None": None, "hvd.Compression.none": hvd.Compression.none})
