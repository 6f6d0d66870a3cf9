"""Full (unsharded) state dicts of a ``fully_shard``-ed module, for interchange.

A full state dict has the keys and shapes of the unsharded module's ``state_dict()``,
so it is interchangeable with checkpoints of DDP, Megatron's DDP or an unsharded model::

    rank k:   master.local = [ piece of a | piece of b ]      (a sharded group)
    gather:   [ a (full) | b (full) | pad ]  one all-gather of the master shards
    keys:     {"layer.a": a.view(shape_a), "layer.b": b.view(shape_b), ...}

``load_full_state_dict`` goes the other way without communication: each rank copies
the flat range it owns of every tensor into its master shard.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from torch import nn

from .collectives import all_gather
from .fully_shard import groups_of
from .param_group import GroupState, ParamGroup

__all__ = ["full_state_dict", "load_full_state_dict"]


def _managed_index(module: nn.Module) -> Dict[int, Tuple[ParamGroup, int]]:
    """id(parameter object) -> (group, index) for sharded and unsharded parameters."""
    index: Dict[int, Tuple[ParamGroup, int]] = {}
    for group in groups_of(module):
        for i in range(len(group.managed)):
            index[id(group.sharded_params[i])] = (group, i)
            index[id(group.unsharded_params[i])] = (group, i)
    return index


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The module's ``state_dict()`` with every sharded parameter gathered to its full shape.

    Collective: every rank of every group under ``module`` must call it. Each group costs
    one all-gather of its master shards; the full tensors of a group share one buffer.
    """
    state = module.state_dict(keep_vars=True)
    index = _managed_index(module)
    gathered: Dict[int, torch.Tensor] = {}
    for group in groups_of(module):
        flat = torch.empty(group.plan.global_size, dtype=group.orig_dtype, device=group.device)
        all_gather(flat, group.master.local, group.process_group)
        for i, (spec, off) in enumerate(zip(group.plan.specs, group.plan.offsets)):
            gathered[id(group.sharded_params[i])] = flat.narrow(0, off, spec.numel).view(group.managed[i].shape)
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        hit = index.get(id(value))
        if hit is not None:
            group, i = hit
            out[key] = gathered[id(group.sharded_params[i])]
        else:
            out[key] = value.detach() if torch.is_tensor(value) else value
    return out


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full state dict (see :func:`full_state_dict`) into a sharded module.

    Every rank needs the whole ``state_dict`` (it reads only its own ranges); no
    communication. With ``strict``, missing or unexpected keys raise ``KeyError`` naming
    them; a tensor of the wrong shape always raises ``ValueError``.
    """
    current = module.state_dict(keep_vars=True)
    index = _managed_index(module)
    missing = sorted(set(current) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(current))
    if strict and (missing or unexpected):
        raise KeyError(
            f"state dict does not match the model: missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}; pass strict=False to load the "
            "common keys only, or check that the checkpoint was saved from the same model"
        )
    rest: Dict[str, torch.Tensor] = {}
    done: List[Tuple[ParamGroup, int]] = []
    with torch.no_grad():
        for key, value in state_dict.items():
            if key not in current:
                continue
            hit = index.get(id(current[key]))
            if hit is None:
                rest[key] = value
                continue
            group, i = hit
            shape = tuple(group.managed[i].shape)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{key!r}: the state dict holds shape {tuple(value.shape)}, the model {shape}; "
                    "a full state dict must come from the same model (same tensor/pipeline-parallel layout)"
                )
            if (group, i) in done:  # a tied parameter under a second name
                continue
            start, end = group.master.local_range(i)
            group.master.local_view(i).copy_(value.detach().reshape(-1)[start:end])
            done.append((group, i))
    if rest:
        module.load_state_dict(rest, strict=False)
    for group in groups_of(module):
        if group.state is not GroupState.SHARDED:
            group.reshard()  # drop full parameters gathered before the load
