"""Convert PyTorch FSDP2 (DCP) checkpoints into ours, offline (no process group needed).

    vescale-zero convert --from fsdp2 SRC DST            # a DCP directory (PyTorch FSDP2)

DeepSpeed's and Megatron's checkpoints are host-specific: their converters live with their
adapters (``vescale_zero.integrations.deepspeed.checkpoint_conversion``,
``vescale_zero.integrations.megatron.checkpoint_conversion``) and write the same format.

The result is an ordinary :mod:`vescale_zero.checkpoint` written as if by one rank that
holds every tensor whole::

    DST/metadata.json   world_size 1
    DST/common.pt       optimizer hyper-parameters (one dict per param group), extra
    DST/rank00000.pt    {name: (shape, 0, numel, flat values)} for every model tensor and
                        every per-element optimizer state ("name::exp_avg"), steps

Pieces are flat ranges, so :func:`vescale_zero.checkpoint.load` cuts this one-rank
checkpoint to any world size and granularity like any other. Tensors that are not
parameters of the loading model (its buffers) are found by name among the pieces.

[Note: sources]
* FSDP2 / DCP: what ``dcp.save`` wrote for ``{"model": get_model_state_dict(...), "optim":
  get_optimizer_state_dict(...)}`` (the torchtitan layout, also with ``"optimizer"``, or a
  bare model state dict; optimizer state nested or flattened). DCP's own reader gathers
  every tensor whole in this process (as ``dcp_to_torch_save`` does).
* DeepSpeed (stage 0-3, any world size): fp32 weights from DeepSpeed's ``zero_to_fp32``;
  Adam's moments (and step) and the optimizer's hyper-parameters from DeepSpeed's
  universal-checkpoint conversion (``ds_to_universal``); the engine's counters and client state
  as ``extra``. A universal checkpoint (``ds_to_universal``'s output) is read directly
  (``integrations/deepspeed/checkpoint_conversion.py``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .format import CheckpointError, is_dcp_checkpoint, read_dcp, write_whole

__all__ = ["from_fsdp2"]


# ---- FSDP2 / DCP ----------------------------------------------------------------------


def _split_fsdp2(state: Dict[str, Any], src: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """(model state dict, optimizer state dict or None) of a loaded DCP checkpoint."""
    model = next((state[k] for k in ("model", "module") if isinstance(state.get(k), dict)), None)
    optim = next((state[k] for k in ("optim", "optimizer") if isinstance(state.get(k), dict)), None)
    if model is None and state and all(torch.is_tensor(v) for v in state.values()):
        model = state
    if model is None:
        raise CheckpointError(
            f"{src}: no model state dict found (top-level keys {sorted(state)[:8]}); expected the layout of "
            'dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)})'
        )
    return {k: v for k, v in model.items() if torch.is_tensor(v)}, optim


def _fsdp2_optimizer(optim: Dict[str, Any], names: List[str],
                    src: str) -> Tuple[Dict[str, Dict[str, Any]], List[Dict[str, Any]]]:
    """Per-parameter state and hyper-parameters from ``get_optimizer_state_dict``'s output,
    nested (``{"state": {fqn: {...}}, "param_groups": [...]}``) or flattened
    (``{"state.fqn.exp_avg": t, "param_groups.fqn.lr": 0.1}``)."""
    if "state" in optim and "param_groups" in optim:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
        return {fqn: dict(s) for fqn, s in optim["state"].items()}, groups
    by_length = sorted(names, key=len, reverse=True)
    state: Dict[str, Dict[str, Any]] = {}
    group_of: Dict[str, Dict[str, Any]] = {}
    for key, value in optim.items():
        section, _, rest = key.partition(".")
        fqn = next((n for n in by_length if rest.startswith(n + ".")), None)
        if section not in ("state", "param_groups") or fqn is None:
            raise CheckpointError(f"{src}: optimizer entry {key!r} names no parameter of the model state dict")
        (state if section == "state" else group_of).setdefault(fqn, {})[rest[len(fqn) + 1 :]] = value
    groups: List[Dict[str, Any]] = []
    for fqn in names:  # groups in first-appearance order of their parameters
        hp = {k: v for k, v in group_of.get(fqn, {}).items() if k != "params"}
        if hp and hp not in groups:
            groups.append(hp)
    return state, groups


def from_fsdp2(src: str, dst: str, weights_only: bool = False) -> None:
    """Convert a DCP checkpoint written under PyTorch FSDP2 (see [Note: sources])."""
    if not is_dcp_checkpoint(src):
        raise CheckpointError(f"{src} is not a DCP checkpoint (no .metadata file)")
    tensors, optim = _split_fsdp2(read_dcp(src), src)
    state, groups = (None, None) if weights_only or optim is None else _fsdp2_optimizer(optim, list(tensors), src)
    write_whole(dst, tensors, state, groups, extra={"converted_from": "fsdp2", "source": os.path.abspath(src)})
