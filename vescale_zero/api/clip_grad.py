"""Global gradient-norm clipping over ragged shards.

Each rank holds a disjoint piece of every sharded gradient (padding excluded, since it
is never a parameter's view), so the global ``p``-norm is one all-reduce of the local
sums of ``|g|^p`` (``max`` for the inf-norm). Parameters outside any group are replicated:
each rank adds them once after the reduction. The local sum lives on the groups' device
(a rank holding no gradient, an expert without tokens, still joins the all-reduce, with
a zero on that device: never on the CPU, which NCCL refuses).

[Note: several process groups]
Groups may be sharded over different process groups (MoE: experts over the expert-data-
parallel group, the rest over the data-parallel group). Each element still lives on one rank
of its own group, so the norm is one reduction per process group of that group's local terms,
and the totals add up (max for the inf-norm). The reductions run in the order the groups are
listed, which is the module's order on every rank, so no rank waits on another's collective.
Adapters whose pieces are already unique across a larger group (the Megatron optimizer:
across the whole world) pass that one group to :func:`grad_norm_over_groups`. A
tensor-parallel parameter's pieces are spread over its shard group and the tp ranks that
shard it (tensor_parallel [Note: ragged inside the tensor-parallel piece]): its terms are
reduced over each of those groups in turn; a parameter replicated over tp is counted once.

[Note: replicas agree on the norm]
Ranks that hold replicas of the same pieces -- HSDP's replicas, the tp ranks of a parameter
replicated over tp (a ``SequenceParallel`` norm, and every plain parameter of a model with
tensor parallelism) -- reduce the same terms only while the replicas are equal. When they are
not (a NaN or an Inf on one rank only, a rank that dropped its gradients) each would get the
norm of its own replica: clip by another coefficient, or decide another way whether to skip a
step (nonfinite [Note: skipping a non-finite step]), and the replicas drift apart silently.
So the total is agreed on over the replica groups (HSDP's replicate group, the tp dimensions of
the module's tensor-parallel parameters): the largest, or NaN if any replica's is NaN (one
all-reduce of ``(total, is NaN)`` per such group; equal replicas keep their value bit for bit).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.comm_device import collective_device
from ..primitives.ragged_tensor import local_piece
from ..primitives.tensor_parallel import reduction_dims
from .fully_shard import groups_of

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "grad_norm_over_groups", "sharded_grad_norm"]


Groups = Tuple[dist.ProcessGroup, ...]


def _reduced_over(group, index: int) -> Groups:
    """The process groups a parameter's norm terms are reduced over, in turn."""
    if group.managed[index].tp is None:
        return (group.process_group,)
    spec = group.sharded_params[index]._spec
    return tuple(spec.mesh.get_group(d) for d in reduction_dims(spec))


def _split(module: nn.Module) -> Tuple[Dict[tuple, Tuple[Groups, List[torch.Tensor]]], List[torch.Tensor],
                                      Optional[torch.device]]:
    """``({ids: (process groups, their sharded grads)}, replicated grads, the groups'
    device)``; the process groups in the order the module's groups first name them (the same
    order on every rank: see [Note: several process groups])."""
    groups = groups_of(module)
    sharded_ids = {id(p) for g in groups for p in g.sharded_params + g.unsharded_params}
    by_pg: Dict[tuple, Tuple[Groups, List[torch.Tensor]]] = {}
    for g in groups:
        for i in g.grad_indices:  # every rank names the same groups, with a gradient here or not
            pgs = _reduced_over(g, i)
            pieces = by_pg.setdefault(tuple(map(id, pgs)), (pgs, []))[1]
            piece = local_piece(g.sharded_params[i].grad)
            if piece is not None:
                pieces.append(piece)
    replicated = [p.grad for p in module.parameters() if id(p) not in sharded_ids and p.grad is not None]
    return by_pg, replicated, groups[0].device if groups else None


def _local_norm_term(grads: List[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """This rank's part of the norm: the max (inf) or min (-inf) of its pieces' ``|g|``, else
    the sum of their ``|g|^p``; an empty piece adds nothing (runtime's identity: 0, or +inf for -inf)."""
    grads = [g for g in grads if g.numel()]
    if math.isinf(norm_type):
        identity = torch.full((), 0.0 if norm_type > 0 else math.inf, dtype=torch.float32, device=device)
        if not grads:
            return identity
        extreme = torch.amax if norm_type > 0 else torch.amin
        return extreme(torch.stack([extreme(g.detach().abs()).float() for g in grads]))
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum(torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) ** norm_type for g in grads)


def _checked_norm_type(norm_type: Union[float, int]) -> float:
    norm_type = float(norm_type)
    if norm_type == 0:
        raise ValueError(
            "norm_type 0 is not supported by vescale_zero's clip_grad_norm_ / sharded_grad_norm (torch's total "
            "'0-norm' counts the gradients with a non-zero element, per tensor); call "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=0) on the sharded parameters")
    return norm_type


@torch.no_grad()
def grad_norm_over_groups(pieces: Sequence[Tuple[Union[None, dist.ProcessGroup, Groups], List[torch.Tensor]]],
                          norm_type: Union[float, int] = 2.0, device: Optional[torch.device] = None) -> torch.Tensor:
    """The ``norm_type``-norm of gradients held as disjoint pieces: each entry is ``(process
    group, this rank's pieces)``, whose local ``|g|^p`` sum (max for the inf-norm) is reduced
    over that group (a tuple of groups: over each in turn); ``None`` as the group: pieces
    counted once, on this rank alone (replicated gradients). Every rank passes its groups in the
    same order (see [Note: several process groups]). Any ``p`` but 0 (inf, -inf, negative and
    fractional ones), as ``torch.nn.utils.clip_grad_norm_`` defines it. A 0-dim fp32 tensor on
    ``device`` (default: the first piece's, else the CPU); nothing is read on the host."""
    norm_type = _checked_norm_type(norm_type)
    inf = math.isinf(norm_type)
    if device is None:
        device = next((g.device for _, grads in pieces for g in grads), torch.device("cpu"))
    total = torch.full((), math.inf if norm_type == -math.inf else 0.0, dtype=torch.float32, device=device)
    for pg, grads in pieces:
        pgs = pg if isinstance(pg, tuple) else (() if pg is None else (pg,))
        where = collective_device(pgs[0], device) if pgs else device
        term = _local_norm_term(grads, norm_type, where)
        op = (dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN) if inf else dist.ReduceOp.SUM
        for each in pgs:
            dist.all_reduce(term, op=op, group=each)
        if inf:
            total = (torch.maximum if norm_type > 0 else torch.minimum)(total, term.to(device))
        else:
            total = total + term.to(device)
    return total if inf else total ** (1.0 / norm_type)


def _replica_groups(module: nn.Module) -> Groups:
    """The process groups over which ``module``'s ranks hold replicas
    ([Note: replicas agree on the norm]), in the order its groups first name them (the same on every rank)."""
    found: Dict[int, dist.ProcessGroup] = {}
    for g in groups_of(module):
        if g.replicate_group is not None:
            found.setdefault(id(g.replicate_group), g.replicate_group)
        for m in g.managed:
            if m.tp is not None:
                for d in range(m.tp.mesh.ndim):
                    if d != m.tp.ragged_dim:
                        pg = m.tp.mesh.get_group(d)
                        found.setdefault(id(pg), pg)
    return tuple(found.values())


def _agreed(total: torch.Tensor, replica_groups: Groups) -> torch.Tensor:
    """[Note: replicas agree on the norm]: the largest of the replicas' totals, NaN if any is NaN."""
    if not replica_groups:
        return total
    pair = torch.stack([total, torch.isnan(total).to(total.dtype)])
    for pg in replica_groups:
        where = collective_device(pg, total.device)
        on = pair.to(where)
        dist.all_reduce(on, op=dist.ReduceOp.MAX, group=pg)
        pair = on.to(total.device)
    return torch.where(pair[1] > 0, torch.full_like(total, math.nan), pair[0])


def sharded_grad_norm(module: nn.Module, norm_type: Union[float, int] = 2.0) -> torch.Tensor:
    """The norm of all of ``module``'s gradients, as if they were unsharded (groups sharded
    over several process groups included: see [Note: several process groups]), the same on
    every replica ([Note: replicas agree on the norm])."""
    by_pg, replicated, device = _split(module)
    if device is None:
        device = replicated[0].device if replicated else torch.device("cpu")
    total = grad_norm_over_groups(list(by_pg.values()) + [(None, replicated)], norm_type, device)
    return _agreed(total, _replica_groups(module))


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: Union[float, int] = 2.0) -> torch.Tensor:
    """Scale all of ``module``'s gradients so their global norm is at most ``max_norm``.

    Same rule as ``torch.nn.utils.clip_grad_norm_``; returns the total norm before clipping.
    """
    total = sharded_grad_norm(module, norm_type)
    clip_grads_with_norm_(module, max_norm, total)
    return total


def clip_grads_with_norm_(module: nn.Module, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale all of ``module``'s gradients by ``max_norm / total_norm`` (at most 1): the second half
    of :func:`clip_grad_norm_` for a caller that took the norm already (torch's
    ``clip_grads_with_norm_``)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    groups = groups_of(module)
    if any(g.grads.post_finish_hooks for g in groups) and coef.item() == 1.0:
        return  # a coefficient of 1 changes nothing: optim/muon_hidden [Note: the Muon step hidden in backward]
    for group in groups:
        buffer = group.sharded_grad.live  # None: no gradient of the group is in it
        lo = hi = 0
        if buffer is not None:
            buffer.mul_(coef.to(buffer.dtype))  # one op per group; padding is never read
            lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        for i in group.grad_indices:  # a .grad the user replaced is not in the buffer
            g = local_piece(group.sharded_params[i].grad)
            if g is not None and g.numel() and not lo <= g.data_ptr() < hi:
                g.detach().mul_(coef.to(g.dtype))
    _, replicated, _ = _split(module)
    for g in replicated:
        g.detach().mul_(coef.to(g.dtype))
