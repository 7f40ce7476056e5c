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


def _counted(stages: Stages) -> Stages:
    """``stages`` passed through; its value is (the averages, how many stages it took)."""
    count, handles = 0, next(stages)
    try:
        while True:
            count += 1
            handles = stages.send((yield handles))
    except StopIteration as finished:
        return finished.value, count


class InPieces(Transport):
    """``inner``'s stages over each piece of the buffers in turn, every buffer cut into
    contiguous ranges at multiples of ``align`` elements, none under ``min_piece_bytes`` (a
    buffer smaller than that travels whole). The averages are the values ``inner`` gives on
    each piece; the pieces' Horovod names end in ``.pieceK``.

    The caller launches one stage per training step, so the whole round must take at most
    ``window`` stages to be done by its apply step: the first piece is cut as one of ``window``
    pieces; when it is back, the stages it took (one for a flat allreduce, three or more for a
    node-aware route) say how many pieces the rest may take, one stage launch kept in reserve.
    Every rank takes the same route, so every rank cuts the same pieces.

    Args:
        inner: the way each piece travels (the route's own transport).
        window: stage launches the round may take (the delayed level's ``delay``).
        align: cut only at multiples of this many elements (int8's block size keeps its blocks).
    """

    def __init__(self, inner: Transport, window: int, align: int = 1024,
                 min_piece_bytes: int = MIN_PIECE_BYTES):
        for name, value in (("window", window), ("align", align),
                            ("min_piece_bytes", min_piece_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InPieces: {name}={value!r} must be a positive int")
        self.inner = inner
        self.window = window
        self.align = align
        self.min_piece_bytes = min_piece_bytes

    def _bounds(self, numel: int, pieces: int, element_size: int) -> list[tuple[int, int]]:
        return piece_bounds(numel, self.align, pieces, min_blocks=max(
            1, self.min_piece_bytes // (self.align * element_size)))

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        first = [self._bounds(b.numel(), self.window, b.element_size())[0] for b in buffers]
        taken = yield from self._piece(buffers, names, first, 0)
        rest_pieces = max(1, (self.window - 1 - taken) // taken)
        rest = [[(start + lo, start + hi) for lo, hi in
                 self._bounds(b.numel() - start, rest_pieces, b.element_size())]
                if start < b.numel() else [] for b, (_, start) in zip(buffers, first)]
        for k in range(max(len(r) for r in rest)):
            # every buffer's k-th piece of the rest (a buffer with fewer sits this one out)
            yield from self._piece(buffers, names, [r[k] if k < len(r) else None for r in rest],
                                   k + 1)
        return buffers

    def _piece(self, buffers: list[torch.Tensor], names: list[str], bounds: list, k: int):
        """One piece through ``inner``, its averages put in place; the stages it took."""
        moving = [i for i, b in enumerate(bounds) if b is not None]
        views = [buffers[i][bounds[i][0]:bounds[i][1]] for i in moving]
        averages, taken = yield from _counted(
            self.inner.stages(views, [f"{names[i]}.piece{k}" for i in moving]))
        for view, average in zip(views, averages):
            if average.data_ptr() != view.data_ptr():
                view.copy_(average.reshape(view.shape))
        return taken

    def writes_in_place(self) -> bool:
        return self.inner.writes_in_place()

    def forget_buffers(self) -> None:
        self.inner.forget_buffers()

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.cross_node_bytes(buffers)

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return self.inner.wire_bytes(buffers)
