"""The public spelling of what travels on the wire (``compression=``), checked and named."""

from __future__ import annotations

import horovod.torch as hvd

__all__ = ["wire_is_fp16", "compression_name"]


def wire_is_fp16(compression) -> bool:
    """True for ``hvd.Compression.fp16``, False for None or ``hvd.Compression.none``.

    Raises:
        ValueError: anything else (named).
    """
    if compression is None or compression is hvd.Compression.none:
        return False
    if compression is hvd.Compression.fp16:
        return True
    raise ValueError(f"compression must be hvd.Compression.none or hvd.Compression.fp16, got "
                     f"{compression!r}")


def compression_name(compression) -> str:
    """``"fp16"`` or ``"none"`` (for configurations compared across ranks)."""
    return "fp16" if wire_is_fp16(compression) else "none"
