"""The public spelling of what travels on the wire (``compression=``), checked and turned into
a codec."""

from __future__ import annotations

import warnings
from typing import Any

import horovod.torch as hvd

from .as_is import AsIs
from .base import WireCodec
from .fp16 import Fp16
from .int8 import Int8

__all__ = ["COMPRESSION_CHOICES", "wire_codec", "compression_spec", "level_codecs"]

COMPRESSION_CHOICES = ('None', '"none"', "hvd.Compression.none", '"fp16"', "hvd.Compression.fp16",
                       '"int8"', "hva.Int8(block_size=...)")


def wire_codec(compression: Any) -> WireCodec:
    """A new codec for ``compression``: None, ``"none"`` or ``hvd.Compression.none`` (as is),
    ``"fp16"`` or ``hvd.Compression.fp16``, ``"int8"`` or an :class:`~.int8.Int8` (its settings
    are copied; the new codec has memory of its own).

    Raises:
        ValueError: anything else, naming the value and the choices.
    """
    if compression is None or compression is hvd.Compression.none or compression == "none":
        return AsIs()
    if compression is hvd.Compression.fp16 or compression == "fp16":
        return Fp16()
    if compression == "int8":
        return Int8()
    if isinstance(compression, Int8):
        return Int8(compression.block_size, compression.error_feedback)
    raise ValueError(f"compression must be one of {', '.join(COMPRESSION_CHOICES)}; got "
                     f"{compression!r}")


def compression_spec(compression: Any) -> Any:
    """What ranks compare for ``compression`` (raises as :func:`wire_codec`)."""
    return wire_codec(compression).spec()


def level_codecs(compression_per_level: dict[int, Any], error_feedback: bool, *,
                 stacklevel: int = 2) -> dict[int, WireCodec]:
    """One codec per averager level (each keeps its own state); with ``error_feedback`` the int8
    levels keep their residuals. Warns when ``error_feedback`` has no int8 level to act on.

    Raises:
        ValueError: a bad compression (named, with the choices), or ``error_feedback`` not a bool.
    """
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    codecs = {level: wire_codec(c) for level, c in compression_per_level.items()}
    if error_feedback:
        int8_levels = [level for level, codec in codecs.items() if isinstance(codec, Int8)]
        if not int8_levels:
            warnings.warn("error_feedback=True does nothing without an int8 level "
                          f"(compression per level: { {l: c.name for l, c in codecs.items()} })",
                          UserWarning, stacklevel=stacklevel + 1)
        for level in int8_levels:
            codecs[level] = Int8(codecs[level].block_size, error_feedback=True)
    return codecs
