"""Megatron's distributed-optimizer state in a ``--ckpt-format torch`` checkpoint
(``distrib_optim.pt`` beside ``model_optim_rng.pt``), by parameter.

[Note: distrib_optim.pt layout] Under ``--use-distributed-optimizer`` Megatron-LM's torch-format
save writes the optimizer's ``state_dict()`` (hyperparameters and step, no tensors) into the
model file and its parameter state into ``distrib_optim.pt``, gathered on data-parallel rank 0
(megatron-core 0.16.1 ``DistributedOptimizer.get_parameter_state_dp_zero``):
``{"buckets_coalesced": True, buffer index: {(param dtype, grad dtype): {"param", "exp_avg",
"exp_avg_sq": 1-D fp32 tensors, "numel_unpadded": n}}}``, one entry per gradient buffer of
megatron-core's DDP. A buffer holds the parameters in reverse order of ``module.parameters()``,
each starting on a multiple of 64 elements; the file drops the padding at the end of each
bucket, so where the buffer was cut into buckets (``--ddp-bucket-size`` under
``--overlap-grad-reduce``, a shared embedding's own bucket) it is shorter than that layout
by the 64-alignment padding dropped at each cut, unless none was needed there (then the two
layouts coincide). So a buffer whose length equals the layout's is read by it exactly; any
other is refused, naming the ways that load it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from vescale_zero.hosts import sharded_params_by_key

__all__ = ["megatron_parameter_state", "LAYOUT_FIX"]

_ALIGN = 64  # elements: where megatron-core's DDP starts each parameter under the distributed optimizer
_STATES = ("param", "exp_avg", "exp_avg_sq")
LAYOUT_FIX = ("re-save it once with Megatron (--load this --save new --ckpt-format torch_dist "
              "--dist-ckpt-optim-fully-reshardable, same layout) and load that, or resume the weights only with "
              "--no-load-optim")


def _layout(module: nn.Module, trained: set) -> Tuple[List[Tuple[str, int, int, torch.Size]], int]:
    """``([(key, start, end, full shape)], length)``: where megatron-core's DDP puts each dense
    trained parameter of ``module`` in a single-bucket buffer (see the Note)."""
    params = [(key, p) for key, p in sharded_params_by_key(module).items()
              if id(p) in trained and p.requires_grad and getattr(p, "allreduce", True)]
    out, offset = [], 0
    for key, param in reversed(params):
        shape = torch.Size(param.sharded_range.shape)
        start = -(-offset // _ALIGN) * _ALIGN
        out.append((key, start, start + shape.numel(), shape))
        offset = start + shape.numel()
    return out, offset


def megatron_parameter_state(module: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                             state: Any) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{state-dict key: {"param": fp32 master, "exp_avg", "exp_avg_sq"}}`` (full, TP-local
    tensors: views of ``state``'s) from ``state``, the content of Megatron's ``distrib_optim.pt``
    at ``path``, for the sharded ``module`` that ``optimizer`` trains. Raises ``ValueError``
    naming the fix where the layout cannot be told without Megatron's buckets."""
    problem = None
    if isinstance(state, list):
        problem = "it holds the states of several chained optimizers (dense and expert parameters)"
    elif not isinstance(state, dict) or not state.get("buckets_coalesced", False):
        problem = "it is in the legacy per-bucket format (buckets not coalesced)"
    buffers = {k: v for k, v in state.items() if isinstance(k, int)} if problem is None else {}
    if problem is None and (len(buffers) != 1 or len(buffers[0]) != 1):
        problem = f"it holds {sum(len(b) for b in buffers.values())} gradient buffers (one per parameter dtype)"
    if problem is None:
        (dtypes, world), = buffers[0].items()
        trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
        layout, length = _layout(module, trained)
        if int(world["numel_unpadded"]) != length:
            problem = (f"its buffer {dtypes} holds {int(world['numel_unpadded'])} elements where one bucket of this "
                       f"model's parameters would hold {length} (cut into buckets by --ddp-bucket-size, or another "
                       "model)")
    if problem is not None:
        raise ValueError(f"{path}: Megatron's distributed-optimizer state cannot be mapped to the parameters: "
                         f"{problem}; {LAYOUT_FIX}")
    return {key: {name: world[name][start:end].view(shape) for name in _STATES}
            for key, start, end, shape in layout}
