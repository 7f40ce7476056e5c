"""int8 blocks: quantizing rows of values with one float32 scale per block, the bytes that
carry them, where a chunk is cut into pieces, and the error bound (pure functions; the exchange
that uses them is :mod:`.int8`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["check_block_size", "quantize_blocks", "dequantize_blocks", "pack_rows", "unpack_rows",
           "int8_error_bound", "window_absmax"]

_LEVELS = 127  # symmetric: -127..127, so that -x quantizes to -q


def check_block_size(block_size: Any) -> int:
    """``block_size`` if it is a positive int.

    Raises:
        ValueError: anything else (named).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (values per int8 scale), got "
                         f"{block_size!r}")
    return block_size


def quantize_blocks(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of float32 ``values`` ``[rows, length]`` -> int8 ``[rows, length]`` and one float32
    scale per block of ``block_size`` values ``[rows, ceil(length / block_size)]``; a value is
    ``q * scale`` up to half a step.

    Example::

        >>> q, s = quantize_blocks(torch.tensor([[0.5, -1.0, 0.25]]), 2)
        >>> q.tolist(), s.mul(127).tolist()
        ([[64, -127, 127]], [[1.0, 0.25]])
    """
    rows, length = values.shape
    blocks = -(-length // block_size)
    padded = F.pad(values, (0, blocks * block_size - length)).reshape(rows, blocks, block_size)
    scales = padded.abs().amax(dim=2).div_(_LEVELS)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    quantized = padded.div(divisors).round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return quantized.view(rows, blocks * block_size)[:, :length], scales


def dequantize_blocks(quantized: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: float32 ``[rows, length]``."""
    rows, length = quantized.shape
    blocks = scales.shape[1]
    values = torch.zeros(rows, blocks * block_size, dtype=torch.float32, device=quantized.device)
    values[:, :length] = quantized
    values.view(rows, blocks, block_size).mul_(scales.unsqueeze(2))
    return values[:, :length]


def pack_rows(quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One row of bytes per chunk: its int8 values, then its float32 scales."""
    return torch.cat([quantized.view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packet: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return packet[:, :length].view(torch.int8), packet[:, length:].contiguous().view(torch.float32)


def int8_error_bound(block_absmax: torch.Tensor, ranks: int) -> torch.Tensor:
    """Elementwise bound on ``|int8 average - exact average|`` without error feedback, given the
    largest magnitude any rank sends in each element's block (see the module docstring)."""
    return block_absmax * (2 / 254 + 1 / 254 ** 2 + (ranks + 8) * 2.0 ** -24)


def window_absmax(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """For rows of values ``[ranks, n]``: per element, the largest ``|x|`` on any rank within
    ``block_size - 1`` positions (an upper bound of its block's ``A``, whatever the route)."""
    peaks = values.abs().amax(dim=0).view(1, 1, -1).float()
    return F.max_pool1d(peaks, 2 * block_size - 1, stride=1, padding=block_size - 1).view(-1)
