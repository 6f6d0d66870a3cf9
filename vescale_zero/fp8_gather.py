"""FP8 all-gather with one scale per tile: each rank quantizes its own tile bands.

A matrix ``[R, C]`` is cut into ``T x T`` tiles from its origin (edge tiles are smaller);
a 1-D tensor of ``N`` is one row (``1 x T`` tiles). The planner is given a granularity of
whole *tile bands* (``T`` rows, all columns), so a rank's piece is whole bands and every
tile lies on one rank::

    full matrix                      rank pieces (ragged, whole bands)
    +----+----+---+                  rank 0: band 0        -> q0 (fp8), s0 [tiles of band 0]
    | t  | t  | t |  band 0          rank 1: bands 1, 2    -> q1 (fp8), s1 [tiles of bands 1-2]
    +----+----+---+
    | t  | t  | t |  band 1          all-gather  q (1 byte/element)  + scales (fp32, few)
    +----+----+---+                  dequantize  full[tile] = q[tile] * s[tile]
    | t  | t  | t |  band 2
    +----+----+---+

scale = amax(tile) / 448 (the largest float8_e4m3fn), ``q = (x / scale) -> e4m3``, so the
gathered weights equal quantize/dequantize of the unsharded tensor tile by tile, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = ["FP8_MAX", "tile_band_granularity", "quantize_tiles", "dequantize_tiles", "FP8GatherLayout"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _as_matrix(shape: Sequence[int]) -> Tuple[int, int]:
    """``(rows, cols)`` a tensor is tiled as: 2-D as is, 1-D as one row, N-D as dim 0 x rest."""
    shape = tuple(shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def tile_band_granularity(shape: Sequence[int], tile: int) -> int:
    """The smallest block that keeps every ``tile x tile`` tile of ``shape`` whole: one band
    of ``tile`` rows when they divide the rows, else the whole tensor (1-D: ``tile``
    elements when they divide it)."""
    if tile < 1:
        raise ValueError(f"FP8 tile size must be a positive number of rows/columns, got {tile}")
    rows, cols = _as_matrix(shape)
    if rows == 1:
        return tile if cols % tile == 0 else cols
    return tile * cols if rows % tile == 0 else rows * cols


def quantize_tiles(x: torch.Tensor, tile: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [r, c]`` -> ``(q [r, c] float8_e4m3fn, scales [ceil(r/tile), ceil(c/tile)] fp32)``."""
    r, c = x.shape
    tr, tc = -(-r // tile), -(-c // tile)
    padded = x.float().new_zeros(tr * tile, tc * tile)
    padded[:r, :c] = x.float()
    tiles = padded.view(tr, tile, tc, tile)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scales[:, None, :, None]).to(FP8_DTYPE).view(tr * tile, tc * tile)[:r, :c]
    return q.contiguous(), scales


def dequantize_tiles(q: torch.Tensor, scales: torch.Tensor, tile: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_tiles` (up to the fp8 rounding), in ``dtype``."""
    r, c = q.shape
    if r % tile == 0 and c % tile == 0:  # whole tiles: one broadcast multiply, nothing expanded
        tiles = q.float().view(r // tile, tile, c // tile, tile) * scales[:, None, :, None]
        return tiles.view(r, c).to(dtype)
    expanded = scales.repeat_interleave(tile, 0)[:r].repeat_interleave(tile, 1)[:, :c]
    return (q.float() * expanded).to(dtype)


@dataclass(frozen=True)
class _Piece:
    index: int  # tensor index in the group
    rows: Tuple[int, int]  # [row_start, row_end) of the tensor's matrix view (1-D: [elem_start, elem_end))
    cols: int  # -1 for a 1-D tensor
    shard_offset: int  # element offset inside the owner's shard
    scale_offset: int  # offset of its scales inside the owner's scale buffer
    n_scales: int

    @property
    def numel(self) -> int:
        span = self.rows[1] - self.rows[0]
        return span if self.cols < 0 else span * self.cols


class FP8GatherLayout:
    """Where each rank's tile bands and scales sit, for one group's plan (static).

    [Note: FP8 dequantize per tensor] The gathered float8 bytes have the layout of the full
    buffer (rank k's shard at ``k*S``), so tensor ``i`` is whole at ``offsets[i]``; only its
    scales are spread over the ranks' scale slots, in row order. ``scale_index[i]`` (static,
    on the group's device) picks them out in one ``index_select``, and the tensor is
    dequantized in one pass: a loop over the group's tensors, independent of world size.
    """

    def __init__(self, plan, shapes: Sequence[Sequence[int]], tile: int, device: torch.device = None) -> None:
        self.plan, self.tile = plan, tile
        self.shapes = [tuple(s) for s in shapes]
        self.pieces: List[List[_Piece]] = []
        for rank in range(plan.world_size):
            pieces, scale_off = [], 0
            for i, (start, end, shard_off) in enumerate(plan.local_slices(rank)):
                if end <= start:
                    continue
                rows, cols = _as_matrix(shapes[i])
                if rows == 1:  # 1-D: tiles are runs of `tile` elements
                    piece = _Piece(i, (start, end), -1, shard_off, scale_off, -(-(end - start) // tile))
                else:
                    if start % cols or end % cols:
                        raise ValueError(f"tensor {i}: piece [{start}, {end}) is not whole rows of {cols}")
                    r0, r1 = start // cols, end // cols
                    piece = _Piece(i, (r0, r1), cols, shard_off, scale_off, -(-(r1 - r0) // tile) * -(-cols // tile))
                pieces.append(piece)
                scale_off += piece.n_scales
            self.pieces.append(pieces)
        self.max_scales = max(1, max((sum(p.n_scales for p in ps) for ps in self.pieces), default=1))
        positions: List[List[int]] = [[] for _ in self.shapes]
        for rank, pieces in enumerate(self.pieces):  # rank order = row order of every tensor
            for p in pieces:
                first = rank * self.max_scales + p.scale_offset
                positions[p.index].extend(range(first, first + p.n_scales))
        self.scale_index = [torch.tensor(pos, dtype=torch.long, device=device) for pos in positions]

    def _matrix(self, flat: torch.Tensor, piece: _Piece) -> torch.Tensor:
        if piece.cols < 0:  # 1-D: one row per tile run
            return flat.view(1, -1)
        return flat.view(piece.rows[1] - piece.rows[0], piece.cols)

    def quantize_local(self, rank: int, local: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """Quantize ``rank``'s shard ``local`` into ``q_out`` (uint8 view of fp8) and ``s_out``."""
        q8 = q_out.view(FP8_DTYPE)
        for p in self.pieces[rank]:
            q, s = quantize_tiles(self._matrix(local.narrow(0, p.shard_offset, p.numel), p), self.tile)
            q8.narrow(0, p.shard_offset, p.numel).copy_(q.view(-1))
            s_out.narrow(0, p.scale_offset, p.n_scales).copy_(s.view(-1))

    def dequantize_full(self, q_full: torch.Tensor, s_full: torch.Tensor, out: torch.Tensor) -> None:
        """Gathered fp8 bytes and scales of every rank -> the full buffer ``out``, one pass per
        tensor (see [Note: FP8 dequantize per tensor])."""
        q8 = q_full.view(FP8_DTYPE)
        for i, (shape, offset, spec) in enumerate(zip(self.shapes, self.plan.offsets, self.plan.specs)):
            if spec.numel == 0:
                continue
            rows, cols = _as_matrix(shape)
            q = q8.narrow(0, offset, spec.numel).view(rows, cols)
            scales = s_full.index_select(0, self.scale_index[i]).view(-(-rows // self.tile), -(-cols // self.tile))
            out.narrow(0, offset, spec.numel).copy_(dequantize_tiles(q, scales, self.tile, out.dtype).view(-1))
