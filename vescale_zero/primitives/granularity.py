"""Granularity policies: how a user names each parameter's atomic block size.

A policy is one of

* ``None``                      -- the default, ``"element"`` (the least padding);
* an ``int``                    -- the same block size, in elements, for every parameter;
* a preset ``str``              -- ``"element"``, ``"row"`` or ``"<N>rows"`` (e.g. ``"128rows"``);
* a ``Mapping[name, int | str]`` -- per parameter (names relative to the sharded module);
  parameters it does not name get the default;
* a ``Callable[[name, param], int | str]``.

[Note: "N rows" on a tensor whose dim 0 is not a multiple of N]
A preset must apply to every parameter of a module, including awkward ones (a
LayerNorm of 37 elements, a vocabulary of 50257 rows). ``"<N>rows"`` therefore means
*at most* N rows: the largest divisor of ``shape[0]`` that is <= N, so that blocks tile
the tensor exactly. An explicit ``int`` is never adjusted: it must divide the numel.
For 0-d and 1-d tensors a "row" is one element. Where that gives fewer rows than asked
(and fewer than the tensor has), :func:`resolve_granularities` warns, naming each such
tensor and the rows it got (:func:`rows_short_of_preset`), and ``vescale-zero plan`` says
so under its header: the name "3rows" never silently stands for 1 row.
"""

from __future__ import annotations

import re
import warnings
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Tuple, Union

import torch

__all__ = ["GranularityPolicy", "PRESETS", "row_numel", "preset_granularity", "resolve_granularities",
           "rows_short_of_preset", "describe_rows_short"]

GranularitySpec = Union[int, str]
GranularityPolicy = Union[
    None, GranularitySpec, Mapping[str, GranularitySpec], Callable[[str, torch.Tensor], GranularitySpec]
]
PRESETS = ("element", "row", "<N>rows")
_NROWS = re.compile(r"^\s*(\d+)\s*-?\s*rows?\s*$")


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row (1 for 0-d and 1-d tensors)."""
    n = 1
    for d in tuple(shape)[1:]:
        n *= int(d)
    return n


def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1


def preset_granularity(shape: Sequence[int], preset: str) -> int:
    """Block size in elements of ``preset`` for a tensor of ``shape``."""
    shape = tuple(int(d) for d in shape)
    key = preset.strip().lower()
    if key == "element":
        return 1
    rows = shape[0] if len(shape) >= 1 else 1
    if key == "row":
        return row_numel(shape)
    match = _NROWS.match(key)
    if match is None:
        raise ValueError(
            f"unknown granularity preset {preset!r}; valid presets: 'element', 'row', '<N>rows' (e.g. '16rows')"
        )
    n = int(match.group(1))
    if n < 1:
        raise ValueError(f"granularity preset {preset!r}: N must be >= 1")
    return _largest_divisor_at_most(rows, n) * row_numel(shape) if rows else 1


def rows_short_of_preset(
    named_shapes: Iterable[Tuple[str, Sequence[int]]], preset: str
) -> List[Tuple[str, Tuple[int, ...], int]]:
    """``(name, shape, rows used)`` for each tensor that ``"<N>rows"`` gives fewer rows per
    block than both N and its own row count (N does not divide ``shape[0]``); empty for
    other presets. A tensor of fewer than N rows is one block: not short."""
    match = _NROWS.match(preset.strip().lower()) if isinstance(preset, str) else None
    if match is None:
        return []
    n = int(match.group(1))
    out = []
    for name, shape in named_shapes:
        shape = tuple(int(d) for d in shape)
        rows = shape[0] if shape else 1
        used = _largest_divisor_at_most(rows, n) if rows else 0
        if rows and used < min(n, rows):
            out.append((name, shape, used))
    return out


def describe_rows_short(preset: str, short: List[Tuple[str, Tuple[int, ...], int]], total: int) -> str:
    """One sentence on :func:`rows_short_of_preset`'s result (at most 5 tensors named)."""
    named = ", ".join(f"{name} {list(shape)}: {used} row{'s' if used != 1 else ''}" for name, shape, used in short[:5])
    more = f" and {len(short) - 5} more" if len(short) > 5 else ""
    match = _NROWS.match(preset.strip().lower())
    n = match.group(1) if match else "N"
    return (f"granularity {preset!r} is at most {n} rows per block "
            f"(the largest divisor of the row count): {len(short)} of {total} tensors get fewer ({named}{more}); "
            f"choose a row count that divides theirs, or 'row', for exact blocks")


def _sample_divisors(n: int, limit: int = 8) -> List[int]:
    small = [d for d in range(1, min(n, 10_000) + 1) if n % d == 0]
    return small[:limit]


def _check(name: str, shape: Tuple[int, ...], numel: int, g: object) -> int:
    if isinstance(g, bool) or not isinstance(g, int):
        raise TypeError(f"granularity for parameter {name!r} must be an int or a preset string, got {g!r}")
    if numel == 0:
        return 1
    if g < 1 or numel % g:
        row = row_numel(shape)
        raise ValueError(
            f"granularity {g} for parameter {name!r} of shape {tuple(shape)} (numel {numel}) "
            f"{'must be >= 1' if g < 1 else 'does not divide its numel, so a block would be split'}. "
            f"Valid choices: 'element' (1), 'row' ({row}), '<N>rows' (N*{row} for N dividing "
            f"{shape[0] if shape else 1}), or any divisor of {numel}, e.g. {_sample_divisors(numel)}."
        )
    return g


def resolve_granularities(
    named_params: Iterable[Tuple[str, torch.Tensor]], policy: GranularityPolicy
) -> List[int]:
    """Block size in elements for each ``(name, param)``, validated (see module docstring)."""
    named_params = list(named_params)
    if isinstance(policy, Mapping):
        unknown = sorted(set(policy) - {n for n, _ in named_params})
        if unknown:
            raise KeyError(
                f"granularity mapping names {unknown}, which are not parameters of this group; "
                f"valid names: {[n for n, _ in named_params]}"
            )
    out = []
    short: Dict[str, List[Tuple[str, Tuple[int, ...], int]]] = {}
    for name, param in named_params:
        if policy is None:
            spec: object = "element"
        elif isinstance(policy, Mapping):
            spec = policy.get(name, "element")
        elif callable(policy):
            spec = policy(name, param)
        else:
            spec = policy
        if isinstance(spec, str):
            short.setdefault(spec, []).extend(rows_short_of_preset([(name, param.shape)], spec))
            spec = preset_granularity(param.shape, spec)
        out.append(_check(name, tuple(param.shape), param.numel(), spec))
    for preset, tensors in short.items():
        if tensors:
            warnings.warn(describe_rows_short(preset, tensors, len(named_params)), UserWarning, stacklevel=3)
    return out
