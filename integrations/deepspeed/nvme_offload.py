"""``"offload_optimizer": {"device": "nvme", "nvme_path": ...}`` under ``"stage": "ragged"``.

The engine's optimizer keeps its state in files under ``nvme_path`` and steps one fully_shard
group at a time (:mod:`vescale_zero.optim.state_files`, [Note: stepping group by group]);
checkpoints (``engine.save_checkpoint`` / ``load_checkpoint``) read and write it through the
optimizer's state as before. Every rank writes its own files in ``nvme_path``, which must exist
and belong to this engine alone. The options as read: ``.config.nvme_offload_of``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from vescale_zero.optim import StateFiles, offload_state_to_files

from .config import RaggedOptions

__all__ = ["offload_optimizer_to_nvme"]


def offload_optimizer_to_nvme(optimizer: Optional[torch.optim.Optimizer], module: nn.Module,
                              options: RaggedOptions) -> Optional[StateFiles]:
    """Put ``optimizer``'s state in files when the config asks for it (``None`` otherwise)."""
    nvme = options.optimizer_nvme
    if nvme is None or optimizer is None:
        return None
    return offload_state_to_files(optimizer, module, nvme.nvme_path, buffer_count=2 if nvme.read_ahead else 1,
                                  pin_memory=nvme.pin_memory)
