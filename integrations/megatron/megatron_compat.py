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
* Muon's settings in ``OptimizerConfig``: none in 0.15; ``muon_use_nesterov`` in 0.16 and 0.17,
  renamed ``muon_nesterov`` in 0.18. :func:`muon_nesterov` reads whichever the release has (a
  missing field would silently mean the default).
* A ``torch_dist`` checkpoint's common state (iteration, args, the optimizer's non-tensor part):
  ``common.pt`` beside the ``.distcp`` files up to 0.18; from 0.19 a sharded object named
  ``common_state`` inside them (no ``common.pt``; 0.19 still reads both). :func:`common_state`
  reads either.
* Megatron-LM (``megatron.training``) ships inside megatron-core's wheel from 0.17 on; for 0.15
  and 0.16 it is a clone of Megatron-LM at the ``core_v`` tag of the same release. Its module-level
  names that the registry patches (``get_model``, ``get_megatron_muon_optimizer``, ...) are
  optional entries there ([Note: host patches]).
* megatron-core 0.17 and later declare ``Requires-Python >=3.12`` and publish cp311 wheels too;
  0.18's and 0.19's ``megatron.training`` import ``typing.override`` (Python 3.12). On Python
  3.11 they install with ``pip install --ignore-requires-python`` (docs/testing.md).
"""

from __future__ import annotations

import io
import os
from typing import Any, Dict, Optional

import torch

__all__ = ["muon_nesterov", "common_state", "COMMON_FILE", "COMMON_STATE_KEY"]

COMMON_FILE = "common.pt"
"""Where megatron-core up to 0.18 saves a ``torch_dist`` checkpoint's common state."""
COMMON_STATE_KEY = "common_state/shard_0_1"
"""The DCP key of the sharded object holding the common state from 0.19 on (``ShardedObject
("common_state", ..., (1,), (0,))``'s unique key)."""


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
