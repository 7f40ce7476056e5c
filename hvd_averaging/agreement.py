"""Cross-rank agreement: one small allgather that checks every rank holds the same thing.

Ranks that disagree on what they average would hang Horovod or silently average unrelated
tensors, and a rank whose arguments are bad must not leave the others waiting: every check
here is joined by every rank, which then raises the same kind of error.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import horovod.torch as hvd
import torch

from .deadlines import bounded_collective
from .gather_text import allgather_text
from .process_sets import members

__all__ = ["config_digest", "tensor_digest", "check_same_on_all_ranks"]



def config_digest(config) -> int:
    """A stable 63-bit digest of ``repr(config)`` (same on every rank for equal configs)."""
    raw = hashlib.sha256(repr(config).encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)


def tensor_digest(tensors) -> int:
    """A 63-bit digest of the dtypes, shapes and exact bytes of ``tensors`` (equal on every rank
    exactly when the values are bit-identical)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        value = tensor.detach().to("cpu").contiguous()
        hasher.update(f"{value.dtype}{tuple(value.shape)}".encode())
        hasher.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(hasher.digest()[:8], "little") & ((1 << 63) - 1)


def _causes(local_error: Optional[BaseException], failed: list[int],
            process_set: hvd.ProcessSet, name: str) -> str:
    """Every failing rank's error (one more allgather, made only when some rank failed, so by
    every rank); the text travels as bytes, not as a pickle."""
    text = f"{type(local_error).__name__}: {local_error}" if local_error is not None else ""
    said = allgather_text(text, name=f"{name}.causes", what="the failing ranks' errors",
                          process_set=process_set)
    return "; ".join(f"rank {r}: {cause}" for r, cause in zip(members(process_set), said)
                     if r in failed)


def check_same_on_all_ranks(
    what: str,
    config,
    *,
    local_error: Optional[BaseException] = None,
    process_set: Optional[hvd.ProcessSet] = None,
    name: str = "hva.agree",
    summary: Optional[str] = None,
) -> None:
    """Verify with one small allgather that every rank of ``process_set`` holds the same config.

    A rank that hit ``local_error`` (e.g. a ``ValueError`` from validating its arguments) joins
    the allgather anyway, so the others learn about it instead of waiting forever; it then
    re-raises its own error while the others raise ``RuntimeError`` naming it and its cause (its
    error text travels as bytes in a tensor). ``summary``
    replaces ``repr(config)`` in the message when the config is long.

    Raises:
        RuntimeError: ranks disagree; the message names which ranks hold which config.
    """
    process_set = process_set if process_set is not None else hvd.global_process_set
    digest = -1 if local_error is not None else config_digest(config)
    ranks = members(process_set)
    with bounded_collective(f"{what} (cross-rank check)") as collective:
        handle = hvd.allgather_async(
            torch.tensor([digest], dtype=torch.int64), name=name, process_set=process_set)
        gathered = collective.wait([handle])[0].tolist()
    failed = [r for r, d in zip(ranks, gathered) if d == -1]
    causes = _causes(local_error, failed, process_set, name) if failed else ""
    if local_error is not None:
        raise local_error
    if failed:
        raise RuntimeError(f"{what}: rank(s) {failed} raised an error ({causes})")
    if len(set(gathered)) > 1:
        mine = [r for r, d in zip(ranks, gathered) if d == digest]
        others = [r for r, d in zip(ranks, gathered) if d != digest]
        raise RuntimeError(
            f"{what} differs across ranks: rank {hvd.rank()} has {summary or repr(config)}, shared by ranks "
            f"{mine}; ranks {others} have something else. Every rank must pass the same "
            "arguments, or the averaging collectives would hang or average different groups")
