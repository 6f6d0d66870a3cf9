"""The ZeRO stage accelerate compares: stage "ragged" reads as 3 there.

[Note: the stage accelerate compares]
accelerate copies ``zero_optimization.stage`` from the config into
``DeepSpeedPlugin.zero_stage`` and compares that attribute with integers; the string
"ragged" there is a ``TypeError``::

    reader                                   compares            stage "ragged" must take
    Accelerator.no_sync (every non-boundary  zero_stage < 2:     the ZeRO-2/3 branch: no context; the engine
      micro-batch of accelerator.accumulate)   engine.no_sync()    keeps gradients local until the boundary
                                                                 that accelerate sets before each backward
    Trainer.__init__ (auto_find_batch_size)  zero_stage == 3:    not reached: it runs before any engine
                                               refused            exists, so "ragged" is not refused there

The ragged engine shards parameters and gradients as ZeRO-3 does, and decides when to
reduce-scatter as DeepSpeed's engine decides when to reduce: by
``is_gradient_accumulation_boundary()``, which accelerate's engine wrapper sets from
``sync_gradients`` before every ``engine.backward`` (Trainer never enters ``no_sync`` with
DeepSpeed). So the plugin's ``zero_stage`` reads 3 and accelerate takes its ZeRO-3 branch.

Only that attribute changes. The config dict keeps "ragged", so what reads the dict
(``HfDeepSpeedConfig.is_zero3()``, transformers' ``is_deepspeed_zero3_enabled()``, i.e.
``zero.Init`` and ``GatheredParameters`` in model loading; ``get_state_dict``'s ``stage == 3``)
does not treat the model as ZeRO-3 partitioned: its saves go through :mod:`.saving`.
"""

from __future__ import annotations

import sys

from .config import RAGGED_STAGE

__all__ = ["ZERO_STAGE_SEEN_BY_ACCELERATE", "present_ragged_stage_to_accelerate"]

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
            plugin.zero_stage = ZERO_STAGE_SEEN_BY_ACCELERATE
