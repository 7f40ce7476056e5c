"""The buffers travel as they are (float32 stays float32): the default wire format."""

from __future__ import annotations

from ..transports.base import Transport
from .base import Route, WireCodec

__all__ = ["AsIs"]


class AsIs(WireCodec):
    """No compression (``compression=None``, ``"none"`` or ``hvd.Compression.none``)."""

    name = "none"

    def build(self, route: Route) -> Transport:
        return route.float_transport()
