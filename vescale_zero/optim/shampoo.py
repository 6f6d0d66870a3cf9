"""Blocked Shampoo on ragged shards: every preconditioner block lives on one rank.

A matrix ``[R, C]`` (N-D: dim 0 x the rest) is cut into blocks of at most ``block x
block`` from its origin. Sharded with ``granularity=Shampoo.granularity(block)`` a rank's
piece is whole bands of ``block`` rows (or the whole matrix when ``block`` does not divide
R), so each block -- and its two preconditioners -- is on exactly one rank and the step
needs no communication::

    matrix [R, C]             rank k's piece: bands i..j (whole rows)
    +------+------+---+       for each block G (<= block x block) of the piece:
    | B00  | B01  |B02|  band 0    L += G G^T        R_ += G^T G
    +------+------+---+            every `update_freq` steps: L^-1/4, R_^-1/4 (eigh)
    | B10  | B11  |B12|  band 1    P = L^-1/4 G R_^-1/4, scaled to ||G|| (SGD grafting)
    +------+------+---+            m = momentum * m + P;  p -= lr * (m + wd * p)

1-D parameters (norms, biases) and parameters in a group with ``use_shampoo=False`` take
torch's AdamW (``adamw_*`` hyper-parameters, :mod:`.adamw_part`). Given the same gradients
the sharded run performs the same per-block arithmetic as the unsharded one, so the two agree
bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional, Set, Tuple

import torch

from ..primitives.ragged_tensor import is_ragged, local_piece
from .adamw_part import adamw_step
from .state_layout import check_every_rank_piece, keep_saved_dtypes, per_block_state

__all__ = ["Shampoo"]

_PRECONDITIONERS = ("L", "Li", "R", "Ri")
"""[Note: preconditioner state] A preconditioned parameter's state: ``momentum`` (per
element, in the parameter's layout) and, for the ``n`` blocks of the full matrix in
row-major order, ``L`` / ``Li`` ``[n, a, a]`` (``G G^T`` and its inverse 4th root, ``a =
min(block, rows)``) and ``R`` / ``Ri`` ``[n, b, b]`` (``b = min(block, cols)``); a block at
the matrix's last rows or columns uses the top-left corner of its slot. Each is ragged over
the blocks ([Note: per-block state is ragged over blocks]): a rank holds its bands' blocks,
and torch's DCP saves and re-cuts them like any sharded tensor."""


def _matrix_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def _fits(start: int, end: int, rows: int, cols: int, block: int) -> bool:
    """A piece ``[start, end)`` of a ``rows x cols`` matrix is whole bands of ``block`` rows,
    or the whole matrix."""
    band = block * cols
    whole_bands = start % band == 0 and ((end - start) % band == 0 or end == rows * cols)
    return whole_bands or (start == 0 and end == rows * cols)


def _sides(rows: int, cols: int, block: int) -> Tuple[int, int, int, int]:
    """The slot sides of ``L``, ``Li``, ``R``, ``Ri`` ([Note: preconditioner state])."""
    return min(block, rows), min(block, rows), min(block, cols), min(block, cols)


def _inverse_root(m: torch.Tensor, root: int, eps: float) -> torch.Tensor:
    """``m^(-1/root)`` of a symmetric PSD matrix, via its eigen-decomposition (fp32)."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp_min(0.0) + eps
    return (vecs * vals.pow(-1.0 / root)) @ vecs.T


class Shampoo(torch.optim.Optimizer):
    """Blocked Shampoo (see module docstring).

    Args:
        lr, momentum, weight_decay: of the preconditioned (Shampoo) update; weight decay
            is decoupled.
        block: the largest preconditioner block side (rows and columns).
        eps: added to the eigenvalues before the inverse root.
        update_freq: recompute the inverse roots every this many steps.
        adamw_lr, adamw_betas, adamw_eps: AdamW for 1-D and opted-out parameters.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        block: int = 128,
        eps: float = 1e-6,
        update_freq: int = 1,
        adamw_lr: float = 1e-3,
        adamw_betas: Tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        if block < 1:
            raise ValueError(f"Shampoo: block must be a positive number of rows/columns, got {block}")
        if update_freq < 1:
            raise ValueError(f"Shampoo: update_freq must be >= 1 (steps between inverse roots), got {update_freq}")
        if lr < 0 or adamw_lr < 0:
            raise ValueError(f"Shampoo: learning rates must be >= 0, got lr={lr}, adamw_lr={adamw_lr}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, block=block, eps=eps,
                        update_freq=update_freq, adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
                        use_shampoo=None)
        super().__init__(params, defaults)
        self._layout_checked: Set[int] = set()

    def _check_every_rank(self) -> None:
        """Every rank's piece of every preconditioned parameter, once, from its group's plan
        (layout [Note: layout checked from the plan])."""
        for group in self.param_groups:
            b = group["block"]
            for p in group["params"]:
                shape = p.sharded_range.shape if hasattr(p, "sharded_range") else tuple(p.shape)
                if id(p) in self._layout_checked or len(shape) < 2 or group["use_shampoo"] is False:
                    continue  # checked, or AdamW (no blocks)
                rows, cols = _matrix_shape(shape)
                check_every_rank_piece(
                    "Shampoo", p, lambda start, end, b=b, rows=rows, cols=cols: _fits(start, end, rows, cols, b),
                    f"a {b}x{b} block", f"shard it with fully_shard(..., granularity=Shampoo.granularity({b}))")
                self._layout_checked.add(id(p))

    @staticmethod
    def granularity(block: int = 128) -> Callable[[str, torch.Tensor], int]:
        """A ``fully_shard`` granularity policy keeping every block on one rank: bands of
        ``block`` rows where they divide dim 0, else the whole parameter (1-D: whole)."""

        def policy(name: str, param: torch.Tensor) -> int:
            rows, cols = _matrix_shape(tuple(param.shape))
            if param.dim() >= 2 and rows % block == 0:
                return block * cols
            return max(1, param.numel())

        return policy

    @staticmethod
    def _full_shape_and_rows(p: torch.Tensor, block: int) -> Tuple[Tuple[int, ...], int, int]:
        """(full shape, first row, row count) of the piece ``p`` holds; checks the layout."""
        rng = getattr(p, "sharded_range", None)
        if rng is None:
            shape = tuple(p.shape)
            return shape, 0, _matrix_shape(shape)[0]
        rows, cols = _matrix_shape(rng.shape)
        if rng.end > rng.start and not _fits(rng.start, rng.end, rows, cols, block):
            raise ValueError(
                f"Shampoo: a {block}x{block} block of a parameter of shape {rng.shape} would be split across ranks "
                f"(this rank holds elements [{rng.start}, {rng.end})); shard it with "
                f"fully_shard(..., granularity=Shampoo.granularity({block}))"
            )
        return tuple(rng.shape), rng.start // cols, (rng.end - rng.start) // cols

    def sharded_state_span(self, param: torch.Tensor, key: str) -> Optional[Tuple[int, int, int]]:
        """The preconditioner blocks of ``param``'s piece as ``(first, last, total)`` of the
        full matrix's row-major block list, so checkpoints re-cut them
        (:mod:`vescale_zero.checkpoint`); ``None`` for per-element state and the step.
        ``"blocks"`` is the list of per-block dicts that checkpoints written before hold."""
        if key not in _PRECONDITIONERS and key != "blocks":
            return None
        block = next(g["block"] for g in self.param_groups if any(q is param for q in g["params"]))
        full_shape, first_row, n_rows = self._full_shape_and_rows(param, block)
        return self._block_span(full_shape, first_row, n_rows, block)

    def _blocks(self, rows: int, cols: int, block: int) -> List[Tuple[int, int, int, int]]:
        return [(r, min(r + block, rows), c, min(c + block, cols))
                for r in range(0, rows, block) for c in range(0, cols, block)]

    # ---- state dicts: [Note: preconditioner state] ------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer state dict, the preconditioners ragged over blocks, so
        ``torch.distributed.checkpoint`` saves every rank's blocks."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and ("blocks" in state or "L" in state):
                    self._restore_layout(p, state, group["block"])
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the state keeps the dtypes it was saved with (fp32 preconditioners
        and momentum stay fp32 beside a bf16 parameter)."""
        super().load_state_dict(state_dict)
        keep_saved_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_every_rank()
        for group in self.param_groups:
            rest = []  # AdamW's, one call per group
            for p in group["params"]:
                if p.grad is None:
                    continue
                shape = getattr(p, "sharded_range", None).shape if hasattr(p, "sharded_range") else tuple(p.shape)
                use = group["use_shampoo"]
                if use is None:
                    use = len(shape) >= 2
                if use and len(shape) < 2:
                    raise ValueError(f"Shampoo: use_shampoo=True on a {len(shape)}-D parameter {tuple(shape)}; "
                                     "precondition matrices only (leave use_shampoo unset for 1-D parameters)")
                if use:
                    self._shampoo(p, group)
                else:
                    rest.append(p)
            adamw_step(rest, self.state, lr=group["adamw_lr"], betas=group["adamw_betas"], eps=group["adamw_eps"],
                       weight_decay=group["weight_decay"])
        return loss

    def _shampoo(self, p: torch.Tensor, group: dict) -> None:
        block = group["block"]
        full_shape, first_row, n_rows = self._full_shape_and_rows(p, block)
        local = local_piece(p)  # this rank's flat piece (the whole tensor when unsharded)
        rows, cols = _matrix_shape(full_shape)
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
        self._restore_layout(p, state, block)
        state["step"] += 1
        if local.numel() == 0:  # no blocks here; the state keys are every rank's (DCP)
            return
        g = local_piece(p.grad).float().view(n_rows, cols)
        update = torch.empty_like(g)
        refresh = (state["step"] - 1) % group["update_freq"] == 0
        L, Li, R, Ri = (local_piece(state[k]).view(-1, side, side)
                        for k, side in zip(_PRECONDITIONERS, _sides(rows, cols, block)))
        for i, (r0, r1, c0, c1) in enumerate(self._blocks(n_rows, cols, block)):
            h, w = r1 - r0, c1 - c0
            gb = g[r0:r1, c0:c1]
            L[i, :h, :h].add_(gb @ gb.T)
            R[i, :w, :w].add_(gb.T @ gb)
            if refresh:
                Li[i, :h, :h] = _inverse_root(L[i, :h, :h], 4, group["eps"])
                Ri[i, :w, :w] = _inverse_root(R[i, :w, :w], 4, group["eps"])
            u = Li[i, :h, :h] @ gb @ Ri[i, :w, :w]
            norm_u = u.norm()
            # grafted to the gradient's norm; decided on the device (no host read of norm_u)
            update[r0:r1, c0:c1] = torch.where(norm_u > 0, u * (gb.norm() / norm_u), u)
        m = local_piece(state["momentum"]).view(n_rows, cols)
        m.mul_(group["momentum"]).add_(update)
        if group["weight_decay"]:
            local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(m.view_as(local).to(local.dtype), alpha=-group["lr"])

    def _restore_layout(self, p: torch.Tensor, state: dict, block: int) -> None:
        """The preconditioners as four stacked tensors, ragged over the full matrix's blocks
        ([Note: preconditioner state]); made at the first step, and from the list of per-block
        dicts that checkpoints written before hold (``"blocks"``). Called at every step: in
        layout already, it returns at once."""
        missing = [k for k in _PRECONDITIONERS if k not in state or is_ragged(state[k]) != is_ragged(p)]
        if not missing and "blocks" not in state:
            return
        full_shape, first_row, n_rows = self._full_shape_and_rows(p, block)
        rows, cols = _matrix_shape(full_shape)
        local = local_piece(p)
        sides = dict(zip(_PRECONDITIONERS, _sides(rows, cols, block)))
        blocks = self._blocks(n_rows, cols, block) if local.numel() else []
        total = self._block_span(full_shape, first_row, n_rows, block)[2]
        old = state.pop("blocks", None)
        for key in missing:
            side = sides[key]
            value = state.get(key)
            if value is None:
                value = torch.zeros(len(blocks), side, side, dtype=torch.float32, device=local.device)
                for i, entry in enumerate(old or ()):
                    if key in entry:
                        value[i, : entry[key].shape[0], : entry[key].shape[1]] = entry[key]
            value = local_piece(value).view(-1, side, side)
            state[key] = per_block_state(value, p, lambda start, end: self._piece_blocks(p, block, start, end), total)

    def _piece_blocks(self, p: torch.Tensor, block: int, start: int, end: int) -> Tuple[int, int]:
        """The blocks ``[first, last)`` of the full matrix that the piece ``[start, end)`` holds."""
        shape = tuple(p.shape)
        cols = _matrix_shape(shape)[1]
        first, last, _ = self._block_span(shape, start // cols, (end - start) // cols, block)
        return first, last

    @staticmethod
    def _block_span(full_shape: Tuple[int, ...], first_row: int, n_rows: int, block: int) -> Tuple[int, int, int]:
        """``(first, last, total)`` of the row-major block list for rows ``[first_row, first_row + n_rows)``."""
        rows, cols = _matrix_shape(full_shape)
        per_band = -(-cols // block)
        first_band = first_row // block
        last_band = -(-(first_row + n_rows) // block) if n_rows else first_band
        return first_band * per_band, last_band * per_band, -(-rows // block) * per_band
