"""Checkpoints from every source: the one module that joins loading and conversion.

::

    load(path)  --- ours (metadata.json) ----------------------------------> sharded.load
                \\-- a DCP directory (FSDP2) -> convert.from_fsdp2, once,
                    by rank 0, into path.vescale ---------------------------> sharded.load

The modules below it (``sharded``, ``convert``, ``consolidate``) import only
:mod:`vescale_zero.checkpoint.format`, never each other. Offline conversion of every source
(``vescale-zero convert``) is the command's: :func:`vescale_zero.tools.cli.convert`.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.comm_device import current_device
from . import sharded
from .convert import from_fsdp2
from .format import METADATA_FILE, CheckpointError, is_dcp_checkpoint

__all__ = ["load"]


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         keep_frozen_left_out: bool = True) -> Any:
    """Load a checkpoint written by :func:`vescale_zero.checkpoint.save` (or converted) at
    any world size; returns its ``extra``. ``keep_frozen_left_out``: see :func:`.sharded.load`.

    A DCP checkpoint of PyTorch FSDP2 is converted first (once, by rank 0, next to it as
    ``path.vescale``; :func:`vescale_zero.checkpoint.from_fsdp2`).

    Collective: if any rank refuses the checkpoint, every rank raises (none goes on to
    train alone and hang in its next collective).
    """
    if is_dcp_checkpoint(path):
        with current_device(sharded.model_device(model)):  # the object collective's device on NCCL
            path = _converted_dcp(path)
    return sharded.load(path, model, optimizer, keep_frozen_left_out)


def _converted_dcp(path: str) -> str:
    """``path`` + ``.vescale``: a DCP (FSDP2) checkpoint converted once, by rank 0."""
    target = path.rstrip(os.sep) + ".vescale"
    error = None
    if (not dist.is_initialized() or dist.get_rank() == 0) and not os.path.exists(os.path.join(target, METADATA_FILE)):
        try:
            from_fsdp2(path, target)
        except (CheckpointError, OSError, RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        flag = [error]
        dist.broadcast_object_list(flag, src=0)
        error = flag[0]
    if error is not None:
        raise CheckpointError(f"{path} is a DCP (FSDP2) checkpoint and converting it to {target} failed ({error}); "
                              f"convert it offline: vescale-zero convert --from fsdp2 {path} {target}")
    return target
