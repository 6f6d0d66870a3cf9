"""One warning per Megatron flag and process: what several parts of the adapter say about flags
that have no effect, or a different one, under ``--use-vescale-fsdp``."""

from __future__ import annotations

import warnings
from typing import Set

import torch.distributed as dist

__all__ = ["warn_once"]

_WARNED: Set[str] = set()


def warn_once(flag: str, message: str) -> None:
    """A ``UserWarning`` saying ``message``, once per process for ``flag``, on global rank 0
    (every rank when torch.distributed is not initialised)."""
    if flag in _WARNED:
        return
    _WARNED.add(flag)
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)
