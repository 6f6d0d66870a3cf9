"""What differs between the DeepSpeed releases stage 'ragged' supports, in one place.

[Note: one door to DeepSpeed's releases]
The adapter (integrations/deepspeed/) supports every DeepSpeed release of
``vescale_zero.host_patches.HOST_VERSIONS["deepspeed"]`` (setup.py's ``deepspeed`` extra states
the same range; an installed release outside it fails ``import vescale_zero.integrations.deepspeed``
with one line naming both: ``host_patches.check_release``). Where those releases differ, the
adapter asks this module, which answers by what the installed release has (no version number is
compared here), as ``vescale_zero/torch_compat.py`` does for torch:

* ``gradient_allreduce_op`` (a top-level key, ``"mean"`` or ``"sum"``) is read by releases after
  0.19.5 (``get_gradient_allreduce_op``; 0.19.8 has it); earlier releases do not know the key and always average:
  :func:`gradient_allreduce_op` reads it as the installed DeepSpeed does.
* Backward. From 0.18 on, DeepSpeed runs ``_backward_prologue()`` from hooks on the forward's
  outputs, so ``loss.backward()`` and ``engine.scale(loss).backward()`` work beside
  ``engine.backward(loss)``. Before 0.18, only ``engine.backward(loss)`` backpropagates through
  the engine; it calls ``_backward_prologue(loss, scale_wrt_gas)``, which returns the loss
  divided by the accumulation steps. :data:`BACKWARD_HOOKS` says which one the engine has.
* ``is_functorch_transforming`` (0.19.2 and later: the engine's backward hooks stand aside under
  ``torch.func`` transforms): :func:`is_functorch_transforming` is DeepSpeed's where it has one,
  else ``False``, as the engine of those releases never stands aside.
* ``managed_gradient_accumulation`` (0.19.4 and later; a config key, ``false``: the caller's
  ``step()`` is the accumulation boundary): earlier releases always manage accumulation, so
  :func:`managed_gradient_accumulation` is ``True`` there.
* ``offload_states``: 0.18 and later refine ``include`` in ``_refine_include_states`` (with
  the optimizer offloaded, its masters and state are in host memory already and are left out);
  0.16 and 0.17 refuse an engine whose optimizer is offloaded. :func:`refine_include_states`
  is DeepSpeed's where it has one, else the same rule.
* ``bf16.bf16_master_weights_and_grads`` / ``bf16_optimizer_states`` exist from 0.18 (before,
  the section has no such fields: nothing to refuse).
* ``offload_optimizer.super_offload`` (the Superchip offload) exists from 0.18: :func:`super_offload`
  is ``False`` on a section without it, as those releases never offload that way.
* The ``bf16`` / ``fp16`` sections: 0.17 and later parse them with pydantic models
  (``deepspeed.runtime.precision_config``); 0.16 reads each key with its own getter in
  ``deepspeed.runtime.config``. :func:`bf16_section` and :func:`fp16_section` give the model of the
  installed release, or, on 0.16, the same fields read by 0.16's own getters.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Container, Dict, Optional

import deepspeed.runtime.config as ds_config
import deepspeed.utils.torch as ds_torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

__all__ = ["gradient_allreduce_op", "BACKWARD_HOOKS", "CALLER_OWNED_BOUNDARY", "READS_GRADIENT_ALLREDUCE_OP",
           "PRECISION_MODELS", "is_functorch_transforming", "bf16_section", "fp16_section",
           "FP16Section", "DtypeEnum", "get_communication_data_type", "managed_gradient_accumulation",
           "refine_include_states", "super_offload"]

DtypeEnum = ds_config.DtypeEnum
get_communication_data_type = ds_config.get_communication_data_type

BACKWARD_HOOKS: bool = not inspect.signature(DeepSpeedEngine._backward_prologue).parameters.keys() - {"self"}
"""Whether the engine runs ``_backward_prologue()`` from hooks on the forward's outputs (0.18 and
later: a direct ``loss.backward()`` goes through the engine) rather than from ``engine.backward``
with the loss (before 0.18)."""

CALLER_OWNED_BOUNDARY: bool = hasattr(DeepSpeedEngine, "managed_gradient_accumulation")
"""Whether the release has ``"managed_gradient_accumulation": false`` (0.19.4 and later)."""
READS_GRADIENT_ALLREDUCE_OP: bool = hasattr(ds_config, "get_gradient_allreduce_op")
"""Whether the release reads ``gradient_allreduce_op`` (after 0.19.5)."""


def is_functorch_transforming() -> bool:
    """Whether DeepSpeed's engine would leave this backward alone (under a ``torch.func`` transform);
    always ``False`` on releases whose engine does not check."""
    check = getattr(ds_torch, "is_functorch_transforming", None)
    return bool(check is not None and check())


def managed_gradient_accumulation(engine: DeepSpeedEngine) -> bool:
    """Whether the engine decides the accumulation boundary (DeepSpeed's default; always before 0.19.4)."""
    managed = getattr(engine, "managed_gradient_accumulation", None)
    return True if managed is None else bool(managed())


def refine_include_states(engine: DeepSpeedEngine,
                          include: Optional[Container[OffloadStateTypeEnum]]) -> Container[OffloadStateTypeEnum]:
    """The states ``engine.offload_states(include)`` moves: every kind when ``None``, without the
    masters and the optimizer state when the optimizer is offloaded already."""
    refine = getattr(engine, "_refine_include_states", None)
    if refine is not None:
        return refine(include)
    include = list(OffloadStateTypeEnum) if include is None else include
    if engine.zero_use_cpu_optimizer():
        include = [x for x in include if x not in (OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states)]
    return include


def super_offload(offload_optimizer: Any) -> bool:
    """Whether a parsed ``offload_optimizer`` section asks for the Superchip offload (0.18 and later)."""
    return bool(getattr(offload_optimizer, "super_offload", False))


def gradient_allreduce_op(config: Dict[str, Any]) -> str:
    """``"mean"`` or ``"sum"``: how the installed DeepSpeed reduces gradients under ``config``
    (releases up to 0.19.5 do not read ``gradient_allreduce_op``: they average)."""
    read = getattr(ds_config, "get_gradient_allreduce_op", None)
    return "mean" if read is None else read(config)


try:
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config as _FP16Model
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
except ImportError:  # DeepSpeed 0.16: no precision models
    _FP16Model = get_bfloat16_config = get_float16_config = None

PRECISION_MODELS: bool = get_bfloat16_config is not None
"""Whether the release parses ``bf16`` / ``fp16`` with pydantic models (0.17 and later; they drop
``"auto"`` and read ``"false"`` as False, where 0.16's getters take any non-empty string as true)."""


@dataclass(frozen=True)
class FP16Section:
    """DeepSpeed 0.16's ``fp16`` / ``bf16`` sections, as its own getters read them: the fields of
    0.17's ``DeepSpeedFP16Config`` / ``DeepSpeedBF16Config`` that the adapter uses (0.16 has no
    bf16 master weights)."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False

    def dynamic_loss_scale_args(self) -> Dict[str, Any]:
        """The dynamic loss scaler's arguments, as 0.17's model gives them."""
        from deepspeed.runtime.fp16 import loss_scaler

        return {loss_scaler.INITIAL_LOSS_SCALE: 2 ** self.initial_scale_power,
                loss_scaler.SCALE_WINDOW: self.loss_scale_window, loss_scaler.DELAYED_SHIFT: self.hysteresis,
                loss_scaler.CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
                loss_scaler.MIN_LOSS_SCALE: self.min_loss_scale}


def _section_016(config: Dict[str, Any], bf16: bool) -> FP16Section:
    if bf16:
        if not ds_config.get_bfloat16_enabled(config):
            return FP16Section()
        return FP16Section(enabled=True)
    if not ds_config.get_fp16_enabled(config):
        return FP16Section()
    dynamic = ds_config.get_dynamic_loss_scale_args(config) or {}
    return FP16Section(
        enabled=True, auto_cast=ds_config.get_fp16_auto_cast(config), loss_scale=ds_config.get_loss_scale(config),
        initial_scale_power=int(round(math.log2(dynamic.get("init_scale", 2 ** 16)))),
        loss_scale_window=int(dynamic.get("scale_window", 1000)), hysteresis=int(dynamic.get("delayed_shift", 2)),
        consecutive_hysteresis=bool(dynamic.get("consecutive_hysteresis", False)),
        min_loss_scale=float(dynamic.get("min_scale", 1.0)),
        fp16_master_weights_and_grads=ds_config.get_fp16_master_weights_and_grads_enabled(config))


def bf16_section(config: Dict[str, Any]) -> Any:
    """The ``bf16`` section of ``config`` as the installed DeepSpeed reads it (a pydantic
    validation error for a value it refuses, from 0.17 on)."""
    return get_bfloat16_config(config) if get_bfloat16_config is not None else _section_016(config, True)


def fp16_section(config: Optional[Dict[str, Any]] = None) -> Any:
    """The ``fp16`` section of ``config`` (default: none, i.e. disabled) as the installed DeepSpeed
    reads it."""
    config = config or {}
    if get_float16_config is not None:
        return get_float16_config(config) if config else _FP16Model()
    return _section_016(config, False)
