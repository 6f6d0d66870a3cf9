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

[Note: which tensors are FP8] FP8 recipes (Transformer Engine, torchao float8) put FP8 on the
matrices of matmuls and keep norms, biases (and often embeddings) in higher precision: a norm's
gain near 1.0 has e4m3's 3 mantissa bits (steps of 1/8 near 1, 4% error after scaling), where
bf16 has 8. By default only tensors of 2+ dimensions are gathered as FP8
(:func:`default_fp8_filter`); the rest travel in the group's ``param_dtype`` and come back exactly
as a ``param_dtype`` gather gives them. ``fully_shard(..., fp8_all_gather_filter=...)`` widens or
narrows the choice. The tile-band granularity applies to the FP8 tensors only.

[Note: one collective per group] Every rank packs its part of the group into one byte slot of
the same size; one all-gather of bytes moves everything::

    rank k's slot (bytes)   | param_dtype pieces | fp32 scales of its tiles | fp8 pieces | pad |
                            ^ each section and each piece starts on 16 bytes (vectorised access,
                              and a valid ``view`` as fp32 / param_dtype)

The slot's size is the largest rank's need (static, from the plan). After the gather each
piece is written into the full compute buffer at its place (``plan.offsets[i]`` plus its start):
a loop over pieces, i.e. the group's tensors plus at most one more per rank boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch

__all__ = ["FP8_MAX", "FP8Filter", "default_fp8_filter", "tile_band_granularity", "quantize_tiles",
           "dequantize_tiles", "FP8GatherLayout"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_ALIGN = 16  # bytes: every section and piece of a rank's gather slot starts on it

FP8Filter = Callable[[str, torch.Tensor], bool]
"""``(name, parameter) -> gather it as FP8``; ``name`` as in granularity policies (relative to
the module given to ``fully_shard``)."""


def default_fp8_filter(name: str, param: torch.Tensor) -> bool:
    """Matrices (2+ dimensions) are gathered as FP8; norms, biases and other 1-D tensors in
    ``param_dtype`` (see [Note: which tensors are FP8])."""
    return param.dim() >= 2


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


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
    start: int  # first element of the piece inside its tensor (flat)
    numel: int
    fp8: bool
    rows: Tuple[int, int]  # FP8 pieces: [row_start, row_end) of the tensor's matrix view (1-D: elements)
    cols: int  # FP8 pieces: columns of the matrix view; -1 for a 1-D tensor
    shard_offset: int  # element offset inside the owner's shard
    byte_offset: int  # where its values start in the owner's slot
    scale_byte_offset: int  # FP8 pieces: where its scales start in the owner's slot
    n_scales: int


class FP8GatherLayout:
    """Where each rank's pieces, as FP8 tile bands with their scales or as ``hp_dtype`` values,
    sit in its gather slot, for one group's plan (static); see [Note: one collective per group].

    ``fp8[i]`` says whether tensor ``i`` is gathered as FP8 ([Note: which tensors are FP8]); an
    FP8 tensor's pieces must be whole tile bands (``tile_band_granularity``)."""

    def __init__(self, plan, shapes: Sequence[Sequence[int]], tile: int, fp8: Sequence[bool],
                 hp_dtype: torch.dtype) -> None:
        if len(fp8) != len(shapes):
            raise ValueError(f"fp8 names {len(fp8)} tensors, the group has {len(shapes)}")
        self.plan, self.tile, self.hp_dtype = plan, tile, hp_dtype
        self.shapes = [tuple(s) for s in shapes]
        self.fp8 = [bool(f) for f in fp8]
        hp_size = hp_dtype.itemsize
        self.pieces: List[List[_Piece]] = []
        for rank in range(plan.world_size):
            spans = [(i, start, end, off) for i, (start, end, off) in enumerate(plan.local_slices(rank)) if end > start]
            hp = [s for s in spans if not self.fp8[s[0]]]
            lo = [s for s in spans if self.fp8[s[0]]]
            at, pieces = 0, []
            for i, start, end, off in hp:  # section 1: param_dtype values
                pieces.append(_Piece(i, start, end - start, False, (0, 0), -1, off, at, -1, 0))
                at = _aligned(at + (end - start) * hp_size)
            tiled = []
            for i, start, end, off in lo:  # section 2: scales; rows / tiles of each FP8 piece
                rows, cols = _as_matrix(shapes[i])
                if rows == 1:  # 1-D: tiles are runs of `tile` elements
                    if start % tile:
                        raise ValueError(f"tensor {i}: piece [{start}, {end}) does not start on a run of {tile}")
                    tiled.append((i, start, end, off, (start, end), -1, -(-(end - start) // tile)))
                else:
                    if start % cols or end % cols:
                        raise ValueError(f"tensor {i}: piece [{start}, {end}) is not whole rows of {cols}")
                    r0, r1 = start // cols, end // cols
                    if r0 % tile:
                        raise ValueError(f"tensor {i}: piece [{start}, {end}) does not start on a band of {tile} rows")
                    tiled.append((i, start, end, off, (r0, r1), cols, -(-(r1 - r0) // tile) * -(-cols // tile)))
            scale_at = {}
            for t in tiled:
                scale_at[t[0]] = at
                at += 4 * t[6]
            at = _aligned(at)
            for i, start, end, off, rows, cols, n_scales in tiled:  # section 3: fp8 bytes
                pieces.append(_Piece(i, start, end - start, True, rows, cols, off, at, scale_at[i], n_scales))
                at = _aligned(at + end - start)
            self.pieces.append(pieces)
        self.slot_bytes = max(_ALIGN, max(_aligned(max((p.byte_offset + p.numel * (1 if p.fp8 else hp_size)
                                                         for p in ps), default=0)) for ps in self.pieces))

    def _matrix(self, flat: torch.Tensor, piece: _Piece) -> torch.Tensor:
        if piece.cols < 0:  # 1-D: one row per tile run
            return flat.view(1, -1)
        return flat.view(piece.rows[1] - piece.rows[0], piece.cols)

    def _scale_grid(self, piece: _Piece) -> Tuple[int, int]:
        if piece.cols < 0:
            return 1, piece.n_scales
        return -(-(piece.rows[1] - piece.rows[0]) // self.tile), -(-piece.cols // self.tile)

    def pack_local(self, rank: int, local: torch.Tensor, slot: torch.Tensor) -> None:
        """``rank``'s master shard ``local`` into its byte ``slot`` (``slot_bytes`` uint8):
        FP8 pieces quantized tile by tile with their scales, the others cast to ``hp_dtype``."""
        for p in self.pieces[rank]:
            values = local.narrow(0, p.shard_offset, p.numel)
            if not p.fp8:
                slot.narrow(0, p.byte_offset, p.numel * self.hp_size).view(self.hp_dtype).copy_(values)
                continue
            q, s = quantize_tiles(self._matrix(values, p), self.tile)
            slot.narrow(0, p.byte_offset, p.numel).view(FP8_DTYPE).copy_(q.view(-1))
            slot.narrow(0, p.scale_byte_offset, 4 * p.n_scales).view(torch.float32).copy_(s.view(-1))

    @property
    def hp_size(self) -> int:
        return self.hp_dtype.itemsize

    def unpack_full(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's slot (``gathered``: ``world_size * slot_bytes`` uint8) -> the full
        buffer ``out`` (plan layout): FP8 pieces dequantized, the others copied."""
        hp_size = self.hp_size
        for rank, pieces in enumerate(self.pieces):
            slot = gathered.narrow(0, rank * self.slot_bytes, self.slot_bytes)
            for p in pieces:
                target = out.narrow(0, self.plan.offsets[p.index] + p.start, p.numel)
                if not p.fp8:
                    target.copy_(slot.narrow(0, p.byte_offset, p.numel * hp_size).view(self.hp_dtype))
                    continue
                q = self._matrix(slot.narrow(0, p.byte_offset, p.numel).view(FP8_DTYPE), p)
                s = slot.narrow(0, p.scale_byte_offset, 4 * p.n_scales).view(torch.float32).view(self._scale_grid(p))
                target.copy_(dequantize_tiles(q, s, self.tile, out.dtype).view(-1))
