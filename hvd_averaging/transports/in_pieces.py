"""A round cut into pieces that travel one after another: the way of a delayed round that other
rounds must be able to pass.

Horovod runs one collective at a time on its background thread, so a node round launched while
a whole-model global round is in flight waits for all of it. Cut into pieces, each launched
when the previous one is done (at the caller's next :meth:`~.base.Transfer.advance`, once per
training step), the global round leaves the thread free between pieces, and a node round
waits at most for the piece in flight.
"""

from __future__ import annotations

import torch

from .base import Stages, Transport

__all__ = ["InPieces", "piece_bounds", "MIN_PIECE_BYTES"]

# Smaller pieces would pay more in per-collective latency than they free the thread for.
MIN_PIECE_BYTES = 256 * 1024


def piece_bounds(chunk: int, block_size: int, pieces: int,
                 min_blocks: int = 64) -> list[tuple[int, int]]:
    """Split a chunk of ``chunk`` values into at most ``pieces`` runs that start on block
    boundaries (so every block, and its scale, is the one the whole chunk would have), each of
    at least ``min_blocks`` blocks where the chunk allows.

    Example::

        >>> piece_bounds(10, 2, 3, min_blocks=1)
        [(0, 4), (4, 8), (8, 10)]
    """
    blocks = -(-chunk // block_size)
    count = max(1, min(pieces, blocks // max(1, min_blocks)))
    per_piece = -(-blocks // count) * block_size
    return [(start, min(start + per_piece, chunk)) for start in range(0, chunk, per_piece)] \
        or [(0, chunk)]


class InPieces(Transport):
    """``inner``'s stages over each piece of the buffers in turn (every buffer cut into
    ``pieces`` contiguous ranges at multiples of ``align`` elements). The averages are the same
    values ``inner`` gives on each piece; the pieces' Horovod names end in ``.pieceK``.

    Args:
        inner: the way each piece travels (the route's own transport).
        pieces: how many pieces at most: a buffer gets no piece under ``min_piece_bytes``
            (a buffer smaller than that travels whole, in one piece).
        align: cut only at multiples of this many elements (int8's block size keeps its blocks).
    """

    def __init__(self, inner: Transport, pieces: int, align: int = 1024,
                 min_piece_bytes: int = MIN_PIECE_BYTES):
        for name, value in (("pieces", pieces), ("align", align),
                            ("min_piece_bytes", min_piece_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InPieces: {name}={value!r} must be a positive int")
        self.inner = inner
        self.pieces = pieces
        self.align = align
        self.min_piece_bytes = min_piece_bytes

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        bounds = [piece_bounds(b.numel(), self.align, self.pieces, min_blocks=max(
            1, self.min_piece_bytes // (self.align * b.element_size()))) for b in buffers]
        for k in range(max(len(b) for b in bounds)):
            # every buffer's k-th piece (a buffer with fewer pieces sits this one out)
            moving = [i for i, b in enumerate(bounds) if k < len(b)]
            views = [buffers[i][bounds[i][k][0]:bounds[i][k][1]] for i in moving]
            averages = yield from self.inner.stages(views, [f"{names[i]}.piece{k}" for i in moving])
            for view, average in zip(views, averages):
                if average.data_ptr() != view.data_ptr():
                    view.copy_(average.reshape(view.shape))
        return buffers

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.cross_node_bytes(buffers)

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.wire_bytes(buffers)
