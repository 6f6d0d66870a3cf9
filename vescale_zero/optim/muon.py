"""Distributed Muon on ragged shards: each matrix is orthogonalised whole, on one root rank.

::

    rank 0: | a0 | b0 |        momentum update, element-wise, on each rank's pieces
    rank 1: | a1 | b1 | c1 |
    rank 2:      | b2 | c2 |
                  all_to_all   pieces -> the matrix's root (a: rank 0, b: rank 2, c: rank 1)
    root of a: a = [a0 a1] -> Newton-Schulz -> O(a)     (roots balance m*n*min(m, n))
                  all_to_all   each rank's piece of O(.) back
    every rank:  p -= lr * (O(piece) + wd * p)

The roots are assigned greedily, largest Newton-Schulz cost first, to the least loaded rank,
so no rank does much more than its share. Both moves are one ``all_to_all_single`` each
(uneven splits; it works on gloo and NCCL); the first is asynchronous, and the AdamW update
of the non-matrix parameters runs while it is in flight. The root sees exactly the matrix an unsharded
run sees, so given the same gradients the sharded update equals the unsharded one.

Newton-Schulz: the quintic iteration with coefficients (3.4445, -4.7750, 2.0315) on the
Frobenius-normalised matrix (transposed when it has more rows than columns), in fp32; the
update is scaled by ``max(1, rows / cols) ** 0.5``. Non-matrix parameters (and groups with
``use_muon=False``) take torch's AdamW with the ``adamw_*`` hyper-parameters (:mod:`.adamw_part`).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..primitives.comm_device import current_device
from ..primitives.ragged_tensor import is_ragged, local_piece
from ..runtime.param_group import slot_of
from .adamw_part import adamw_step

__all__ = ["Muon", "newton_schulz", "assign_roots"]

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


def assign_roots(costs: Sequence[float], world_size: int) -> List[int]:
    """Greedy (largest first, least loaded rank) root of each matrix; deterministic."""
    load = [0.0] * world_size
    roots = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        roots[k] = r
        load[r] += costs[k]
    return roots


def _matrix_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    return shape[0], math.prod(shape[1:])


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest (see module docstring).

    Args:
        lr, momentum, nesterov, ns_steps, weight_decay: Muon's (decoupled weight decay).
        adamw_lr, adamw_betas, adamw_eps: AdamW for non-matrix parameters.
        process_group: the group every Muon parameter is sharded over (default: world).

    After each step ``last_step_stats`` holds ``ns_cost`` (per rank: sum of m*n*min(m,n)
    of the matrices it orthogonalised) and ``bytes_moved`` (this rank's bytes sent to other
    ranks, both moves).
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
        self._layout: Optional[dict] = None

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

    def _plan(self, params: List[torch.Tensor]) -> dict:
        """Every rank's flat range of every Muon matrix, and each matrix's root (cached)."""
        key = [id(p) for p in params]
        if self._layout is not None and self._layout["key"] == key:
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
        costs = [m * n * min(m, n) for m, n in shapes]
        roots = assign_roots(costs, world)
        self._layout = dict(key=key, group=pg, world=world, rank=rank, ranges=ranges, shapes=shapes, costs=costs,
                            roots=roots)
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

    def _muon_step(self, muon: List[Tuple[torch.Tensor, dict]],
                   while_moving: Callable[[], None] = lambda: None) -> None:
        params = [p for p, _ in muon]
        layout = self._plan(params)
        world, rank, ranges, roots = layout["world"], layout["rank"], layout["ranges"], layout["roots"]
        # 1. momentum, element-wise on this rank's pieces
        directions = []
        for p, group in muon:
            state = self.state[p]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            buf.mul_(group["momentum"]).add_(grad.float())
            direction = grad.float().add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()
            directions.append(local_piece(direction).reshape(-1))
        device = local_piece(params[0]).device
        # 2. pieces to their roots (one all_to_all; splits in matrix order per destination)
        nothing = [torch.empty(0, device=device)]
        send = [torch.cat([directions[k] for k in range(len(params)) if roots[k] == r] or nothing)
                for r in range(world)]
        recv_sizes = [sum(ranges[s][k][1] - ranges[s][k][0] for k in range(len(params)) if roots[k] == rank)
                      for s in range(world)]
        received, work = self._exchange(send, recv_sizes, device, async_op=True)
        while_moving()
        if work is not None:
            work.wait()
        # 3. Newton-Schulz on the matrices rooted here, pieces joined in rank order
        offsets = [0] * world
        chunks = list(received.split(recv_sizes)) if world > 1 else [received]
        results: Dict[int, torch.Tensor] = {}
        for k in range(len(params)):
            if roots[k] != rank:
                continue
            pieces = []
            for s in range(world):
                n = ranges[s][k][1] - ranges[s][k][0]
                pieces.append(chunks[s].narrow(0, offsets[s], n))
                offsets[s] += n
            m, n = layout["shapes"][k]
            ortho = newton_schulz(torch.cat(pieces).view(m, n), muon[k][1]["ns_steps"])
            results[k] = (ortho * max(1.0, m / n) ** 0.5).reshape(-1)
        # 4. each rank's piece of every result back (the reverse all_to_all)
        back = [torch.cat([results[k][ranges[s][k][0]:ranges[s][k][1]] for k in range(len(params)) if roots[k] == rank]
                          or [torch.empty(0, device=device)]) for s in range(world)]
        mine_sizes = [sum(ranges[rank][k][1] - ranges[rank][k][0] for k in range(len(params)) if roots[k] == r)
                      for r in range(world)]
        updates, _ = self._exchange(back, mine_sizes, device)
        per_root = list(updates.split(mine_sizes)) if world > 1 else [updates]
        cursor = [0] * world
        # 5. apply, decoupled weight decay
        for k, (p, group) in enumerate(muon):
            r = roots[k]
            n = ranges[rank][k][1] - ranges[rank][k][0]
            piece = per_root[r].narrow(0, cursor[r], n)
            cursor[r] += n
            local = local_piece(p)
            if group["weight_decay"]:
                local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(piece.view_as(local).to(local.dtype), alpha=-group["lr"])
        load = [0.0] * world
        for k, r in enumerate(roots):
            load[r] += layout["costs"][k]
        sent = sum(t.numel() for moved in (send, back) for s, t in enumerate(moved) if s != rank)
        self.last_step_stats = {"ns_cost": load, "bytes_moved": 4 * sent}

    def _exchange(self, send: List[torch.Tensor], recv_sizes: List[int], device: torch.device, async_op: bool = False):
        """``(received, work)``: one all_to_all_single; ``work`` to wait on when async."""
        if len(send) == 1:
            return send[0], None
        out = torch.empty(sum(recv_sizes), dtype=torch.float32, device=device)
        work = dist.all_to_all_single(out, torch.cat(send), output_split_sizes=recv_sizes,
                                      input_split_sizes=[t.numel() for t in send], group=self._layout["group"],
                                      async_op=async_op)
        return out, work
