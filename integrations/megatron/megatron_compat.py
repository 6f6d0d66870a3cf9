"""What differs between the megatron-core (and Megatron-LM) releases the adapter supports, in one place.

[Note: one door to Megatron's releases]
The adapter (integrations/megatron/) supports every megatron-core release of
``vescale_zero.host_patches.HOST_VERSIONS["megatron-core"]`` with Megatron-LM's loop of the same
release (setup.py's ``megatron`` extra states the range; another release fails
``import vescale_zero.integrations.megatron`` with one line naming both:
``host_patches.check_release``). Where the releases differ, the adapter asks this module, which
answers by what the installed release has (no version number is compared), as
``vescale_zero/torch_compat.py`` does for torch. This module imports nothing of Megatron at
import time (the offline converter reads checkpoints without it).

* ``DistributedDataParallel.__init__`` takes ``full_param_layout`` from 0.18 on: the distributed
  optimizer's layout of DDP's buffers, which Megatron-LM's ``get_model`` computes for the class it
  wraps with. ``RaggedFSDP`` lays out its own buffers: the argument is accepted and not used
  (``megatron_lm._vescale_fsdp``).
* Megatron's parameter groups (``megatron.core.optimizer._get_param_groups``): 0.15 takes the
  weight-decay and LR conditions (``no_weight_decay_cond``, ``scale_lr_cond``, ``lr_mult``) and
  the learning rates; 0.16 on take the ``OptimizerConfig`` and ``config_overrides``. With no
  overrides, 0.16 and 0.17 apply Megatron's standard ones inside (no weight decay on biases and
  1-D parameters); from 0.18 ``get_megatron_optimizer`` does, and ``_get_param_groups`` alone
  would decay every parameter. :func:`param_groups` gives the groups ``get_megatron_optimizer``
  builds on every release.
* The learning rate Megatron-LM logs: 0.16 on, ``get_canonical_lr_for_logging`` (the first
  ``default_config`` group's); 0.15 has no such function nor flag: :func:`canonical_lr` takes the
  first group that is not a decoupled-LR one there.
* ``param_is_not_tensor_parallel_duplicate`` takes the tensor-parallel group from 0.16 on; 0.15's
  reads the global one. :func:`not_tensor_parallel_duplicate` answers for a given group on both
  (0.15: Megatron's rule, ``tensor_model_parallel`` or rank 0 of the group).
* Muon's settings in ``OptimizerConfig``: none in 0.15; ``muon_use_nesterov`` in 0.16 and 0.17,
  renamed ``muon_nesterov`` in 0.18. :func:`muon_nesterov` reads whichever the release has (a
  missing field would silently mean the default).
* A ``torch_dist`` checkpoint's common state (iteration, args, the optimizer's non-tensor part):
  ``common.pt`` beside the ``.distcp`` files up to 0.18; from 0.19 a sharded object named
  ``common_state`` inside them (no ``common.pt``; 0.19 still reads both). :func:`common_state`
  reads either.
* Megatron-LM's ``train()`` reads megatron-core DDP's buffer lists (``buffers``,
  ``expert_parallel_buffers``) of every chunk that is a ``DDP`` when a job stops early, from 0.18
  on; ``RaggedFSDP`` answers with empty ones on every release (data_parallel.py
  [Note: Megatron DDP's buffer lists]).
* ``--data-parallel-sharding-strategy`` defaults to ``no_shard`` up to 0.17 and to
  ``optim_grads_params`` (what ``RaggedFSDP`` does) from 0.18: neither is named as a flag without
  effect (``arguments._NO_EFFECT``).
* Megatron-LM (``megatron.training``) ships inside megatron-core's wheel from 0.17 on; for 0.15
  and 0.16 it is a clone of Megatron-LM at the ``core_v`` tag of the same release. Its module-level
  names that the registry patches (``get_model``, ``get_megatron_muon_optimizer``, ...) are
  optional entries there ([Note: host patches]).
* megatron-core 0.17 and later declare ``Requires-Python >=3.12`` and publish cp311 wheels too;
  0.18's and 0.19's ``megatron.training`` import ``typing.override`` (Python 3.12). On Python
  3.11 they install with ``pip install --ignore-requires-python`` (docs/testing.md).
"""

from __future__ import annotations

import inspect
import io
import os
from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["param_groups", "canonical_lr", "not_tensor_parallel_duplicate", "muon_nesterov", "common_state",
           "COMMON_FILE", "COMMON_STATE_KEY"]

COMMON_FILE = "common.pt"
"""Where megatron-core up to 0.18 saves a ``torch_dist`` checkpoint's common state."""
COMMON_STATE_KEY = "common_state/shard_0_1"
"""The DCP key of the sharded object holding the common state from 0.19 on (``ShardedObject
("common_state", ..., (1,), (0,))``'s unique key)."""


def param_groups(model_chunks: List[Any], config: Any, config_overrides: Optional[Dict[Any, Any]] = None, *,
                 no_weight_decay_cond: Optional[Callable] = None, scale_lr_cond: Optional[Callable] = None,
                 lr_mult: float = 1.0, default_skip_embedding_weight_decay: bool = False) -> List[Dict[str, Any]]:
    """Megatron's parameter groups of ``model_chunks``, as the installed ``get_megatron_optimizer``
    builds them from its arguments (the keyword ones: 0.15's, refused elsewhere unless at their defaults)."""
    # host patch megatron.core.optimizer._get_param_groups: checked against megatron-core 0.15.3-0.19.2
    from megatron.core import optimizer as megatron_optimizer

    get_groups = megatron_optimizer._get_param_groups
    if "config" not in inspect.signature(get_groups).parameters:  # 0.15
        if config_overrides is not None:
            raise ValueError("config_overrides needs megatron-core 0.16 or later; with 0.15 pass "
                             "no_weight_decay_cond / scale_lr_cond / lr_mult")
        return get_groups(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, config.lr, config.min_lr,
                          config.decoupled_lr, config.decoupled_min_lr, default_skip_embedding_weight_decay)
    if no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0 \
            or default_skip_embedding_weight_decay:
        raise ValueError("no_weight_decay_cond, scale_lr_cond, lr_mult and default_skip_embedding_weight_decay are "
                         "megatron-core 0.15's; from 0.16 on express them as config_overrides")
    if config_overrides is None:  # what get_megatron_optimizer does from 0.18 (and _get_param_groups before)
        standard = getattr(megatron_optimizer, "get_standard_config_overrides", None)
        config_overrides = standard(config) if standard is not None else None
    return get_groups(model_chunks, config, config_overrides)


def canonical_lr(param_groups: List[Dict[str, Any]]) -> Optional[float]:
    """The learning rate Megatron-LM logs for these optimizer parameter groups."""
    from megatron.core import optimizer_param_scheduler

    canonical = getattr(optimizer_param_scheduler, "get_canonical_lr_for_logging", None)
    if canonical is not None:
        return canonical(param_groups)
    return next((g.get("lr") for g in param_groups if not g.get("is_decoupled_lr", False)), None)


def not_tensor_parallel_duplicate(param: Any, tp_group: Any) -> bool:
    """Whether ``param`` counts once over the tensor-parallel group ``tp_group`` (Megatron's
    ``param_is_not_tensor_parallel_duplicate``)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if "tp_group" in inspect.signature(param_is_not_tensor_parallel_duplicate).parameters:
        return param_is_not_tensor_parallel_duplicate(param, tp_group)
    if tp_group is None:  # 0.15: the global group
        return param_is_not_tensor_parallel_duplicate(param)
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_group.rank() == 0  # 0.15's rule, this group


def muon_nesterov(config: Any) -> bool:
    """Whether Megatron's ``OptimizerConfig`` asks Muon for Nesterov momentum (default ``True``)."""
    for field in ("muon_nesterov", "muon_use_nesterov"):  # 0.18 on; 0.16 and 0.17
        if hasattr(config, field):
            return bool(getattr(config, field))
    return True


def common_state(path: str, state: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The common state of the ``torch_dist`` checkpoint directory ``path`` (a dict), from
    ``common.pt`` or from the ``common_state`` object inside its DCP files (``state``: the
    checkpoint already read whole, else read here); ``None`` when it has neither."""
    file = os.path.join(path, COMMON_FILE)
    if os.path.isfile(file):
        return torch.load(file, map_location="cpu", weights_only=False)
    if state is None:
        if not os.path.isfile(os.path.join(path, ".metadata")):
            return None
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(path)
        if COMMON_STATE_KEY not in reader.read_metadata().state_dict_metadata:
            return None
        state = {COMMON_STATE_KEY: io.BytesIO()}  # that one entry read, in this process
        dcp.load(state, storage_reader=reader, no_dist=True)
    saved = state.get(COMMON_STATE_KEY)
    if saved is None:
        return None
    if isinstance(saved, io.BytesIO):
        saved.seek(0)
        saved = torch.load(saved, map_location="cpu", weights_only=False)
    return saved[0] if isinstance(saved, (list, tuple)) else saved
