"""What the averaging rounds of one world share on this rank: packings of the tensor lists
they average, the layouts agreed per set, and the codecs of the wire formats spelled."""

from __future__ import annotations

from typing import Optional

import torch

from .flat_storage import Packing, pack
from .wire import WireCodec, wire_format

__all__ = ["RoundBook"]

_MAX_PACKINGS = 8


class RoundBook:
    """What rounds of one world share on this rank: packings and the layouts agreed per set."""

    def __init__(self) -> None:
        self.packings: dict[tuple, Packing] = {}  # by (name, tensor identities), at most a few
        self.reused: dict[str, dict] = {}  # per name, for tensors copied through (gradients)
        self.agreed_layouts: dict[tuple, tuple] = {}  # (set id, name) -> (layout digest, wire) agreed
        self.codecs: dict = {}  # per wire format without state: shared by the calls spelling it

    def codec(self, compression) -> WireCodec:
        """The codec of a public ``compression=`` spelling, made once per world, so that the
        transports it builds (and their wire buffers) serve every call that spells it alike.
        (A format with state, error feedback's, gets a codec per call: an averager level keeps
        its own.)

        Raises:
            ValueError: a bad spelling (named, with the choices).
        """
        wire = wire_format(compression)
        if wire.new_state() is not None:
            return wire.codec()
        found = self.codecs.get(wire)
        if found is None:
            found = self.codecs[wire] = wire.codec()
        return found

    def cached_packing(self, tensors: list[torch.Tensor], name: str, bind: bool) -> Optional[Packing]:
        """The packing made for exactly these tensors, if they still live in it."""
        if not bind:
            return None
        packing = self.packings.get((name, tuple(id(t) for t in tensors)))  # holds them: ids stay theirs
        return packing if packing is not None and packing.still_bound() else None

    def new_packing(self, tensors: list[torch.Tensor], name: str, bind: bool) -> Packing:
        if not bind:
            return pack(tensors, bind=False, reuse=self.reused.setdefault(name, {}))
        packing = pack(tensors, bind=True)
        key = (name, tuple(id(t) for t in tensors))
        self.packings.pop(key, None)
        self.packings[key] = packing
        while len(self.packings) > _MAX_PACKINGS:
            self.packings.pop(next(iter(self.packings)))
        return packing
