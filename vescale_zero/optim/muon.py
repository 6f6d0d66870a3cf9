"""Distributed Muon on ragged shards: each matrix is orthogonalised whole, on one root rank.

::

    rank 0: | a0 | b0 |        momentum update, element-wise, on each rank's pieces
    rank 1: | a1 | b1 | c  |
    rank 2:      | b2 | d  |
                  all_to_all   pieces -> the matrix's root (a: rank 0, b: rank 2)
    root of a: a = [a0 a1] -> Newton-Schulz -> O(a)     (c, d: whole on one rank, done there)
                  all_to_all   each rank's piece of O(.) back
    every rank:  p -= lr * (O(piece) + wd * p)

[Note: Muon's roots]
A matrix whole on one rank (the plan put it there: ``fully_shard(optimizer_aware=True)``, or
no rank boundary happens to cut it) is orthogonalised on that rank and moves nowhere: no
collective carries it. A matrix in pieces goes to a root among the ranks holding its largest
piece (the fewest bytes), the least loaded of them, largest Newton-Schulz cost
(``m*n*min(m, n)``) first, after the whole ones loaded their ranks; only the pieces of such
matrices travel, by one ``all_to_all_single`` there (uneven splits; gloo and NCCL) and one
back. A step whose matrices all lie whole runs no collective for them. The first move is
asynchronous, and the AdamW update of the non-matrix parameters runs while it is in flight.
The root sees exactly the matrix an unsharded run sees, so given the same gradients the
sharded update equals the unsharded one, wherever the root is.

[Note: a matrix without a gradient]
A matrix whose ``.grad`` is ``None`` on every rank is not stepped (no momentum, no update, no
weight decay), as torch's optimizers skip a parameter without a gradient, so
``vz.skip_nonfinite_steps`` (which sets every ``.grad`` to ``None``) skips Muon's matrices too.
One with a gradient on some ranks only steps with zeros for the missing pieces. Whether any rank
has one is agreed on by one small all-reduce per step (the moves' splits must agree).

Newton-Schulz: the quintic iteration with coefficients (3.4445, -4.7750, 2.0315) on the
Frobenius-normalised matrix (transposed when it has more rows than columns), in fp32; the
update is scaled by ``max(1, rows / cols) ** 0.5``. Non-matrix parameters (and groups with
``use_muon=False``) take torch's AdamW with the ``adamw_*`` hyper-parameters (:mod:`.adamw_part`).
The step hidden in backward (``hide_in_backward=True``): :mod:`.muon_hidden`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import all_to_all_single

from ..api.optimizer_aware import OptimizerAware, whole_matrices
from ..primitives.comm_device import collective_device, current_device
from ..primitives.ragged_tensor import is_ragged, local_piece
from ..runtime.param_group import slot_of
from .adamw_part import adamw_step

__all__ = ["Muon", "newton_schulz", "assign_roots", "MuonLayout", "orthogonalise"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The (approximately) orthogonal factor of ``g`` (2-D), in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def assign_roots(costs: Sequence[float], world_size: int,
                 candidates: Optional[Sequence[Sequence[int]]] = None) -> List[int]:
    """Greedy root of each matrix: largest cost first, to the least loaded of its ``candidates``
    (default: every rank); deterministic ([Note: Muon's roots])."""
    load = [0.0] * world_size
    roots = [0] * len(costs)
    everyone = range(world_size)
    order = sorted(range(len(costs)), key=lambda k: (candidates is not None and len(candidates[k]) > 1, -costs[k], k))
    for k in order:
        r = min(candidates[k] if candidates is not None else everyone, key=lambda r: (load[r], r))
        roots[k] = r
        load[r] += costs[k]
    return roots


def _matrix_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class MuonLayout:
    """Where every Muon matrix lies and where it is orthogonalised ([Note: Muon's roots]).

    ``ranges[r][k]``: rank ``r``'s flat ``[start, end)`` of matrix ``k``; ``roots[k]`` its root;
    ``moving[k]``: it lies on more than one rank, so its pieces travel."""

    key: Tuple[int, ...]
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    ranges: Tuple[Tuple[Tuple[int, int], ...], ...]
    shapes: Tuple[Tuple[int, int], ...]
    costs: Tuple[float, ...]
    roots: Tuple[int, ...]
    moving: Tuple[bool, ...]

    @staticmethod
    def of(key: Sequence[int], group: Optional[dist.ProcessGroup], rank: int,
           ranges: Sequence[Sequence[Tuple[int, int]]], shapes: Sequence[Tuple[int, int]]) -> "MuonLayout":
        world = len(ranges)
        costs = [float(m * n * min(m, n)) for m, n in shapes]
        sizes = [[ranges[r][k][1] - ranges[r][k][0] for r in range(world)] for k in range(len(shapes))]
        holders = [[r for r in range(world) if s[r] == max(s)] for s in sizes]
        roots = assign_roots(costs, world, holders)
        moving = tuple(sum(1 for n in s if n) > 1 for s in sizes)
        return MuonLayout(tuple(key), group, world, rank, tuple(tuple(tuple(x) for x in r) for r in ranges),
                          tuple(shapes), tuple(costs), tuple(roots), moving)

    def size(self, rank: int, k: int) -> int:
        start, end = self.ranges[rank][k]
        return end - start

    def bytes_sent(self, ks: Iterable[int], itemsize: int = 4) -> List[int]:
        """Per rank: the bytes it sends in both moves for matrices ``ks`` (what it receives too)."""
        sent = [0] * self.world
        for k in ks:
            if not self.moving[k]:
                continue
            root = self.roots[k]
            for r in range(self.world):
                if r != root:
                    sent[r] += self.size(r, k) * itemsize  # to the root
                    sent[root] += self.size(r, k) * itemsize  # and back
        return sent


def orthogonalise(layout: MuonLayout, ks: Sequence[int], directions: Dict[int, torch.Tensor],
                  ns_steps: Dict[int, int], group: Optional[dist.ProcessGroup], device: torch.device,
                  while_moving: Callable[[], None] = lambda: None) -> Dict[int, torch.Tensor]:
    """This rank's flat piece of the scaled orthogonal update of each matrix in ``ks``, given its
    flat piece of each one's direction ([Note: Muon's roots]); ``ks`` the same on every rank."""
    world, rank, ranges, roots = layout.world, layout.rank, layout.ranges, layout.roots
    empty = torch.empty(0, device=device)
    updates: Dict[int, torch.Tensor] = {}

    def finished(k: int, whole: torch.Tensor) -> torch.Tensor:
        m, n = layout.shapes[k]
        return (newton_schulz(whole.view(m, n), ns_steps[k]) * max(1.0, m / n) ** 0.5).reshape(-1)

    moving = [k for k in ks if layout.moving[k]]
    if moving:  # 1. pieces to their roots (one all_to_all; splits in matrix order per destination)
        send = [torch.cat([directions[k] for k in moving if roots[k] == r] or [empty]) for r in range(world)]
        recv_sizes = [sum(layout.size(s, k) for k in moving if roots[k] == rank) for s in range(world)]
        received, work = _exchange(send, recv_sizes, device, group, async_op=True)
    for k in ks:  # whole on one rank: orthogonalised where it lies, while the pieces travel
        if not layout.moving[k]:
            updates[k] = finished(k, directions[k]) if layout.size(rank, k) else directions[k]
    while_moving()
    if not moving:
        return updates
    if work is not None:
        work.wait()
    # 2. Newton-Schulz on the matrices rooted here, pieces joined in rank order
    offsets = [0] * world
    chunks = list(received.split(recv_sizes))
    results: Dict[int, torch.Tensor] = {}
    for k in moving:
        if roots[k] != rank:
            continue
        pieces = []
        for s in range(world):
            pieces.append(chunks[s].narrow(0, offsets[s], layout.size(s, k)))
            offsets[s] += layout.size(s, k)
        results[k] = finished(k, torch.cat(pieces))
    # 3. each rank's piece of every result back (the reverse all_to_all)
    back = [torch.cat([results[k][ranges[s][k][0]:ranges[s][k][1]] for k in moving if roots[k] == rank] or [empty])
            for s in range(world)]
    mine_sizes = [sum(layout.size(rank, k) for k in moving if roots[k] == r) for r in range(world)]
    returned, _ = _exchange(back, mine_sizes, device, group)
    per_root = list(returned.split(mine_sizes))
    cursor = [0] * world
    for k in moving:
        r = roots[k]
        updates[k] = per_root[r].narrow(0, cursor[r], layout.size(rank, k))
        cursor[r] += layout.size(rank, k)
    return updates


def _exchange(send: List[torch.Tensor], recv_sizes: List[int], device: torch.device,
              group: Optional[dist.ProcessGroup], async_op: bool = False):
    """``(received, work)``: one all_to_all_single; ``work`` to wait on when async."""
    if len(send) == 1:
        return send[0], None
    out = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
    work = all_to_all_single(out, torch.cat(send), output_split_sizes=recv_sizes,
                             input_split_sizes=[t.numel() for t in send], group=group, async_op=async_op)
    return out, work


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (see module docstring).

    Args:
        lr, momentum, nesterov, ns_steps, weight_decay: Muon's (decoupled weight decay).
        adamw_lr, adamw_betas, adamw_eps: AdamW for non-matrix parameters.
        process_group: the group every Muon parameter is sharded over (default: world).
        hide_in_backward: start each ``fully_shard`` group's step (momentum, the moves to the
            roots, Newton-Schulz, the moves back) as soon as its gradients are reduce-scattered,
            while backward goes on; ``step()`` then waits and applies
            (:mod:`vescale_zero.optim.muon_hidden`, [Note: the Muon step hidden in backward]).

    After each step ``last_step_stats`` holds ``ns_cost`` (per rank: sum of m*n*min(m,n)
    of the matrices it orthogonalised), ``bytes_moved`` (this rank's bytes sent to other
    ranks, both moves), and with ``hide_in_backward`` ``hidden`` / ``recomputed`` (matrices
    whose update came from backward / was computed again in ``step()``).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        adamw_lr: float = 3e-4,
        adamw_betas: Tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        process_group: Optional[dist.ProcessGroup] = None,
        hide_in_backward: bool = False,
    ) -> None:
        if ns_steps < 1:
            raise ValueError(f"Muon: ns_steps must be >= 1 Newton-Schulz iterations, got {ns_steps}")
        if lr < 0 or adamw_lr < 0:
            raise ValueError(f"Muon: learning rates must be >= 0, got lr={lr}, adamw_lr={adamw_lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay,
                        adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps, use_muon=None)
        super().__init__(params, defaults)
        self.process_group = process_group
        self.last_step_stats: Dict[str, object] = {}
        self._layout: Optional[MuonLayout] = None
        self._hidden = None
        if hide_in_backward:
            from .muon_hidden import HiddenStep  # layer 4 on layer 4: the hidden step's machinery

            self._hidden = HiddenStep(self)

    @staticmethod
    def optimizer_aware(micro_batches: int = 1, force: Optional[str] = None) -> OptimizerAware:
        """``fully_shard``'s ``optimizer_aware`` argument for Muon: whole matrices where that moves
        fewer bytes per step (``force``: ``"piecewise"`` or ``"placed"``, see ``OptimizerAware``)."""
        return OptimizerAware(whole_matrices, micro_batches=micro_batches, force=force)

    # ---- which parameters, where -----------------------------------------------------
    @staticmethod
    def _full_shape(p: torch.Tensor) -> Tuple[int, ...]:
        rng = getattr(p, "sharded_range", None)
        return tuple(rng.shape) if rng is not None else tuple(p.shape)

    def _muon_params(self) -> List[Tuple[torch.Tensor, dict]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                shape = self._full_shape(p)
                use = group["use_muon"] if group["use_muon"] is not None else len(shape) >= 2
                if use and len(shape) < 2:
                    raise ValueError(f"Muon: use_muon=True on a {len(shape)}-D parameter of shape {shape}; Muon "
                                     "orthogonalises matrices only (leave use_muon unset for 1-D parameters)")
                if use and p.requires_grad:
                    out.append((p, group))
        return out

    def _group_of(self, params: List[torch.Tensor]) -> Optional[dist.ProcessGroup]:
        """The process group the sharded parameters are sharded over (the shard group under
        HSDP: replicas hold equal shards and step alike), checked against ``process_group``."""
        slots = [slot_of(p) for p in params]
        groups = {id(s[0].process_group): s[0].process_group for s in slots if s is not None}
        if len(groups) > 1:
            raise ValueError("Muon: the parameters are sharded over different process groups; make one Muon "
                             "per process group (pass process_group=...) with that group's parameters")
        sharded_over = next(iter(groups.values()), None)
        if self.process_group is None:
            return sharded_over
        if sharded_over is not None and dist.get_process_group_ranks(self.process_group) != \
                dist.get_process_group_ranks(sharded_over):
            raise ValueError(
                f"Muon: process_group has ranks {dist.get_process_group_ranks(self.process_group)} but the "
                f"parameters are sharded over ranks {dist.get_process_group_ranks(sharded_over)} (under HSDP: the "
                "shard group); leave process_group unset to use the parameters' group")
        return self.process_group

    def _plan(self, params: List[torch.Tensor]) -> MuonLayout:
        """Every rank's flat range of every Muon matrix, and each matrix's root (cached)."""
        key = tuple(id(p) for p in params)
        if self._layout is not None and self._layout.key == key:
            return self._layout
        distributed = dist.is_initialized() and any(hasattr(p, "sharded_range") for p in params)
        pg = self._group_of(params) if distributed else None
        world = dist.get_world_size(pg) if distributed else 1
        rank = dist.get_rank(pg) if distributed else 0
        mine = [(p.sharded_range.start, p.sharded_range.end) if hasattr(p, "sharded_range") else (0, p.numel())
                for p in params]
        if not distributed:
            ranges = [mine]
        elif all(is_ragged(p) for p in params):  # every rank's range is in the placement
            ranges = [[p.ragged_placement.local_range(r) for p in params] for r in range(world)]
        else:
            ranges = [None] * world
            with current_device(params[0].device):  # the object collective's device on NCCL
                dist.all_gather_object(ranges, mine, group=pg)
        shapes = [_matrix_shape(self._full_shape(p)) for p in params]
        self._layout = MuonLayout.of(key, pg, rank, ranges, shapes)
        return self._layout

    # ---- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon = self._muon_params()
        muon_ids = {id(p) for p, _ in muon}

        def adamw_rest() -> None:
            for group in self.param_groups:
                adamw_step([p for p in group["params"] if id(p) not in muon_ids and p.grad is not None], self.state,
                           lr=group["adamw_lr"], betas=group["adamw_betas"], eps=group["adamw_eps"],
                           weight_decay=group["weight_decay"])

        if muon:
            self._muon_step(muon, while_moving=adamw_rest)  # AdamW runs while the pieces travel
        else:
            adamw_rest()
        return loss

    def _agreed_flags(self, layout: MuonLayout, *flags: List[bool]) -> List[List[bool]]:
        """Each list of per-matrix flags OR-ed over the ranks (one all-reduce; none on one rank)."""
        if layout.world == 1:
            return [list(f) for f in flags]
        device = collective_device(layout.group, self._device())
        t = torch.tensor([x for f in flags for x in f], dtype=torch.float32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=layout.group)
        values = [bool(v) for v in t.tolist()]
        n = len(layout.key)
        return [values[i * n:(i + 1) * n] for i in range(len(flags))]

    def _device(self) -> torch.device:
        first = self.param_groups[0]["params"][0]
        return local_piece(first).device

    def _direction(self, p: torch.Tensor, group: dict, commit: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(direction, momentum)``: this rank's flat piece of the Nesterov (or plain momentum)
        direction of ``p`` and of its momentum after this step; ``commit`` updates the state in place."""
        state = self.state[p]
        grad = local_piece(p.grad) if p.grad is not None else torch.zeros_like(local_piece(p))
        g = grad.float().reshape(-1)
        buf = state.get("momentum_buffer")
        if buf is None and commit:
            buf = state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        if buf is None:
            new = torch.zeros_like(g).mul_(group["momentum"]).add_(g)
        else:
            own = local_piece(buf).view(-1)
            new = own.mul_(group["momentum"]) if commit else own.mul(group["momentum"])
            new.add_(g)
        direction = g.add(new, alpha=group["momentum"]) if group["nesterov"] else new.clone()
        return direction, new

    def _muon_step(self, muon: List[Tuple[torch.Tensor, dict]],
                   while_moving: Callable[[], None] = lambda: None) -> None:
        params = [p for p, _ in muon]
        layout = self._plan(params)
        hidden = self._hidden.collect(layout, muon) if self._hidden is not None else {}
        has_grad = [p.grad is not None for p in params]
        if self._hidden is None:
            (has_grad,), stale = self._agreed_flags(layout, has_grad), [True] * len(muon)
        else:
            has_grad, stale = self._agreed_flags(layout, has_grad, [k not in hidden for k in range(len(muon))])
        updates: Dict[int, torch.Tensor] = {}
        for k, (p, _) in enumerate(muon):  # from backward: the momentum it computed is this step's
            if has_grad[k] and not stale[k]:
                new_momentum, updates[k] = hidden[k]
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                local_piece(state["momentum_buffer"]).view(-1).copy_(new_momentum)
        now = [k for k in range(len(muon)) if has_grad[k] and stale[k]]
        directions = {k: self._direction(*muon[k], commit=True)[0] for k in now}
        ns_steps = {k: muon[k][1]["ns_steps"] for k in now}
        group = self._hidden.comm_group if self._hidden is not None else layout.group
        updates.update(orthogonalise(layout, now, directions, ns_steps, group, self._device(), while_moving))
        for k, (p, group) in enumerate(muon):  # apply, decoupled weight decay
            if k not in updates:
                continue
            local = local_piece(p)
            if group["weight_decay"]:
                local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(updates[k].view_as(local).to(local.dtype), alpha=-group["lr"])
        load = [0.0] * layout.world
        stepped = [k for k in range(len(muon)) if has_grad[k]]
        for k in stepped:
            load[layout.roots[k]] += layout.costs[k]
        self.last_step_stats = {"ns_cost": load, "bytes_moved": layout.bytes_sent(stepped)[layout.rank]}
        if self._hidden is not None:
            self.last_step_stats.update(hidden=len(stepped) - len(now), recomputed=len(now))
