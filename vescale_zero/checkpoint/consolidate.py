"""Offline: turn a sharded checkpoint into one full state dict (no process group needed).

    vescale-zero consolidate CKPT model.pt [--optimizer]

Every name's pieces (flat ranges from every rank file) are joined into the full tensor
of its saved shape; buffers come from rank 0's file. The checksums are verified first, and
a name whose pieces do not cover the whole tensor is refused, naming it. Names carry the
checkpoint domain of integrations that set one (``"tp1-pp0/module.decoder..."``, see
:mod:`vescale_zero.checkpoint.format` [Note: domains]); their tensors are the slices of
that domain, as the host saved them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from .format import Piece, entries, fill, read_common, read_metadata, read_rank_file, written_ranks

__all__ = ["consolidate"]


def _join(pieces: Dict[str, List[Piece]]) -> Dict[str, torch.Tensor]:
    out = {}
    for name, saved in pieces.items():
        shape = tuple(saved[0][0])
        full = torch.empty(math.prod(shape), dtype=saved[0][3].dtype, device="cpu")
        fill(full, 0, full.numel(), saved, name)
        out[name] = full.view(shape)
    return out


def consolidate(path: str, with_optimizer: bool = False, exclude_frozen: bool = False) -> Dict[str, Any]:
    """The full state dict of the model saved at ``path`` (parameters and buffers); with
    ``with_optimizer``, also every per-element optimizer state as ``"name::key"`` (full
    shape) and every per-block one (8-bit scales, Shampoo blocks) with all its blocks; with
    ``exclude_frozen``, without the parameters that did not require grad (a checkpoint saved
    with ``exclude_frozen`` holds none of them anyway)."""
    meta = read_metadata(path)
    files = [read_rank_file(path, r, meta["sha256"][r]) for r in written_ranks(meta)]
    params: Dict[str, List[Piece]] = {}
    states: Dict[str, List[Piece]] = {}
    blocks: Dict[str, List[Piece]] = {}
    for f in files:
        for key, piece in f.get("optim_blocks", {}).items():
            blocks.setdefault(key, []).append(piece)
        for key, piece in f["params"].items():
            params.setdefault(key, []).append(piece)
        for key, piece in f["optim_states"].items():
            states.setdefault(key, []).append(piece)
    common = read_common(path, meta)
    frozen = set(common.get("frozen", ())) if exclude_frozen else set()
    out = _join({name: saved for name, saved in params.items() if name not in frozen})
    for saved, others in common.get("aliases", {}).items():  # tied parameters, under every name
        for name in others:
            if saved in out:  # not a frozen parameter left out
                out[name] = out[saved]
    out.update(common["buffers"])
    if with_optimizer:
        if common["optim_groups"] is None and not states and not blocks:
            raise ValueError(f"{path} holds no optimizer state (saved without an optimizer); drop --optimizer")
        out.update(_join(states))
        out.update({key: entries(0, saved[0][0][0], saved, key) for key, saved in blocks.items()})
    return out
