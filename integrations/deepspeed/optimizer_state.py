"""Loaded optimizer state in the form the optimizer's own kernel keeps it.

[Note: optimizer state after a load]
A checkpoint holds each rank's flat pieces of the optimizer state and its step, whichever
optimizer wrote them; :func:`vescale_zero.checkpoint.load` gives the state back as ragged
tensors (the layout torch's optimizers create from a ragged parameter) with the step as saved.
Two kinds of optimizer keep it otherwise, and a checkpoint may come from the other kind (a
run with ``offload_optimizer`` resumed without it, or the reverse):

* DeepSpeed's kernels (``deepspeed.ops``: DeepSpeedCPUAdam, FusedAdam, the CPU Adagrad / Lion)
  create their state from ``p.data`` -- the parameter's local piece, a plain tensor -- count
  ``step`` in a Python int, and hand both to C++ code that reads data pointers: a ragged tensor
  there (a wrapper with no storage of its own) crashes the process, a tensor step is refused.
  Their state becomes the local pieces (views, no copy), their step an int.
* torch's optimizers count ``step`` in a tensor (``_foreach_add_`` on it): an int step becomes
  one, placed as torch places it (``restored_step``).
"""

from __future__ import annotations

from typing import Any

import torch

from vescale_zero import local_piece
from vescale_zero.hosts import restored_step

__all__ = ["as_the_optimizer_keeps_it"]


def _module(optimizer: Any) -> str:
    return type(optimizer).__module__ or ""


def as_the_optimizer_keeps_it(optimizer: Any) -> None:
    """Convert ``optimizer``'s loaded state in place (see [Note: optimizer state after a load])."""
    deepspeed_kernel = _module(optimizer).startswith("deepspeed.ops.")
    torch_optimizer = _module(optimizer).startswith("torch.optim")
    if not (deepspeed_kernel or torch_optimizer):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if deepspeed_kernel and key == "step" and torch.is_tensor(value):
                    state[key] = int(value.item())
                elif deepspeed_kernel and torch.is_tensor(value):
                    state[key] = local_piece(value)
                elif torch_optimizer and key == "step" and isinstance(value, (int, float)):
                    state[key] = restored_step(torch.tensor(float(value)), param, group)
