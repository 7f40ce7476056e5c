"""int8 on the wire: about a quarter of float32's bytes across the link.

Horovod cannot sum int8, so an int8 round is a reduce-scatter and an allgather made of an
alltoall and an allgather of bytes (as INTELLECT-1 does over Gloo, arXiv:2412.01152):

1. each rank splits its buffer into one chunk per member, cuts each chunk into blocks of
   ``block_size`` values and sends every block as int8 with a float32 scale (its largest
   magnitude / 127), all in one ``hvd.alltoall`` of bytes: member ``j`` receives chunk ``j``
   from everyone;
2. the owner of a chunk dequantizes what it received, sums in float32 (in member order),
   divides by the number of members, and requantizes its chunk;
3. one ``hvd.allgather`` of the requantized chunks; every member dequantizes the same bytes,
   so every rank ends with bit-identical values.

Pipelined: each chunk travels in up to :data:`DEFAULT_PIECES` pieces cut on block boundaries;
a piece's alltoall leaves as soon as it is quantized and its allgather as soon as it is summed,
so the host work of one piece overlaps the transfer of the others (the blocks, scales and
results are those of a single piece).

On a node-aware route only the rail (the stage that crosses the link) travels in int8; the
stages inside a node stay in the buffer's dtype. A NaN/Inf on any rank stops the round on every
rank before data moves (:class:`~.base.AgreeFinite`).

Bytes: per ``block_size`` values, ``block_size`` bytes and one 4-byte scale: with 1024,
0.2510x float32's bytes (plus at most ``members - 1`` values of padding per buffer).

Error against averaging exactly, elementwise, without error feedback: rounding to the nearest
step costs at most half a step (``A / 254``) when a rank quantizes, at most that again when the
owner requantizes the average, and float32 adds its rounding, so
``|int8 average - exact average| <= A * (2/254 + 1/254**2 + (R + 8) * 2**-24)``, where ``A`` is
the largest magnitude any rank sends in the element's block (at most the largest ``|x|`` within
``block_size - 1`` positions of the element on any rank) and ``R`` the number of ranks
(:func:`int8_error_bound`).

Error feedback (``error_feedback=True``, MuLoCo / SparseLoCo): each rank keeps what quantizing
lost (its whole buffer's residual, and its owned chunk's) and adds it to the next round's values
before quantizing, so the errors of successive rounds cancel instead of adding up. Memory: one
float32 copy of the buffers that travel in int8 (on a node-aware route, the rail's share:
``1/ranks_per_node`` of the model) plus ``1/members`` of it, per averager level.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import horovod.torch as hvd
import torch

from ..routes import Route
from ..transports.base import Stages, Transport
from ..transports.in_pieces import piece_bounds
from .base import AgreeFinite, WireFormat
from .int8_blocks import (check_block_size, dequantize_blocks, pack_rows,
                          quantize_blocks, unpack_rows)
from .registry import WIRE_FORMATS

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_PIECES", "Residuals", "Int8Exchange", "Int8"]

DEFAULT_BLOCK_SIZE = 1024
DEFAULT_PIECES = 4  # pieces per chunk in flight at once (pipelining; see Int8Exchange)


class Residuals:
    """Error feedback's memory: what quantizing lost, per buffer, kept by one codec.

    A round computes its new residuals aside and they replace the old ones only when the round
    completes, so a round restarted from a checkpoint (a delayed round's snapshot) sees the same
    residuals as the interrupted one.
    """

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}

    def get(self, key: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        found = self.kept.get(key)
        if found is None or found.shape != like.shape:
            return None
        if found.device != like.device:  # loaded with map_location="cpu", trained on a GPU
            found = self.kept[key] = found.to(like.device)
        return found

    def commit(self, pending: dict[str, torch.Tensor]) -> None:
        self.kept.update(pending)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"residuals": {key: value.clone() for key, value in self.kept.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kept = {key: torch.as_tensor(value, dtype=torch.float32).clone()
                     for key, value in state.get("residuals", {}).items()}


class Int8Exchange(Transport):
    """Average float buffers over ``process_set`` with int8 on the wire (alltoall, owner's
    float32 sum and requantization, allgather; see the module docstring).

    Pipelined: each member's chunk travels in up to ``pieces`` pieces cut on block boundaries.
    Every piece's alltoall is launched as soon as it is quantized, and each piece is reduced and
    its allgather launched as soon as it arrives, so quantizing and summing overlap the
    transfers of the other pieces. The blocks, and so the results, are those of one piece.

    Args:
        process_set: the set that averages.
        members: its number of members.
        crosses_nodes: whether its members sit on more than one node (for traffic counters).
        block_size: values per scale.
        residuals: error feedback's memory, or None for none.
        pieces: most pieces per chunk (each at least 64 blocks).
    """

    def __init__(self, process_set: hvd.ProcessSet, members: int, crosses_nodes: bool,
                 block_size: int = DEFAULT_BLOCK_SIZE, residuals: Optional[Residuals] = None,
                 pieces: int = DEFAULT_PIECES):
        self.process_set = process_set
        self.members = members
        self.crosses_nodes = crosses_nodes
        self.block_size = block_size
        self.residuals = residuals
        self.pieces = pieces
        self._splits = torch.ones(members, dtype=torch.int32)  # one row of bytes per member

    def _chunk(self, numel: int) -> int:
        return -(-numel // self.members)

    def stages(self, buffers: list[torch.Tensor], names: list[str]) -> Stages:
        members, block = self.members, self.block_size
        feedback = self.residuals is not None
        rows, sent = [], []  # per buffer: its values by member [members, chunk]; per piece
        sent_lost, owned_lost = [], []  # per buffer, with error feedback: what quantizing lost
        # residuals are kept by buffer position (a codec serves one averager level, whose rounds
        # always carry the same buffers), so they load into a resumed run whatever its names
        for index, (buffer, name) in enumerate(zip(buffers, names)):
            chunk = self._chunk(buffer.numel())
            values = torch.zeros(members * chunk, dtype=torch.float32, device=buffer.device)
            values[:buffer.numel()] = buffer.reshape(-1)
            values = values.view(members, chunk)
            rows.append(values)
            self._feed_back(values, f"{index}.sent", values)
            sent_lost.append(torch.empty_like(values) if feedback else None)
            owned_lost.append(torch.empty_like(values[:1]) if feedback else None)
            for piece, (start, end) in enumerate(piece_bounds(chunk, block, self.pieces)):
                packet = self._quantized(values[:, start:end], sent_lost[index], start, end)
                handle = hvd.alltoall_async(packet, splits=self._splits,
                                            process_set=self.process_set,
                                            name=f"{name}.int8_alltoall.{piece}")
                sent.append((index, start, end, name, piece, handle))
        gathers = []
        for index, start, end, name, piece, handle in sent:
            (answer,) = yield [handle]  # the later pieces still travel meanwhile
            packet = answer[0] if isinstance(answer, (tuple, list)) else answer
            quantized, scales = unpack_rows(packet, end - start)
            average = dequantize_blocks(quantized, scales, block).sum(dim=0, keepdim=True)
            average.div_(members)
            self._feed_back(average, f"{index}.owned", rows[index][:1], start, end)
            packet = self._quantized(average, owned_lost[index], start, end)
            gathers.append((index, start, end, hvd.allgather_async(
                packet, process_set=self.process_set, name=f"{name}.int8_allgather.{piece}")))
        gathered = yield [handle for _, _, _, handle in gathers]
        for (index, start, end, _), packet in zip(gathers, gathered):
            quantized, scales = unpack_rows(packet, end - start)
            rows[index][:, start:end] = dequantize_blocks(quantized, scales, block)
        for buffer, values in zip(buffers, rows):
            buffer.copy_(values.view(-1)[:buffer.numel()].view_as(buffer))
        if feedback:
            self.residuals.commit({**{f"{i}.sent": lost for i, lost in enumerate(sent_lost)},
                                   **{f"{i}.owned": lost for i, lost in enumerate(owned_lost)}})
        return buffers

    def _feed_back(self, values: torch.Tensor, key: str, like: torch.Tensor,
                   start: int = 0, end: Optional[int] = None) -> None:
        """Add the residual kept under ``key`` (shaped like ``like``), columns ``start:end``."""
        if self.residuals is not None:
            residual = self.residuals.get(key, like)
            if residual is not None:
                values.add_(residual[:, start:end])

    def _quantized(self, values: torch.Tensor, lost: Optional[torch.Tensor], start: int,
                   end: int) -> torch.Tensor:
        """``values`` as a packet of int8 blocks and scales; with error feedback, what that
        loses goes into columns ``start:end`` of ``lost``."""
        quantized, scales = quantize_blocks(values, self.block_size)
        if lost is not None:
            lost[:, start:end] = values - dequantize_blocks(quantized, scales, self.block_size)
        return pack_rows(quantized, scales)

    def writes_in_place(self) -> bool:
        return False  # packets are made per round; the caller's thread writes the result

    def _packet_bytes(self, numel: int) -> int:
        chunk = self._chunk(numel)
        return chunk + 4 * -(-chunk // self.block_size)

    def wire_bytes(self, buffers: list[torch.Tensor]) -> int:
        return sum(self.members * self._packet_bytes(b.numel()) for b in buffers)

    def cross_node_bytes(self, buffers: list[torch.Tensor]) -> int:
        # payload handed to the collectives: every chunk to the alltoall, the owned one to the
        # allgather
        if not self.crosses_nodes:
            return 0
        return sum((self.members + 1) * self._packet_bytes(b.numel()) for b in buffers)


@dataclass(frozen=True)
class Int8(WireFormat):
    """int8 on the wire (``compression="int8"``, or this object for other settings).

    Args:
        block_size: values per float32 scale (default 1024: 0.251x float32's bytes).
        error_feedback: keep each rank's quantization residual and add it before the next
            round (off by default); set by the averagers' ``error_feedback=True``.

    Raises:
        ValueError: ``block_size`` is not a positive int.

    Example::

        >>> hva.average_parameters(model.parameters(), compression="int8")
        >>> hva.PeriodicModelAverager(16, compression=hva.Int8(block_size=256))
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    error_feedback: bool = False

    name = "int8"
    round_name = "an int8 round"

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        object.__setattr__(self, "error_feedback", bool(self.error_feedback))

    def new_state(self) -> Optional[Residuals]:
        return Residuals() if self.error_feedback else None

    def with_error_feedback(self) -> "Int8":
        return replace(self, error_feedback=True)

    def build(self, route: Route, state: Optional[Any]) -> Transport:
        if route.node_aware:
            rail = Int8Exchange(route.rail_set, route.nodes, True, self.block_size, state)
            inner = route.node_aware_with(rail)
        else:
            inner = Int8Exchange(route.process_set, route.members, route.crosses_nodes,
                                 self.block_size, state)
        return AgreeFinite(inner, route.process_set, "int8")

    def spec(self) -> Any:
        return ["int8", self.block_size, self.error_feedback]


WIRE_FORMATS.register(Int8(), {}, "hva.Int8(block_size=...)")
