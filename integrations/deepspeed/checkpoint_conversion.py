"""DeepSpeed checkpoints into a whole-tensor vescale-zero checkpoint, offline (no process group needed).

    vescale-zero convert --from deepspeed SRC DST [--tag global_step100] [--weights-only]

What is read from a DeepSpeed checkpoint: ``vescale_zero/checkpoint/convert.py`` [Note: sources].
The result is an ordinary :mod:`vescale_zero.checkpoint` written as if by one rank that holds
every tensor whole (:func:`vescale_zero.hosts.write_whole`).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

from vescale_zero.hosts import CheckpointError, latest_tag, write_whole

__all__ = ["from_deepspeed", "is_deepspeed_checkpoint", "is_deepspeed_universal", "deepspeed_model_states"]

_DS_MODEL_STATES = "mp_rank_00_model_states.pt"


def deepspeed_model_states(path: str) -> Optional[str]:
    """The model-states file of a DeepSpeed checkpoint directory (stage 3 writes one per
    rank; rank 0's has the counters), or ``None`` if ``path`` is not one."""
    if os.path.exists(os.path.join(path, "metadata.json")):
        return None
    for name in (_DS_MODEL_STATES, "zero_pp_rank_0_" + _DS_MODEL_STATES):
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    return None


def is_deepspeed_checkpoint(path: str) -> bool:
    return deepspeed_model_states(path) is not None


def _deepspeed_universal(load_dir: str, tag: str, out: str) -> None:
    import deepspeed.checkpoint.ds_to_universal as ds_to_universal

    ds_to_universal.main(argparse.Namespace(
        input_folder=os.path.join(load_dir, tag), output_folder=out, num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=True))


def _universal_adam_state(universal: str, shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Dict[str, Any]]:
    """Adam's ``exp_avg`` / ``exp_avg_sq`` / ``step`` per parameter from a universal checkpoint."""
    zero = os.path.join(universal, "zero")
    steps = [os.path.join(zero, n, "step.pt") for n in sorted(os.listdir(zero))]
    steps = [f for f in steps if os.path.exists(f)]
    # DeepSpeed keeps one step per parameter group; some conversions write it for some
    # parameters only, so the first one found stands in for a missing one. Stage 3's
    # conversion writes none: its step is only in zero/optimizer_state.pt, where
    # DeepSpeed's own stage-3 universal loader reads it (state[0]["step"]).
    if steps:
        common_step = torch.load(steps[0], map_location="cpu", weights_only=False)
    else:
        common = torch.load(os.path.join(zero, "optimizer_state.pt"), map_location="cpu", weights_only=False)
        common_step = common["optimizer_state_dict"]["state"][0]["step"]
    out: Dict[str, Dict[str, Any]] = {}
    for name, shape in shapes.items():
        folder = os.path.join(zero, name)
        if not any(os.path.exists(os.path.join(folder, f"{k}.pt")) for k in ("exp_avg", "exp_avg_sq")):
            continue  # a buffer or a frozen parameter: no optimizer state
        state: Dict[str, Any] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            file = os.path.join(folder, f"{key}.pt")
            if not os.path.exists(file):
                raise CheckpointError(f"{folder}: no {key}.pt for {name!r}; the DeepSpeed checkpoint holds no Adam "
                                      "state for it (another optimizer?); convert with --weights-only")
            saved = torch.load(file, map_location="cpu", weights_only=False)
            full = saved["param"] if isinstance(saved, dict) else saved
            if full.numel() != math.prod(shape):
                raise CheckpointError(f"{file}: {full.numel()} elements, the weight {name!r} has shape {shape}")
            state[key] = full.reshape(shape).float()
        step_file = os.path.join(folder, "step.pt")
        step = common_step
        if os.path.exists(step_file):
            step = torch.load(step_file, map_location="cpu", weights_only=False)
        state["step"] = torch.as_tensor(step).float().reshape(())
        out[name] = state
    return out


DS_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}
"""What DeepSpeed's engine writes into its model-states file; the rest is client state."""


def _no_latest(load_dir: str) -> str:
    """Why ``load_dir`` (with no ``latest`` file) cannot be converted, and what to pass instead."""
    if not os.path.isdir(load_dir):
        return f"no directory {load_dir!r}"
    if deepspeed_model_states(load_dir) is not None:
        parent, tag = os.path.split(os.path.normpath(load_dir))
        return (f"{load_dir!r} is one DeepSpeed tag directory: pass the save directory and the tag, "
                f"`--from deepspeed {parent or '.'} DST --tag {tag}`")
    tags = sorted(n for n in os.listdir(load_dir) if deepspeed_model_states(os.path.join(load_dir, n)) is not None)
    if tags:
        return (f"{os.path.join(load_dir, 'latest')} is missing: pass one of its tags, "
                f"e.g. --tag {tags[-1]} (tags: {', '.join(tags[:8])}{' ...' if len(tags) > 8 else ''})")
    return (f"{load_dir!r} is not a DeepSpeed checkpoint: it has no 'latest' file and no tag directory holding "
            f"{_DS_MODEL_STATES} (give the save_dir passed to engine.save_checkpoint)")


def is_deepspeed_universal(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed universal checkpoint (``ds_to_universal``'s output folder:
    the model-states files and ``zero/<parameter>/fp32.pt``, ``exp_avg.pt``, ...)."""
    return is_deepspeed_checkpoint(path) and os.path.isdir(os.path.join(path, "zero"))


def _universal_param_groups(universal: str) -> Optional[List[Dict[str, Any]]]:
    """The optimizer's hyper-parameters per param group (``lr`` as the LR scheduler last set it)
    from a universal checkpoint's ``zero/optimizer_state.pt``, which ``ds_to_universal`` writes for
    ZeRO stages 1-3 (whose model-states file holds no optimizer)."""
    file = os.path.join(universal, "zero", "optimizer_state.pt")
    if not os.path.exists(file):
        return None
    saved = torch.load(file, map_location="cpu", weights_only=False)
    return [{k: v for k, v in g.items() if k != "params"} for g in saved.get("param_groups") or []] or None


def _universal_weights(universal: str, states: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Every parameter's fp32 weight (``zero/<name>/fp32.pt``, shaped as the model-states file
    records it) and the buffers of the model-states file."""
    zero = os.path.join(universal, "zero")
    shapes: Dict[str, Tuple[int, ...]] = {}
    recorded = states.get("param_shapes") or []
    for group in recorded if isinstance(recorded, list) else [recorded]:
        shapes.update({name: tuple(shape) for name, shape in group.items()})
    tensors = {}
    for name in sorted(os.listdir(zero)):
        file = os.path.join(zero, name, "fp32.pt")
        if os.path.isfile(file):
            saved = torch.load(file, map_location="cpu", weights_only=False)
            full = saved["param"] if isinstance(saved, dict) else saved
            tensors[name] = full.reshape(shapes.get(name, tuple(full.shape))).float()
    tensors.update(_universal_frozen(universal))
    tensors.update({k: v for k, v in (states.get("module") or {}).items()
                    if k not in tensors and torch.is_tensor(v) and v.numel() > 0})
    for alias, source in (states.get("shared_params") or {}).items():  # tied weights, as zero_to_fp32 adds them
        if source in tensors:
            tensors[alias] = tensors[source]
    return tensors


def _universal_frozen(universal: str) -> Dict[str, torch.Tensor]:
    """The frozen parameters (no optimizer state, so no ``zero/`` folder) from the model-states
    files ``ds_to_universal`` copies: whole in each file (stages 1-2), or one partition per rank
    (stage 3: ``zero_pp_rank_<r>_...``), put together in rank order as zero_to_fp32 does."""
    files = [n for n in os.listdir(universal) if n.endswith("model_states.pt")]
    files.sort(key=lambda n: int(n.split("_")[3]) if n.startswith("zero_pp_rank_") else -1)
    states = [torch.load(os.path.join(universal, n), map_location="cpu", weights_only=False) for n in files]
    out = {}
    for name, shape in (states[0].get("frozen_param_shapes") or {}).items() if states else ():
        numel = math.prod(shape)
        pieces = [s["frozen_param_fragments"][name].reshape(-1) for s in states]
        whole = pieces[0] if pieces[0].numel() == numel else torch.cat(pieces)[:numel]
        out[name] = whole.reshape(shape).float()
    return out


def from_deepspeed(load_dir: str, tag: Optional[str], dst: str, weights_only: bool = False) -> None:
    """Convert DeepSpeed checkpoint ``load_dir/tag`` (``tag`` from ``latest`` if ``None``): a
    checkpoint of DeepSpeed's engine (stage 0-3, any world size) or a universal one
    (``ds_to_universal``'s output).

    ``extra`` holds ``{"deepspeed": {lr_scheduler, global_steps, global_samples,
    skipped_steps}, "client_state": ...}``. The optimizer's hyper-parameters come along (its
    ``lr`` as the LR scheduler set it, so the first resumed step runs at the saved run's rate).
    """
    if tag is None:
        tag = latest_tag(load_dir)
        if tag is None:
            raise CheckpointError(_no_latest(load_dir))
    path = os.path.join(load_dir, tag)
    states_file = deepspeed_model_states(path)
    if states_file is None:
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint (no {_DS_MODEL_STATES})")
    states = torch.load(states_file, map_location="cpu", weights_only=False)
    state, groups = None, None
    if is_deepspeed_universal(path):
        tensors = _universal_weights(path, states)
        if not weights_only:
            state = _universal_adam_state(path, {n: tuple(t.shape) for n, t in tensors.items()})
            groups = _universal_param_groups(path)
        _write_from_deepspeed(dst, tensors, state, groups, states)
        return
    zero_files = ("zero_pp_rank_", "bf16_zero_pp_rank_")
    if any(n.endswith("optim_states.pt") and n.startswith(zero_files) for n in os.listdir(path)):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tensors = dict(get_fp32_state_dict_from_zero_checkpoint(load_dir, tag))
        # Stage 1 records no frozen parameters for zero_to_fp32; its module state dict holds
        # them whole (stage 3's holds empty placeholders, which are left out).
        tensors.update({k: v for k, v in (states.get("module") or {}).items()
                        if k not in tensors and torch.is_tensor(v) and v.numel() > 0})
    else:
        tensors = dict(states["module"])
    if not weights_only:
        universal = tempfile.mkdtemp(prefix=f"{tag}_universal-{uuid.uuid4().hex[:8]}-", dir=load_dir)
        try:
            _deepspeed_universal(load_dir, tag, os.path.join(universal, "u"))
            state = _universal_adam_state(os.path.join(universal, "u"), {n: tuple(t.shape) for n, t in tensors.items()})
            groups = ([{k: v for k, v in g.items() if k != "params"}
                       for g in (states.get("optimizer") or {}).get("param_groups", [])]  # stage 0: the optimizer's
                      or _universal_param_groups(os.path.join(universal, "u")))  # ZeRO: its optimizer files'
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - DeepSpeed's converter raises many kinds
            raise CheckpointError(f"{path}: DeepSpeed's universal-checkpoint conversion of the optimizer state failed "
                                  f"({type(e).__name__}: {e}); convert with --weights-only") from e
        finally:
            shutil.rmtree(universal, ignore_errors=True)
    _write_from_deepspeed(dst, tensors, state, groups, states)


def _write_from_deepspeed(dst: str, tensors: Dict[str, torch.Tensor], state: Optional[Dict[str, Dict[str, Any]]],
                          groups: Optional[List[Dict[str, Any]]], states: Dict[str, Any]) -> None:
    engine = {k: states.get(k) for k in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")}
    client = {k: v for k, v in states.items() if k not in DS_ENGINE_KEYS}
    write_whole(dst, tensors, state, groups, extra={"converted_from": "deepspeed", "deepspeed": engine,
                                                     "client_state": client})
