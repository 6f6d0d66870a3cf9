"""Skip an optimizer step whose gradients hold NaN or Inf, as DeepSpeed's ZeRO-3 skips it (opt-in).

[Note: skipping a non-finite step]
DeepSpeed's ZeRO-3 (in fp32, bf16 and fp16 alike) takes the global norm of the step's gradients
and, when it is not finite, does not step: the weights and the optimizer state stay, the LR
scheduler does not step, ``skipped_steps`` counts it, and every rank decides alike (the norm is
all-reduced). PyTorch's optimizers apply whatever gradients they get, so one NaN in a loss puts
NaN in every weight it reaches. For ``fully_shard`` users the same rule is an option::

    model = vz.fully_shard_layers(model)
    optimizer = torch.optim.AdamW(model.parameters())
    guard = vz.skip_nonfinite_steps(model, optimizer)
    for batch in data:
        model(batch).backward()
        optimizer.step()                    # a no-op when any rank's gradient is not finite
        if not guard.last_step_skipped:
            scheduler.step()                # as DeepSpeed: the schedule waits for an applied step
        optimizer.zero_grad()

A step pre-hook on the optimizer takes the global 2-norm of ``model``'s gradients
(:func:`vescale_zero.sharded_grad_norm`: one all-reduce per process group, the same answer on
every rank) and, if it is not finite, sets every gradient the optimizer holds to ``None``, so the
optimizer's own ``step()`` steps nothing (torch's optimizers and vescale_zero.optim skip a
parameter without a gradient: no update, no weight decay, no state change). Deciding is a host
decision: one host read of the norm per step, as DeepSpeed's and Megatron's checks make. The
model's gradients decide; a parameter of the optimizer outside ``model`` is skipped with them.

The DeepSpeed engine under "ragged" does the same itself, folded into the norm it reports every
step (integrations/deepspeed/engine.py); Megatron keeps its own check (its optimizer's
``found_inf`` and ``check_for_nan_in_grad``), so the Megatron adapter registers nothing here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .clip_grad import sharded_grad_norm

__all__ = ["skip_nonfinite_steps", "NonFiniteStepSkipper"]


class NonFiniteStepSkipper:
    """The handle :func:`skip_nonfinite_steps` returns (see [Note: skipping a non-finite step]).

    Attributes:
        skipped_steps: steps skipped so far.
        last_step_skipped: whether the most recent ``optimizer.step()`` was skipped.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._handle = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.last_step_skipped = not math.isfinite(sharded_grad_norm(self.module).item())
        if self.last_step_skipped:
            self.skipped_steps += 1
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

    def remove(self) -> None:
        """Stop skipping (the optimizer applies every step again)."""
        self._handle.remove()


def skip_nonfinite_steps(module: nn.Module, optimizer: torch.optim.Optimizer) -> NonFiniteStepSkipper:
    """Make ``optimizer.step()`` a no-op whenever ``module``'s gradients hold NaN or Inf on any
    rank (see [Note: skipping a non-finite step]). Call on every rank with the root module (the
    one whose gradients decide) and the optimizer built on its parameters."""
    return NonFiniteStepSkipper(module, optimizer)
