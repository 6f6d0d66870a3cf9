"""DeepSpeed with ragged sharding: ``"zero_optimization": {"stage": "ragged"}``.

Add one import to a script that already calls ``deepspeed.initialize``::

    import vescale_zero.integrations.deepspeed  # noqa: F401  (registers stage "ragged")

The import wraps ``deepspeed.initialize``: a config whose ``zero_optimization.stage`` is
``"ragged"`` is validated (see :mod:`.config`), handed to DeepSpeed as stage 0 without its
own ``bf16`` / ``fp16`` sections, and the engine is a :class:`RaggedDeepSpeedEngine`. Any
other config goes to DeepSpeed untouched.

The import also makes DeepSpeed's own config parser accept "ragged" everywhere it parses a
config (``deepspeed.checkpointing.configure``, ``DeepSpeedConfig``, ...), lets
``deepspeed.zero.Init`` build the model partitioned (converted to ragged shards by
``deepspeed.initialize``) and ``GatheredParameters`` gather ragged parameters: see
:mod:`.parser` and :mod:`.zero_init`. Hugging Face's ``from_pretrained`` then builds a model
partitioned under a ragged config as under ZeRO-3 (:mod:`.accelerate_stage`), and
``deepspeed.utils.safe_get_full_grad`` and its family give and take what they do at ZeRO-3
(:mod:`.safe_accessors`); ``get_fp32_state_dict_from_zero_checkpoint`` and the checkpoint's
``zero_to_fp32.py`` read ragged checkpoints (:mod:`.recovery_scripts`).
"""
# ruff: noqa: E402 - the release check comes before the adapter's imports

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Any, Dict, Optional, Tuple

from vescale_zero import host_patches

# Before any module of the adapter imports DeepSpeed's internals: a release outside the supported
# range fails here, in one line naming both ([Note: one door to DeepSpeed's releases]).
host_patches.check_release("deepspeed")

import deepspeed

from .checkpoint_conversion import from_deepspeed
from .config import RAGGED_STAGE, RaggedOptions, apply_top_level_keys, parse_precision, parse_ragged_section
from .engine import RaggedDeepSpeedEngine, RaggedPipelineEngine, RaggedPrecision
from .offload import stage0_offload_keys
from .parser import RaggedZeroConfig, is_ragged_config
from .zero_init import partitioned_for_ragged

__all__ = ["RaggedDeepSpeedEngine", "RaggedPipelineEngine", "RaggedOptions", "RaggedZeroConfig", "is_ragged_config",
           "split_ragged_config", "initialize", "from_deepspeed"]

_original_initialize = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)


def _load(config: Any) -> Optional[Dict[str, Any]]:
    if config is None or isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config) as f:
            return json.load(f)
    return None  # something DeepSpeed understands and we do not: not ours


def split_ragged_config(config: Dict[str, Any]) -> Tuple[Dict[str, Any], RaggedOptions, RaggedPrecision]:
    """``(config for DeepSpeed at stage 0, our options, the precision we handle)``; every value
    read as DeepSpeed reads it (:mod:`.config`, [Note: validated as DeepSpeed validates])."""
    ds = copy.deepcopy(config)
    options, _ = parse_ragged_section(ds.pop("zero_optimization"))
    ds["zero_optimization"] = {"stage": 0, **stage0_offload_keys(options.offload)}  # ZeRO-3's optimizer choice
    dtype, fp16 = parse_precision(ds)
    options = apply_top_level_keys(ds, options)
    for key in ("bf16", "bfloat16", "fp16"):
        ds.pop(key, None)
    if isinstance(ds.get("data_types"), dict):  # ours (apply_top_level_keys): DeepSpeed at stage 0 would
        ds["data_types"] = {k: v for k, v in ds["data_types"].items() if k != "grad_accum_dtype"}  # see fp32
    return ds, options, RaggedPrecision(dtype, fp16)


def _as_ragged(zero: Dict[str, Any]) -> Dict[str, Any]:
    """[Note: a model built partitioned for ragged]
    A model that ``zero.Init`` partitioned under a ragged config (``from_pretrained`` while the
    Trainer's ragged config is alive) can only run sharded: DeepSpeed's engine at stage 0-2 would
    compute with its empty partitions ("'weight' must be 2-D"). TRL's ``prepare_deepspeed`` builds
    the frozen reference model (DPO, GRPO and RLOO with a KL term, KTO) that way: it reads
    ``zero_optimization.stage``, sees "ragged" != 3 and hands ``deepspeed.initialize`` the training
    config with stage 0 (optimizer and scheduler dropped, and ``offload_optimizer``). That model
    gets what stage 3 gives it there: a sharded engine, here the ragged one, with the section as
    given and stage "ragged" (``offload_param`` alone, the masters in host memory at stage 3,
    reads as ``offload_optimizer`` here, which places the same shards). A model built any other
    way goes to DeepSpeed untouched."""
    section = {**zero, "stage": RAGGED_STAGE}
    param = section.pop("offload_param", None)
    if isinstance(param, dict) and "offload_optimizer" not in section:
        section["offload_optimizer"] = {k: v for k, v in param.items() if k in ("device", "pin_memory")}
    return section


# host patch deepspeed.initialize: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.DeepSpeedEngine: checked against deepspeed 0.16.9-0.19.8 (for one call)
# host patch deepspeed.PipelineEngine: checked against deepspeed 0.16.9-0.19.8 (for one call)
@functools.wraps(_original_initialize)
def initialize(*args: Any, **kwargs: Any):
    names = ("args", "model", "optimizer", "model_parameters")
    kwargs.update(zip(names, args))
    ns = kwargs.get("args")
    raw = kwargs.get("config") if kwargs.get("config") is not None else kwargs.get("config_params")
    from_args = raw is None and ns is not None and getattr(ns, "deepspeed_config", None)
    config = _load(ns.deepspeed_config if from_args else raw)
    zero = (config or {}).get("zero_optimization") or {}
    if zero.get("stage") != RAGGED_STAGE:
        if not (zero.get("stage", 0) in (0, 1, 2) and partitioned_for_ragged(kwargs.get("model"))):
            return _original_initialize(**kwargs)
        config = dict(config, zero_optimization=_as_ragged(zero))  # [Note: a model built partitioned for ragged]
    ds_config, options, precision = split_ragged_config(config)
    if from_args:
        ns = copy.copy(ns)
        ns.deepspeed_config = None
        kwargs["args"] = ns
    kwargs.pop("config_params", None)
    kwargs["config"] = ds_config
    pipeline = isinstance(kwargs.get("model"), deepspeed.PipelineModule)
    base, name = (RaggedPipelineEngine, "PipelineEngine") if pipeline else (RaggedDeepSpeedEngine, "DeepSpeedEngine")
    engine_cls = type(base.__name__, (base,), {"ragged_options": options, "ragged_precision": precision})
    with host_patches.scoped(f"deepspeed.{name}", engine_cls):  # deepspeed.initialize builds it by this name
        return _original_initialize(**kwargs)


# host patches ([Note: host patches]): deepspeed.initialize, DeepSpeed's parser, zero.Init, GatheredParameters and its
# accessors (.parser, .zero_init, .safe_accessors); zero_to_fp32's reader (.zero_to_fp32); accelerate's
# stage and is_zero3 (.accelerate_stage), which nothing needs without accelerate
host_patches.install("deepspeed")
host_patches.install("deepspeed.zero_to_fp32")
host_patches.install("accelerate")
