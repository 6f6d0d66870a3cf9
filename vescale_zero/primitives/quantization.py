"""Block-wise 8-bit quantization of flat tensors with the dynamic map of Dettmers et al.

::

    x (flat)   | block 0 (N) | block 1 (N) | ... | last (<= N) |
    absmax[b] = max |x| over block b                       (one fp32 per block)
    code[i]   = index of the map value nearest x[i] / absmax[b]   (uint8, 256 values)
    x'[i]     = map[code[i]] * absmax[b]

The map is the *dynamic* (dynamic-tree) 8-bit data type of Dettmers, "8-bit Approximations
for Parallelism in Deep Learning" (2015), used block-wise by Dettmers et al., "8-bit
Optimizers via Block-wise Quantization" (2022) and by bitsandbytes / torchao's 8-bit
optimizers. It is non-linear: it resolves values from 1 down to ~1e-6 of the block's absmax
with a roughly constant *relative* step, where linear absmax codes (step absmax/127) flush
every element below absmax/254 to zero.

[Note: the dynamic map]
A code's bits, after an optional sign bit: ``e`` zero bits give the decimal exponent
(magnitude in ``[0.1, 1] * 10**-e``), then one indicator bit ``1``, then the remaining bits are a
linear fraction: ``2**k`` equal bins of ``[0.1, 1]``, the value being each bin's centre. With 8
bits and exponents ``e = 0 .. 6``:

* signed: 7 bits after the sign; exponent ``e`` leaves ``6 - e`` fraction bits, so
  ``64 + 32 + ... + 1 = 127`` magnitudes, each with both signs (254 values), plus 0 (all bits
  zero) and 1.0 (the pattern that would be -0) = 256. The map is symmetric except for 1.0:
  ``-1`` is not a code (the most negative value is about -0.993).
* unsigned: the sign bit becomes one more fraction bit: ``128 + 64 + ... + 2 = 254``
  magnitudes, plus 0 and 1.0 = 256.

The values are sorted ascending and a code is the value's index, so both maps store uint8.
Rounding is to the nearest value (ties to the lower one): the boundaries are the midpoints
of neighbouring values ([Note: nearest code by table]).

[Note: blocks and RaggedShard]
Blocks are counted from the start of the tensor. A rank that holds a RaggedShard piece
whose start is a multiple of N (the planner keeps blocks of N whole) quantizes exactly
the blocks the unsharded tensor would have, so its bytes are the same.

[Note: no host sync] Nothing here reads a device value on the host (no ``.item()``, no
``bool(tensor)``): the unsigned map is for non-negative inputs and is not checked (a check
would stall the host on every optimizer step); a negative value gets code 0 (value 0).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["dynamic_map", "quantize_blockwise", "dequantize_blockwise"]

_EXPONENTS = 7  # decimal exponents 0 .. 6 below the block's absmax: magnitudes down to 1e-7

_MAPS: Dict[Tuple[bool, torch.device], torch.Tensor] = {}
_TABLES: Dict[Tuple[bool, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}

_CELL_SHIFT = 15  # a cell: the fp32 values sharing sign, exponent and the top 8 mantissa bits


def _build_map(signed: bool) -> torch.Tensor:
    """The 256 values of [Note: the dynamic map], ascending, fp32, built on the host (``device="cpu"``
    given: a default device, e.g. ``meta`` or an accelerator, must not move the construction)."""
    fraction_bits = 8 - (1 if signed else 0) - 1  # bits after the sign and the indicator, at exponent 0
    values = [0.0, 1.0]
    for e in range(_EXPONENTS):
        bins = 2 ** (fraction_bits - e)
        edges = torch.linspace(0.1, 1.0, bins + 1, dtype=torch.float32, device="cpu")
        # fp32 throughout (the centres, and their product with 10**-e rounded to fp32), as
        # bitsandbytes builds it: the same 256 fp32 values bit for bit.
        centres = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (-e)
        values += centres.tolist()
        if signed:
            values += (-centres).tolist()
    if len(values) != 256:  # a miscount of the bit patterns above, not a user error
        raise AssertionError(f"the dynamic map has {len(values)} values, not 256")
    return torch.tensor(sorted(values), dtype=torch.float32, device="cpu")


def _build_table(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(first, bounds)`` for rounding to the nearest of ``values`` without a search.

    [Note: nearest code by table] ``bounds`` are the 255 midpoints of neighbouring values
    (+inf appended), and the nearest code of ``x`` is the number of bounds below ``x`` (ties go
    to the lower code). An fp32 ``x``'s top 17 bits (sign, exponent, 8 mantissa bits) name its
    *cell*: all floats with those bits, an interval at most 2**-8 of its magnitude wide. The
    map's neighbouring values are at least 0.7% of their magnitude apart, so no cell holds two
    bounds (checked here). ``first[cell]`` is the code of the cell's smallest value; a value of
    the cell is past at most ``bounds[first[cell]]``: ``code = first + (x > bounds[first])``,
    the same codes as a binary search over the bounds, with two gathers instead of eight steps.
    """
    bounds = (values[:-1] + values[1:]) / 2
    cells = torch.arange(1 << (32 - _CELL_SHIFT), dtype=torch.int64, device="cpu")
    lowest = (cells << _CELL_SHIFT).to(torch.int32)  # positive cells: their smallest value
    lowest = torch.where(cells >= 1 << (31 - _CELL_SHIFT), lowest | ((1 << _CELL_SHIFT) - 1), lowest)  # negative
    lowest = lowest.view(torch.float32).nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0).clamp(-1.0, 1.0)
    first = torch.bucketize(lowest, bounds)
    bound_cells = (bounds.view(torch.int32).to(torch.int64) >> _CELL_SHIFT) & ((1 << (32 - _CELL_SHIFT)) - 1)
    if bound_cells.unique().numel() != bound_cells.numel():
        raise AssertionError("two bounds of the dynamic map share a cell; see [Note: nearest code by table]")
    return first.to(torch.uint8), torch.cat([bounds, torch.tensor([float("inf")], device="cpu")])


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256-value dynamic quantization map (see [Note: the dynamic map]) on ``device``,
    ascending; made once per device and cached (a step does not copy it host to device)."""
    key = (bool(signed), torch.device(device))
    out = _MAPS.get(key)
    if out is None:
        host = _build_map(signed)
        out = _MAPS[key] = host.to(key[1])
        _TABLES[key] = tuple(t.to(key[1]) for t in _build_table(host))  # type: ignore[assignment]
    return out


def _nearest_codes(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 index of the map value nearest each element of fp32 ``scaled`` (in [-1, 1])."""
    key = (bool(signed), scaled.device)
    if key not in _TABLES:
        dynamic_map(signed, scaled.device)
    first, bounds = _TABLES[key]
    cell = (scaled.reshape(-1).view(torch.int32) >> _CELL_SHIFT) & ((1 << (32 - _CELL_SHIFT)) - 1)
    lo = first.index_select(0, cell)  # index_select with int32 indices: several times faster than t[idx]
    up = scaled.reshape(-1) > bounds.index_select(0, lo.to(torch.int32))
    return lo.add_(up).view(scaled.shape)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.numel() % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block)


def quantize_blockwise(x: torch.Tensor, block: int, signed: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)``: uint8 indices into :func:`dynamic_map` (``signed`` or not) of
    each element of ``x`` (flattened) divided by its block's absmax, and the fp32 absmax of
    each block of ``block`` elements (the last block may be shorter)."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not x.is_floating_point() or x.dtype == torch.float64 or x.is_complex():
        raise TypeError(
            f"block-wise 8-bit quantization takes fp32/bf16/fp16 tensors, got {x.dtype}; cast to float32 first"
        )
    flat = _blocks(x.detach().reshape(-1).float(), block)
    absmax = flat.abs().amax(dim=1)
    # A block of zeros has absmax 0: scale by 1 instead, so every element gets the code of 0.
    # Scaled by the reciprocal (as bitsandbytes' kernels do), which can round past 1: clamp.
    inv = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).reciprocal()
    scaled = (flat * inv[:, None]).clamp_(-1.0, 1.0)
    codes = _nearest_codes(scaled, signed)
    return codes.reshape(-1)[: x.numel()], absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, block: int, signed: bool = True) -> torch.Tensor:
    """fp32 values of ``codes`` (flat uint8, from :func:`quantize_blockwise` with the same
    ``signed``) with one absmax per block."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8 indices into the dynamic map, got {codes.dtype}")
    values = dynamic_map(signed, codes.device).index_select(0, codes.reshape(-1).to(torch.int32))
    return (_blocks(values, block) * absmax[:, None]).reshape(-1)[: codes.numel()]
