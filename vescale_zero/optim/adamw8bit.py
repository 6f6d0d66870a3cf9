"""AdamW with both moments stored in 8 bits, one absmax per block of ``block`` elements.

Each parameter's moments are quantized block-wise with the dynamic map of Dettmers et al.
(:mod:`vescale_zero.primitives.quantization`, [Note: the dynamic map]): the first moment with the signed
map, the second moment (``v`` itself) with the unsigned map, as bitsandbytes' ``AdamW8bit``
stores them. The update itself is AdamW's, in fp32, in bitsandbytes' order of operations:
dequantize, ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``, decay, then
``p -= lr / (1-b1**t) * m / (sqrt(v) / sqrt(1-b2**t) + eps)``, and re-quantize.
State: 2 bytes per element (uint8 codes) + 8 bytes per block (two fp32 absmax).

[Note: sharded equals unsharded]
Blocks are counted from the start of the *full* parameter. On a sharded parameter
(``param.sharded_range``) the optimizer requires the piece to start on a block boundary
and to hold whole blocks (except the parameter's last, partial one), which the planner
guarantees when the parameter is sharded with ``granularity=AdamW8bit.granularity(block)``.
Every block is then quantized on exactly one rank with exactly the elements it has
unsharded, so given the same gradients the sharded run equals the unsharded one bit for bit.

[Note: 8-bit state format] State keys: ``exp_avg`` / ``exp_avg_sq`` (uint8 codes) and
``exp_avg_absmax`` / ``exp_avg_sq_absmax`` (fp32 per block). The linear-code format that
came before (int8 / uint8-of-sqrt codes with ``*_scale`` keys) means something else: a state
holding ``exp_avg_scale`` is refused, never read as dynamic codes.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Set, Tuple

import torch

from ..primitives.quantization import dequantize_blockwise, quantize_blockwise
from ..primitives.ragged_tensor import like_param, local_piece
from .state_layout import check_every_rank_piece, keep_saved_dtypes, per_block_state

__all__ = ["AdamW8bit"]


def _numel(p: torch.Tensor) -> int:
    rng = getattr(p, "sharded_range", None)
    return math.prod(rng.shape) if rng is not None else p.numel()


def _block_span(start: int, end: int, block: int) -> Tuple[int, int]:
    """The blocks ``[first, last)`` that hold the elements ``[start, end)`` (none for an empty piece)."""
    return (start // block, -(-end // block)) if end > start else (start // block, start // block)


class AdamW8bit(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block: int = 256,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block=block))
        self._layout_checked: Set[int] = set()

    def _check_every_rank(self) -> None:
        """Every rank's piece of every parameter, once, from its group's plan (layout
        [Note: layout checked from the plan])."""
        for group in self.param_groups:
            b = group["block"]
            for p in group["params"]:
                if id(p) in self._layout_checked:
                    continue
                total = _numel(p)
                check_every_rank_piece(
                    "AdamW8bit", p, lambda start, end, b=b, total=total: self._fits(start, end, total, b),
                    f"a block of {b} elements",
                    f"shard it with fully_shard(..., granularity=AdamW8bit.granularity({b}))")
                self._layout_checked.add(id(p))

    @staticmethod
    def granularity(block: int = 256) -> Callable[[str, torch.Tensor], int]:
        """A ``fully_shard`` granularity policy that keeps this optimizer's blocks whole:
        ``block`` elements where it divides the parameter, else the whole parameter."""
        return lambda name, param: block if param.numel() % block == 0 else max(1, param.numel())

    def sharded_state_span(self, param: torch.Tensor, key: str) -> Optional[Tuple[int, int, int]]:
        """The absmax of ``param``'s piece as ``(first, last, total)`` blocks of the full
        parameter, so checkpoints re-cut them (:mod:`vescale_zero.checkpoint`); ``None`` for
        per-element state (the codes) and the step."""
        if key not in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            return None
        block = next(g["block"] for g in self.param_groups if any(q is param for q in g["params"]))
        self._check_layout(param, block)
        rng = getattr(param, "sharded_range", None)
        start, end, total = ((rng.start, rng.end, math.prod(rng.shape)) if rng is not None
                             else (0, param.numel(), param.numel()))
        return _block_span(start, end, block) + (-(-total // block),)

    @staticmethod
    def _fits(start: int, end: int, total: int, block: int) -> bool:
        """A piece ``[start, end)`` of a ``total``-element tensor holds whole blocks (an empty one: none)."""
        return end == start or start % block == 0 and ((end - start) % block == 0 or end == total)

    @staticmethod
    def _check_layout(p: torch.Tensor, block: int) -> None:
        rng = getattr(p, "sharded_range", None)
        if rng is None:
            return
        if not AdamW8bit._fits(rng.start, rng.end, math.prod(rng.shape), block):  # an empty piece fits
            raise ValueError(
                f"AdamW8bit: a block of {block} elements of a parameter of shape {rng.shape} would be split across "
                f"ranks (this rank holds elements [{rng.start}, {rng.end}) at granularity {rng.granularity}); shard it "
                f"with fully_shard(..., granularity=AdamW8bit.granularity({block}))"
            )

    # ---- state dicts: [Note: 8-bit state format], [Note: per-block state is ragged over blocks] ----
    def state_dict(self) -> dict:
        """torch's optimizer state dict, its tensors in their layouts (codes like the parameter,
        absmax ragged over blocks), so ``torch.distributed.checkpoint`` saves every rank's part."""
        self._restore_layouts()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``Optimizer.load_state_dict`` casts floating-point state to the parameter's
        dtype: here it would turn uint8 codes into floats and round fp32 absmax to a bf16
        parameter's dtype. The state keeps the dtypes it was saved with, on the parameter's device."""
        super().load_state_dict(state_dict)
        keep_saved_dtypes(self, state_dict)
        self._restore_layouts()

    def _restore_layouts(self) -> None:
        """State loaded as plain pieces (``vz.checkpoint.load``) back in its layouts."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "exp_avg_absmax" not in state:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    self._store(state, p, key, (local_piece(state[key]), local_piece(state[key + "_absmax"])),
                                group["block"])

    @staticmethod
    def _store(state: dict, param: torch.Tensor, key: str, quantized: Tuple[torch.Tensor, torch.Tensor],
               block: int) -> None:
        """Codes (one per element: in the parameter's layout, ragged for a sharded one) and each
        block's absmax (ragged over the blocks: [Note: per-block state is ragged over blocks])."""
        codes, absmax = quantized
        state[key] = like_param(codes, param)
        state[key + "_absmax"] = per_block_state(absmax, param, lambda start, end: _block_span(start, end, block),
                                                 -(-_numel(param) // block), like=state.get(key + "_absmax"))

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_every_rank()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd, block = (group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                            group["block"])
            for p in group["params"]:
                local = local_piece(p)  # this rank's flat piece (the whole tensor when unsharded)
                if p.grad is None:  # an empty piece still steps: every rank holds the same state keys (DCP)
                    continue
                self._check_layout(p, block)
                state = self.state[p]
                if not state:
                    zeros = torch.zeros(local.numel(), dtype=torch.float32, device=local.device)
                    state["step"] = 0
                    self._store(state, p, "exp_avg", quantize_blockwise(zeros, block, signed=True), block)
                    self._store(state, p, "exp_avg_sq", quantize_blockwise(zeros, block, signed=False), block)
                elif "exp_avg_scale" in state:
                    raise ValueError(
                        "AdamW8bit: this optimizer state holds linear 8-bit codes ('exp_avg_scale'), written before "
                        "AdamW8bit quantized with the dynamic map; it cannot be read as dynamic codes. Start the "
                        "optimizer state afresh (load the model weights only)")
                state["step"] += 1
                t = state["step"]
                grad = local_piece(p.grad).reshape(-1).float()
                m = dequantize_blockwise(local_piece(state["exp_avg"]), local_piece(state["exp_avg_absmax"]), block,
                                         signed=True)
                v = dequantize_blockwise(local_piece(state["exp_avg_sq"]), local_piece(state["exp_avg_sq_absmax"]),
                                         block, signed=False)
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                flat = local.view(-1)
                flat.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                flat.addcdiv_(m.to(flat.dtype), denom.to(flat.dtype), value=-lr / (1 - b1**t))
                self._store(state, p, "exp_avg", quantize_blockwise(m, block, signed=True), block)
                self._store(state, p, "exp_avg_sq", quantize_blockwise(v, block, signed=False), block)
        return loss
