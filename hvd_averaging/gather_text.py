"""Short strings between ranks as UTF-8 bytes in a tensor: host names, error causes, tokens.

Horovod's ``allgather_object`` and ``broadcast_object`` unpickle what other ranks send; a string
needs no pickle, so none crosses between ranks here. Each call is bounded by ``hva.timeout()``.
"""

from __future__ import annotations

from typing import Optional

import horovod.torch as hvd
import torch

from .deadlines import bounded_collective

__all__ = ["TEXT_BYTES", "allgather_text", "broadcast_text"]

TEXT_BYTES = 256  # longer texts are cut (host names are at most 255 bytes)


def _encoded(text: str, width: int) -> torch.Tensor:
    raw = text.encode("utf-8", "replace")[:width]
    row = torch.zeros(1, width, dtype=torch.uint8)
    row[0, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else row[0, :0]
    return row


def _decoded(row: torch.Tensor) -> str:
    return bytes(row.tolist()).rstrip(b"\0").decode("utf-8", "replace")


def allgather_text(text: str, *, name: str, what: str,
                   process_set: Optional[hvd.ProcessSet] = None,
                   width: int = TEXT_BYTES) -> list[str]:
    """Every member's ``text`` (at most ``width`` bytes), in member order (collective)."""
    process_set = process_set if process_set is not None else hvd.global_process_set
    with bounded_collective(what) as collective:
        handle = hvd.allgather_async(_encoded(text, width), name=name, process_set=process_set)
        rows = collective.wait([handle])[0]
    return [_decoded(row) for row in rows]


def broadcast_text(text: Optional[str], root_rank: int, *, name: str, what: str,
                   width: int = TEXT_BYTES) -> str:
    """``root_rank``'s ``text`` on every rank (collective over all ranks)."""
    row = _encoded(text or "", width)
    with bounded_collective(what) as collective:
        collective.wait([hvd.broadcast_async_(row, root_rank=root_rank, name=name)])
    return _decoded(row[0])
