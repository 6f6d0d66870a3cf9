"""fp16 loss scaling: unscale the gradients and find an overflow, in one place for every
adapter (the DeepSpeed engine's fp16 step, the Megatron optimizer's ``prepare_grads``).

[Note: the overflow flag stays on the device]
``unscale_and_find_inf`` multiplies every gradient by ``inv_scale`` and raises a flag if any
of them held an inf or nan (``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel
``torch.amp.GradScaler`` uses), then takes the flag's MAX over the process group, so every
rank sees the same answer. Nothing is read on the host: the caller decides whether and
when to read the flag (skipping a step is a host decision, made once per step). The check
looks at the scaled values; with a scale >= 1 (DeepSpeed's and Megatron's minimum is 1),
unscaling cannot overflow, so the answer is the same as checking after.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["unscale_and_find_inf"]


@torch.no_grad()
def unscale_and_find_inf(grads: Sequence[torch.Tensor], inv_scale: Union[torch.Tensor, float],
                         device: torch.device, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Multiply ``grads`` (local tensors) by ``inv_scale`` in place; return a 1-element fp32
    tensor on ``device`` (the collective's device), > 0 iff a gradient on some rank of
    ``group`` held an inf or nan (see [Note: the overflow flag stays on the device])."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for where, tensors in by_device.items():
        inv = (inv_scale.to(where, torch.float32).reshape(1) if torch.is_tensor(inv_scale)
               else torch.full((1,), inv_scale, dtype=torch.float32, device=where))
        here = torch.zeros(1, dtype=torch.float32, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, here, inv)
        found = torch.maximum(found, here.to(device))
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found
