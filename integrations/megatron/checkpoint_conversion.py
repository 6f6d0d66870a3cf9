"""Megatron ``torch_dist`` checkpoints into a whole-tensor vescale-zero checkpoint, offline.

    vescale-zero convert --from megatron SAVE_DIR DST [--iteration N] [--layer-spec local|te] [--weights-only]

Megatron's dist-checkpoint (DCP underneath) stores each tensor *globally*, under the key
its ``sharded_state_dict`` gives it: whole across tensor parallelism, and with the layers
of every pipeline stage (and the experts of every EP rank) stacked along leading axes.
Read with DCP's own reader in one process, those global tensors are exactly the
tensors of the same model at TP = PP = EP = 1, once unstacked and renamed::

    checkpoint key (global shape)
        -> name at tp1 x pp1
    decoder.layers.self_attention.linear_qkv.weight  [L, 3h, h]
        -> decoder.layers.{i}.self_attention.linear_qkv.weight
    decoder.layers.self_attention.linear_qkv.layer_norm_weight  [L, h]
        -> decoder.layers.{i}.input_layernorm.weight (local spec)
    decoder.layers.mlp.experts.experts.linear_fc1.weight  [L, E, f, h]
        -> decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight
    optimizer.state.exp_avg.<key>  (also chained_<k>.optimizer...)     -> "<name>::exp_avg", likewise exp_avg_sq
    optimizer.state.fp32_param.<key> / .param.<key>  (fp32 masters)     -> the weight itself, in place of the bf16 one

The result (:func:`vescale_zero.hosts.write_whole`) carries those names, so
``vescale-zero consolidate`` turns it into a plain state dict of the tp1 x pp1 model, and
:func:`vescale_zero.checkpoint.load` loads it into ``RaggedFSDP`` (or ``fully_shard``) at
TP = PP = EP = 1 and any data-parallel size. At another model-parallel layout, load the
Megatron checkpoint itself: ``RaggedFSDP`` reads ``torch_dist`` through Megatron's loader.

[Note: layer specs] Megatron names a checkpoint's keys by the transformer-engine spec.
The local spec maps its module names onto those (its ``sharded_state_dict_keys_map``, e.g.
``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``); ``--layer-spec local``
undoes that map, read from megatron-core's own spec; ``--layer-spec te`` keeps the keys.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from vescale_zero.hosts import CheckpointError, read_dcp, write_whole

from .megatron_compat import common_state

__all__ = ["from_megatron", "megatron_iteration_dir", "LAYER_SPECS"]

LAYER_SPECS = ("local", "te")
_LAYERS = "decoder.layers."
_STACKED_EXPERTS = "mlp.experts.experts."
_OPTIMIZER_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(\w+)\.(.+)$")
_MASTERS = ("fp32_param", "param")
"""Where Megatron keeps fp32 master weights: its mixed-precision optimizer, and its
distributed optimizer's model-space format."""


def megatron_iteration_dir(src: str, iteration: Optional[int] = None) -> str:
    """The checkpoint directory under a Megatron-LM ``--save`` directory: ``iter_NNNNNNN``
    of ``iteration`` or of ``latest_checkpointed_iteration.txt``; ``src`` itself if it
    is one."""
    if iteration is not None:
        path = os.path.join(src, f"iter_{iteration:07d}")
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} does not exist: no checkpoint of iteration {iteration} under {src}")
        return path
    tracker = os.path.join(src, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as f:
            latest = f.read().strip()
        return os.path.join(src, "release" if latest == "release" else f"iter_{int(latest):07d}")
    return src


def _check_torch_dist(path: str) -> None:
    if not os.path.isdir(path):
        raise CheckpointError(f"no Megatron checkpoint at {path!r}")
    if any(n.startswith("mp_rank_") for n in os.listdir(path)):
        raise CheckpointError(
            f"{path} is a legacy Megatron checkpoint (--ckpt-format torch: one file per TP/PP rank), whose tensors "
            "only the model can merge. Re-save it as torch_dist with Megatron-LM (--load it with --ckpt-format torch "
            "--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR) and convert that, or load it online with "
            "--use-vescale-fsdp at its own layout"
        )
    meta = os.path.join(path, "metadata.json")
    backend = None
    if os.path.isfile(meta):
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist" or not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"{path} is not a Megatron torch_dist checkpoint (its metadata.json names backend {backend!r}); "
            "give the --save directory of a Megatron-LM job or one of its iter_NNNNNNN directories"
        )


def _inverse_keys_map(layer_spec: str) -> Dict[str, str]:
    """Checkpoint-key prefix -> module-name prefix of the layer spec (see [Note: layer specs])."""
    if layer_spec == "te":
        return {}
    if layer_spec != "local":
        raise CheckpointError(f"--layer-spec {layer_spec!r}: choose one of {', '.join(LAYER_SPECS)}")
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    except ImportError as e:
        raise CheckpointError(f"--layer-spec local reads the local spec's key map from megatron-core, which does not "
                              f"import here ({e}); install megatron-core, or pass --layer-spec te") from None
    keys_map = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    return {ckpt: module for module, ckpt in keys_map.items()}


def _rename(rest: str, inverse: Dict[str, str]) -> str:
    for ckpt, module in inverse.items():
        if rest.startswith(ckpt):
            return module + rest[len(ckpt):]
    return rest


def _is_stacked(key: str) -> bool:
    """Whether ``key`` holds every layer along a leading axis (not when saved with
    singleton_local_shards, whose keys carry the layer number)."""
    return key.startswith(_LAYERS) and not key[len(_LAYERS):].split(".", 1)[0].isdigit()


def _unstack(key: str, tensor: torch.Tensor, inverse: Dict[str, str],
             layer_spec: str) -> List[Tuple[str, torch.Tensor]]:
    """The tp1 x pp1 names and tensors of one checkpoint key (see the module doc)."""
    if not _is_stacked(key):
        return [(key, tensor)]
    rest = key[len(_LAYERS):]
    out = []
    for i, layer in enumerate(tensor.unbind(0)):
        if rest.startswith(_STACKED_EXPERTS):
            if layer_spec != "local":
                raise CheckpointError(
                    f"{key}: stacked experts are named per expert by the local spec's SequentialMLP "
                    "(local_experts.<j>.); with --layer-spec te they may be a TEGroupedMLP, which this converter "
                    "does not name. Convert with --layer-spec local if the model uses SequentialMLP, or load the "
                    "Megatron checkpoint online with --use-vescale-fsdp"
                )
            tail = rest[len(_STACKED_EXPERTS):]
            out += [(f"{_LAYERS}{i}.mlp.experts.local_experts.{j}.{tail}", expert)
                    for j, expert in enumerate(layer.unbind(0))]
        else:
            out.append((f"{_LAYERS}{i}.{_rename(rest, inverse)}", layer))
    return out


def _common_steps(common: Any) -> List[Any]:
    """Every optimizer step in the common state's optimizer part: ``state.common_step`` (nested
    under chained and mixed-precision optimizers), or the distributed optimizer's
    ``param_groups[i]["step"]``."""
    found: List[Any] = []
    if isinstance(common, dict):
        state = common.get("state")
        if isinstance(state, dict) and "common_step" in state:
            found.append(state["common_step"])
        groups = common.get("param_groups")
        if isinstance(groups, list):
            found += [g["step"] for g in groups if isinstance(g, dict) and "step" in g]
        for key, value in common.items():
            if key != "param_groups":
                found += _common_steps(value)
    elif isinstance(common, (list, tuple)):
        for value in common:
            found += _common_steps(value)
    return found


def from_megatron(src: str, dst: str, iteration: Optional[int] = None, layer_spec: str = "local",
                  weights_only: bool = False) -> None:
    """Convert a Megatron ``torch_dist`` checkpoint (see the module doc)."""
    path = megatron_iteration_dir(src, iteration)
    _check_torch_dist(path)
    inverse = _inverse_keys_map(layer_spec)
    state = read_dcp(path)
    common = common_state(path, state)  # common.pt, or inside the DCP files: [Note: one door to Megatron's releases]
    model: Dict[str, torch.Tensor] = {}
    optim: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue  # Megatron's sharded objects: _extra_state, rng state
        match = _OPTIMIZER_KEY.match(key)
        if match:
            optim.setdefault(match.group(2), {})[match.group(1)] = value
        elif "optimizer." in key:
            if weights_only:
                continue
            raise CheckpointError(
                f"{path}: optimizer tensor {key!r} is not in Megatron's model space (optimizer.state.<name>.<key>): "
                "the distributed optimizer's dp_reshardable layout, by gradient buckets. Re-save it once with "
                "Megatron-LM's --dist-ckpt-optim-fully-reshardable, or convert with --weights-only"
            )
        else:
            model[key] = value
    for key in optim:
        if key not in model:
            raise CheckpointError(f"{path}: optimizer state for {key!r}, which is not a tensor of the model")

    names: Dict[str, torch.Tensor] = {}
    state_of: Dict[str, Dict[str, Any]] = {}
    steps = _common_steps(common.get("optimizer")) if isinstance(common, dict) else []
    layers = {t.shape[0] for k, t in model.items() if _is_stacked(k)}
    if len(layers) > 1:
        raise CheckpointError(f"{path}: the stacked layer tensors disagree on the number of layers ({sorted(layers)})")
    for key, weight in model.items():
        saved = optim.get(key, {})
        master = next((saved[m] for m in _MASTERS if m in saved), None)
        if master is not None and master.shape != weight.shape:
            raise CheckpointError(f"{path}: the fp32 master of {key!r} has shape {tuple(master.shape)}, "
                                  f"the weight {tuple(weight.shape)}")
        pieces = dict(_unstack(key, master if master is not None else weight, inverse, layer_spec))
        names.update(pieces)
        moments = {k: v for k, v in saved.items() if k not in _MASTERS}
        if weights_only or not moments:
            continue
        if not steps:
            raise CheckpointError(f"{path}: its common state holds no optimizer step (state.common_step); "
                                  "convert with --weights-only")
        split = {k: dict(_unstack(key, v, inverse, layer_spec)) for k, v in moments.items()}
        for name in pieces:
            state_of[name] = {k: split[k][name] for k in split}
            state_of[name]["step"] = torch.as_tensor(steps[0]).float().reshape(())
    kept = ("iteration", "checkpoint_version", "opt_param_scheduler", "num_floating_point_operations_so_far")
    megatron = {k: common[k] for k in kept if isinstance(common, dict) and k in common}
    write_whole(dst, names, None if weights_only else state_of, None,
                extra={"converted_from": "megatron", "source": os.path.abspath(path), "layer_spec": layer_spec,
                       "megatron": megatron})
