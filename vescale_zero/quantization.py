"""Block-wise dynamic quantization of flat tensors: one fp32 scale per block of N elements.

::

    x (flat)   | block 0 (N) | block 1 (N) | ... | last (<= N) |
    scale[b] = absmax(block b) / 127   (signed, int8)  or  max(block b) / 255 (unsigned, uint8)
    q = round(x / scale[b])

Blocks are counted from the start of the tensor. A rank that holds a RaggedShard piece
whose start is a multiple of N (the planner keeps blocks of N whole) quantizes exactly
the blocks the unsharded tensor would have, so its bytes are the same.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["quantize_blockwise", "dequantize_blockwise"]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def quantize_blockwise(x: torch.Tensor, block: int, signed: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: int8 (signed) or uint8 (non-negative ``x``) codes and fp32 scales."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not x.is_floating_point() or x.dtype == torch.float64 or x.is_complex():
        raise TypeError(
            f"block-wise 8-bit quantization takes fp32/bf16/fp16 tensors, got {x.dtype}; cast to float32 first"
        )
    flat = _blocks(x.detach().reshape(-1).float(), block)
    if signed:
        scales = flat.abs().amax(dim=1) / 127.0
        lo, hi, dtype = -127, 127, torch.int8
    else:
        if (flat < 0).any():
            raise ValueError("unsigned block-wise quantization got negative values")
        scales = flat.amax(dim=1) / 255.0
        lo, hi, dtype = 0, 255, torch.uint8
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(flat / safe[:, None]).clamp_(lo, hi).to(dtype)
    return codes.reshape(-1)[: x.numel()], scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 values of ``codes`` (flat) with one scale per block."""
    flat = _blocks(codes.float(), block)
    return (flat * scales[:, None]).reshape(-1)[: codes.numel()]
