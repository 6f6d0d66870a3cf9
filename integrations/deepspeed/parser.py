"""Stage "ragged" wherever DeepSpeed parses a config, not only in ``deepspeed.initialize``.

[Note: ragged in DeepSpeed's parser]
Every DeepSpeed entry point that reads a config builds a ``DeepSpeedConfig``
(``deepspeed.initialize``, ``deepspeed.checkpointing.configure``, ``deepspeed.zero.Init``,
and other libraries that call it directly), and that class turns the ``zero_optimization``
section into ZeRO's pydantic model (``stage`` 0-3, unknown keys forbidden) in one place:
``get_zero_config``. We replace that one function (``vescale_zero/host_patches.py``), so that every parse agrees:

* a ragged section is validated by :func:`.config.parse_ragged_section` (our errors, naming
  the key and the fix; the top-level keys that concern us by :func:`.config.parse_precision`
  and :func:`.config.apply_top_level_keys`) and comes back as a :class:`RaggedZeroConfig`: a valid ZeRO config at
  **stage 0** (``zero_optimization_stage`` 0, ``zero_enabled`` False) that also carries our
  options (``.ragged``). Stage 0 because DeepSpeed itself must do no ZeRO work: our runtime
  shards, gathers, reduces and keeps the precision, so every DeepSpeed branch on the stage
  (ZeRO optimizer wrappers, stage-3 hooks and ``ds_id`` parameters, checkpoint layout) must
  take its "no ZeRO" path -- the config ``deepspeed.initialize`` hands its engine is the same
  stage 0. Every other section (bf16 / fp16, activation_checkpointing, optimizer, ...) is
  DeepSpeed's as always, and ``_param_dict`` keeps the user's dict (stage "ragged"), which
  dict-reading libraries (Hugging Face's ``HfDeepSpeedConfig``: ``is_zero3()`` False) see;
* a stage DeepSpeed refuses (a typo, 4) gets an error listing 0-3 and "ragged";
* ``deepspeed.zero.Init`` with a ragged config partitions parameters ZeRO-3 style (it does
  not look at the stage, and reads ZeRO's defaults from our stage-0 model, except the keys it
  alone reads, given as in the section: ``config.ZERO_INIT_KEYS``), in fp32
  (it sees the config without its bf16 / fp16 sections: our shards are master weights);
  options contradicting ragged sharding (its own offload, pinned memory, quantized weights, hpZ)
  are refused by name. ``deepspeed.initialize`` converts the partitions group by group
  ([Note: zero.Init under ragged] in :mod:`.zero_init`). ``deepspeed.zero.GatheredParameters``
  is widened to our sharded parameters (``vescale_zero.api.full_parameters``);
* DeepSpeed's own engine given a ragged config (``deepspeed.initialize`` bound before our
  import, e.g. ``from deepspeed import initialize``) would train unsharded: refused.

We do not widen the pydantic model's ``stage`` instead: a string there would reach
DeepSpeed's integer comparisons (``stage > 0``, ``stage <= max_stage``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict

import deepspeed.runtime.config as ds_config
import deepspeed.runtime.zero.config as ds_zero_config
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import partition_parameters
from pydantic import Field, ValidationError

from .config import RAGGED_STAGE, RaggedOptions, apply_top_level_keys, parse_precision, parse_ragged_section
from .offload import stage0_offload_keys
from .zero_init import check_zero_init_options, mark_ragged_partitions

__all__ = ["RaggedZeroConfig", "is_ragged_config", "get_zero_config", "ragged_zero_init", "engine_sanity_check"]


class RaggedZeroConfig(ds_zero_config.DeepSpeedZeroConfig):
    """What DeepSpeed sees for ``"stage": "ragged"``: ZeRO off (stage 0), our options in ``ragged``."""

    ragged: RaggedOptions = Field(default_factory=RaggedOptions)


def is_ragged_config(config: ds_config.DeepSpeedConfig) -> bool:
    """Whether a parsed ``DeepSpeedConfig`` came from a ``"stage": "ragged"`` section."""
    return isinstance(getattr(config, "zero_config", None), RaggedZeroConfig)


_original_get_zero_config = getattr(ds_zero_config.get_zero_config, "__wrapped__", ds_zero_config.get_zero_config)


# host patch deepspeed.runtime.zero.config.get_zero_config: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.runtime.config.get_zero_config: checked against deepspeed 0.16.9-0.19.8 (DeepSpeedConfig's name)
@functools.wraps(_original_get_zero_config)
def get_zero_config(param_dict: Dict[str, Any]) -> ds_zero_config.DeepSpeedZeroConfig:
    section = param_dict.get(ds_zero_config.ZERO_OPTIMIZATION)
    stage = section.get("stage") if isinstance(section, dict) else None
    if stage == RAGGED_STAGE:
        options, _ = parse_ragged_section(section)
        parse_precision(param_dict)  # refuses what split_ragged_config refuses: every parse agrees
        return RaggedZeroConfig(ragged=apply_top_level_keys(param_dict, options),
                                **stage0_offload_keys(options.offload),  # what DeepSpeed's optimizer choice reads
                                **options.zero_init)  # what zero.Init reads (config.ZERO_INIT_KEYS)
    try:
        return _original_get_zero_config(param_dict)
    except ValidationError as e:
        if any(err["loc"][:1] == ("stage",) for err in e.errors()):
            raise ValueError(
                f"zero_optimization.stage {stage!r} is not a stage: use 0, 1, 2, 3 (DeepSpeed ZeRO) or "
                f"{RAGGED_STAGE!r} (vescale-zero ragged sharding, after `import vescale_zero.integrations.deepspeed`)"
            ) from e
        raise


_original_init = getattr(partition_parameters.Init.__init__, "__wrapped__", partition_parameters.Init.__init__)
_init_signature = inspect.signature(_original_init)


# host patch deepspeed.runtime.zero.partition_parameters.Init.__init__: checked against deepspeed 0.16.9-0.19.8
@functools.wraps(_original_init)
def ragged_zero_init(self: partition_parameters.Init, *args: Any, **kwargs: Any) -> None:
    bound = _init_signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    config = given["config_dict_or_path"] if given["config_dict_or_path"] is not None else given.get("config")
    parsed = ds_config.DeepSpeedConfig(config, given.get("mpu")) if given["enabled"] and config is not None else None
    if parsed is not None and is_ragged_config(parsed):
        check_zero_init_options(given)
        if given["dtype"] is None:  # our shards are the master weights: bf16 / fp16 are compute dtypes
            given["config_dict_or_path"], given["config"] = _without_precision(parsed._param_dict), None
        mark_ragged_partitions(self)
        return _original_init(*bound.args, **bound.kwargs)
    _original_init(self, *args, **kwargs)


def _without_precision(config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` without its bf16 / fp16 sections: what ``zero.Init`` sees under ragged, so it
    builds the parameters in fp32 (an explicit ``dtype=`` would be misread on some accelerators)."""
    return {k: v for k, v in config.items() if k not in ("bf16", "bfloat16", "fp16")}


_original_sanity_check = getattr(DeepSpeedEngine._do_sanity_check, "__wrapped__", DeepSpeedEngine._do_sanity_check)


# host patch deepspeed.runtime.engine.DeepSpeedEngine._do_sanity_check: checked against deepspeed 0.16.9-0.19.8
@functools.wraps(_original_sanity_check)
def engine_sanity_check(self: DeepSpeedEngine) -> None:
    if is_ragged_config(self._config):
        raise ValueError(
            "a \"stage\": \"ragged\" config reached DeepSpeed's own engine, which would train without ragged sharding: "
            "build the engine with deepspeed.initialize after `import vescale_zero.integrations.deepspeed` (a "
            "`from deepspeed import initialize` made before that import bypasses it)"
        )
    _original_sanity_check(self)
