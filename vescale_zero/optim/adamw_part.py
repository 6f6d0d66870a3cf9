"""AdamW for the parameters a preconditioning optimizer leaves alone (Muon's and Shampoo's
non-matrix and opted-out parameters): torch's own functional AdamW
(``torch.optim.adamw.adamw``), run on each rank's pieces, so that part of the step is
``torch.optim.AdamW``'s arithmetic, not a copy of it.

[Note: AdamW state beside a low-precision parameter]
``exp_avg`` / ``exp_avg_sq`` stay fp32 whatever the parameter's dtype (as before), and the
gradient is read in fp32. ``step`` is kept as torch.optim.AdamW keeps it: a float32 scalar on
the host (reading it waits for no device; torch increments it); a Python int from a state
saved before is taken over. torch's multi-tensor path needs one dtype across a parameter's tensors, so a
group holding any non-fp32 parameter takes its single-tensor path (``foreach=False``), which
casts the fp32 update once into the parameter; an all-fp32 group lets torch choose, as
``torch.optim.AdamW`` does.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
from torch.optim.adamw import adamw

from ..primitives.ragged_tensor import local_piece

__all__ = ["adamw_step"]


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], state: Dict[torch.Tensor, dict], *, lr: float,
               betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step of ``params`` (each with a ``.grad``), their moments in ``state[p]``
    (created on the first step: see [Note: AdamW state beside a low-precision parameter])."""
    if not params:
        return
    pieces, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in params:
        s = state[p]
        if "exp_avg" not in s:
            s["step"] = torch.tensor(0.0, device="cpu")  # on the host by design, whatever the default device
            s["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            s["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        pieces.append(local_piece(p))
        grads.append(local_piece(p.grad).float())
        exp_avgs.append(local_piece(s["exp_avg"]))
        exp_avg_sqs.append(local_piece(s["exp_avg_sq"]))
        if not torch.is_tensor(s["step"]):
            s["step"] = torch.tensor(float(s["step"]), device="cpu")
        steps.append(s["step"])
    foreach = None if all(t.dtype == torch.float32 for t in pieces) else False
    adamw(pieces, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=foreach, amsgrad=False, beta1=betas[0],
          beta2=betas[1], lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
