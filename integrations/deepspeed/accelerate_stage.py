"""The ZeRO stage Hugging Face compares: stage "ragged" reads as 3 there.

[Note: the stage accelerate compares]
accelerate copies ``zero_optimization.stage`` from the config into
``DeepSpeedPlugin.zero_stage`` and compares that attribute with integers; the string
"ragged" there is a ``TypeError``::

    reader                                   compares            stage "ragged" must take
    Accelerator.no_sync (every non-boundary  zero_stage < 2:     the ZeRO-2/3 branch: no context; the engine
      micro-batch of accelerator.accumulate)   engine.no_sync()    keeps gradients local until the boundary
                                                                 that accelerate sets before each backward
    Trainer.__init__ (auto_find_batch_size)  zero_stage == 3:    refused, as at stage 3 (a retry would shard
                                               refused            the sharded model again)
    TRL trainers' __init__ (SFT, DPO, GRPO,  zero_stage == 3:    the ZeRO-3 branch: adapters in the base
      RLOO, KTO, reward, distillation)         PEFT adapters'     model's dtype (one fully_shard group holds
                                               dtype, reentrant   both, and a group has one dtype);
                                               checkpointing      reentrant recompute (ours runs either)
    TRL's DistributedBackend, SyncRef-       zero_stage == 3:    the ZeRO-3 branch: GatheredParameters, which
      ModelCallback, online DPO                gather             gathers ragged parameters

The ragged engine shards parameters and gradients as ZeRO-3 does, and decides when to
reduce-scatter as DeepSpeed's engine decides when to reduce: by
``is_gradient_accumulation_boundary()``, which accelerate's engine wrapper sets from
``sync_gradients`` before every ``engine.backward`` (Trainer never enters ``no_sync`` with
DeepSpeed). So the plugin's ``zero_stage`` reads 3 from the plugin's creation on
(``TrainingArguments``, ``Accelerator``: :func:`plugin_reads_3`), and again
when the engine is built for plugins made before this module was imported.

[Note: the stage transformers compares]
``HfDeepSpeedConfig.is_zero3()`` (accelerate's class; transformers' ``HfDeepSpeedConfig``
and ``HfTrainerDeepSpeedConfig`` derive from it, and ``is_deepspeed_zero3_enabled()`` asks
it) answers True for a ragged config too: a model is *built* as under ZeRO-3, so that
``from_pretrained`` (and ``from_config``) construct it inside ``deepspeed.zero.Init`` and load
the checkpoint through ``GatheredParameters``, one module at a time; no rank ever holds the
whole model, and ``deepspeed.initialize`` converts the ZeRO-3 partitions into ragged shards
group by group ([Note: zero.Init under ragged] in :mod:`.zero_init`). The other readers of
``is_deepspeed_zero3_enabled()`` then also behave as for ZeRO-3, which is right for ragged
shards: ``generate(synced_gpus=True)`` (every rank must take part in each forward's
all-gathers), ``resize_token_embeddings`` through ``GatheredParameters`` (ours gathers ragged
parameters), no ``device_map``. accelerate's ``zero3_init_flag`` defaults to True likewise.

What reads the config *dict* still sees "ragged": ``Accelerator.get_state_dict``'s
``stage == 3`` does not take DeepSpeed's ZeRO-3 gather (which needs ``ds_*`` attributes),
and the engine's saves go through :mod:`.saving`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from .config import RAGGED_STAGE

__all__ = ["ZERO_STAGE_SEEN_BY_ACCELERATE", "present_ragged_stage_to_accelerate", "ragged_is_zero3",
           "plugin_reads_3"]

ZERO_STAGE_SEEN_BY_ACCELERATE = 3
"""``DeepSpeedPlugin.zero_stage`` of a ragged config (see the note above)."""


def present_ragged_stage_to_accelerate() -> None:
    """Set ``zero_stage`` to 3 on every accelerate ``DeepSpeedPlugin`` whose config has
    stage "ragged" (idempotent; nothing happens without accelerate or without its state).

    The engine calls it when it is built: accelerate has created its plugins by then (its
    ``prepare``, or the Trainer's, builds the engine), and reads ``zero_stage`` only later."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None) or {}
    plugins = shared.get("deepspeed_plugins")
    if plugins is None:
        return
    for plugin in plugins.values() if isinstance(plugins, dict) else [plugins]:
        if plugin.hf_ds_config.get_value("zero_optimization.stage") == RAGGED_STAGE:
            # host patch accelerate.utils.DeepSpeedPlugin.zero_stage: checked against accelerate 1.10.1-1.15.0
            plugin.zero_stage = ZERO_STAGE_SEEN_BY_ACCELERATE


# host patch accelerate.utils.deepspeed.HfDeepSpeedConfig.is_zero3: checked against accelerate 1.10.1-1.15.0
def ragged_is_zero3(is_zero3: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``HfDeepSpeedConfig.is_zero3`` that is True for a ragged config too
    (see [Note: the stage transformers compares])."""

    @functools.wraps(is_zero3)
    def wrapper(self: Any) -> bool:
        return getattr(self, "_stage", None) == RAGGED_STAGE or is_zero3(self)

    return wrapper


# host patch accelerate.utils.DeepSpeedPlugin.__post_init__: checked against accelerate 1.10.1-1.15.0
def plugin_reads_3(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    """``DeepSpeedPlugin.__post_init__`` after which a plugin made from a ragged config reads
    ``zero_stage`` 3 from its creation (see [Note: the stage accelerate compares])."""

    @functools.wraps(post_init)
    def wrapper(self: Any) -> None:
        post_init(self)
        if self.zero_stage == RAGGED_STAGE:
            self.zero_stage = ZERO_STAGE_SEEN_BY_ACCELERATE

    return wrapper
