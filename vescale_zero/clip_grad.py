"""Global gradient-norm clipping over ragged shards.

Each rank holds a disjoint piece of every sharded gradient (padding excluded, since it
is never a parameter's view), so the global ``p``-norm is one all-reduce of the local
sums of ``|g|^p`` (``max`` for the inf-norm). Parameters outside any group are replicated:
each rank adds them once after the reduction. The local sum lives on the groups' device
(a rank holding no gradient, an expert without tokens, still joins the all-reduce, with
a zero on that device: never on the CPU, which NCCL refuses).
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .comm_device import collective_device
from .fully_shard import groups_of
from .ragged_tensor import local_piece

__all__ = ["clip_grad_norm_", "sharded_grad_norm"]


def _split(module: nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[dist.ProcessGroup],
                                      Optional[torch.device]]:
    """``(sharded grads, replicated grads, the groups' process group, their device)``."""
    groups = groups_of(module)
    sharded_ids = {id(p) for g in groups for p in g.sharded_params + g.unsharded_params}
    sharded = [local_piece(g.sharded_params[i].grad) for g in groups for i in g.grad_indices]
    replicated = [p.grad for p in module.parameters() if id(p) not in sharded_ids and p.grad is not None]
    pgs = {id(g.process_group): g.process_group for g in groups}
    if len(pgs) > 1:
        raise ValueError("clip_grad_norm_ over groups sharded on different process groups is not supported")
    device = groups[0].device if groups else None
    return [g for g in sharded if g is not None], replicated, next(iter(pgs.values()), None), device


def _local_norm_term(grads: List[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max() if g.numel() else g.new_zeros(()) for g in grads]).max().float()
    return sum(torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) ** norm_type for g in grads)


def sharded_grad_norm(module: nn.Module, norm_type: Union[float, int] = 2.0) -> torch.Tensor:
    """The norm of all of ``module``'s gradients, as if they were unsharded."""
    norm_type = float(norm_type)
    sharded, replicated, pg, device = _split(module)
    if pg is not None:
        device = collective_device(pg, device)
    elif device is None:
        device = replicated[0].device if replicated else torch.device("cpu")
    term = _local_norm_term(sharded, norm_type, device)
    if pg is not None:
        dist.all_reduce(term, op=dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM, group=pg)
    rep = _local_norm_term(replicated, norm_type, device)
    if norm_type == float("inf"):
        return torch.maximum(term, rep)
    return (term + rep) ** (1.0 / norm_type)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: Union[float, int] = 2.0) -> torch.Tensor:
    """Scale all of ``module``'s gradients so their global norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping.
    """
    total = sharded_grad_norm(module, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups_of(module):
        buffer = group.sharded_grad.live  # None: no gradient of the group is in it
        lo = hi = 0
        if buffer is not None:
            buffer.mul_(coef.to(buffer.dtype))  # one op per group; padding is never read
            lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        for i in group.grad_indices:  # a .grad the user replaced is not in the buffer
            g = local_piece(group.sharded_params[i].grad)
            if g is not None and g.numel() and not lo <= g.data_ptr() < hi:
                g.detach().mul_(coef.to(g.dtype))
    _, replicated, _, _ = _split(module)
    for g in replicated:
        g.detach().mul_(coef.to(g.dtype))
    return total
