"""``VeScaleOptimizer``: Megatron's optimizer interface over ragged-sharded parameters.

The training loop of Megatron-LM calls ``optimizer.step()`` and reads
``(update_successful, grad_norm, num_zeros_in_grad)``; its LR scheduler edits
``optimizer.param_groups``. The sharded parameters *are* the master parameters (fp32
shards, see ``VeScaleFSDP``), so there is no copy between model and main parameters.

[Note: norms over shards] Each element of every gradient lives on exactly one rank:
data-parallel shards are disjoint, tensor-parallel duplicates (LayerNorms, TP size > 1)
count on TP rank 0 only (expert-TP rank 0 for experts), a word embedding tied across
pipeline stages counts on the first stage only (``param.shared``). One all-reduce of the
local sum of squares over the whole world is then the norm of the full gradient: what
Megatron-LM computes over its model-parallel group on replicated gradients.

[Note: optimizer checkpoints] Megatron-LM's torch checkpoints are written by data-parallel
rank 0 alone, so they cannot hold the other ranks' shards. :meth:`VeScaleOptimizer.save_sharded`
writes every rank's shards with :mod:`vescale_zero.checkpoint` (the Megatron-LM switch calls
it from ``save_checkpoint``, into ``iter_N/vescale_zero_optim``); :meth:`state_dict` then
points there, and :meth:`load_state_dict` -- called by every rank on resume -- loads that
checkpoint, at any data-parallel size.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig, _get_param_groups
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from vescale_zero import checkpoint
from vescale_zero.optim import AdamW8bit, Muon, Shampoo

from .data_parallel import VeScaleFSDP

__all__ = ["VeScaleOptimizer", "get_vescale_optimizer", "SUPPORTED_OPTIMIZERS"]

SUPPORTED_OPTIMIZERS = ("adam", "sgd", "adamw8bit", "shampoo", "muon")


def _grad_scaler(config: OptimizerConfig, device: torch.device) -> Optional[MegatronGradScaler]:
    if not config.fp16:
        return None
    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale, growth_factor=2.0,
        backoff_factor=0.5, growth_interval=config.loss_scale_window, hysteresis=config.hysteresis,
    )


class VeScaleOptimizer(MegatronOptimizer):
    """A torch optimizer on the sharded parameters, with Megatron's step protocol.

    Args:
        optimizer: built on the sharded parameters of ``VeScaleFSDP`` chunks.
        config: Megatron's ``OptimizerConfig`` (``clip_grad``, ``log_num_zeros_in_grad``,
            ``fp16`` loss scaling: ``loss_scale`` / ``initial_loss_scale`` / ...).
        model_chunks: the ``VeScaleFSDP`` chunks it optimizes (for sharded checkpoints).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 model_chunks: Optional[List[nn.Module]] = None) -> None:
        super().__init__(optimizer, config)
        self.model_chunks = list(model_chunks or [])
        self._sharded_checkpoint: Optional[str] = None
        self.is_stub_optimizer = False
        params = self.get_parameters()
        self._device = params[0].device if params else torch.device("cpu")
        self.grad_scaler = _grad_scaler(config, self._device)
        self._one = torch.ones(1, dtype=torch.float32, device=self._device)
        self.grad_stats_parallel_group = dist.group.WORLD
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._etp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)

    # ---- gradients that count --------------------------------------------------------
    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """This rank's unique gradient pieces (see [Note: norms over shards])."""
        grads = []
        for p in self.get_parameters():
            if p.grad is None or not param_is_not_shared(p):
                continue
            expert = not getattr(p, "allreduce", True)
            tp_group = self._etp_group if expert and self._etp_group is not None else self._tp_group
            if param_is_not_tensor_parallel_duplicate(p, tp_group):
                grads.append(p.grad)
        return grads

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        local = torch.zeros(1, dtype=torch.float32, device=self._device)
        for g in self.get_main_grads_for_grad_norm():
            local += g.detach().float().pow(2).sum()
        dist.all_reduce(local, group=self.grad_stats_parallel_group)
        return math.sqrt(local.item())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Megatron's rule: scale by ``clip_grad / (norm + 1e-6)`` when that is below 1."""
        norm = self.get_grad_norm()
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            grads = [p.grad for p in self.get_parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coeff)
        return norm

    @torch.no_grad()
    def count_zeros(self) -> float:
        local = torch.zeros(1, dtype=torch.float32, device=self._device)
        for g in self.get_main_grads_for_grad_norm():
            local += g.numel() - torch.count_nonzero(g)
        dist.all_reduce(local, group=self.grad_stats_parallel_group)
        return local.item()

    # ---- the step protocol -----------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Unscale fp16 gradients; True if any rank found inf/nan (every rank then skips)."""
        if self.grad_scaler is None:
            return False
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        torch._foreach_mul_(grads, float(1.0 / self.grad_scaler.scale.item()))
        found = torch.zeros(1, dtype=torch.float32, device=self._device)
        for g in grads:
            if not torch.isfinite(g).all():
                found.fill_(1.0)
                break
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.grad_stats_parallel_group)
        found_inf = bool(found.item())
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[float]]:
        """``(update_successful, grad_norm, num_zeros_in_grad)`` as Megatron's optimizers."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.get_parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Nothing to reload: the sharded model parameters are the master parameters."""

    # ---- state (see [Note: optimizer checkpoints]) --------------------------------------
    def _chunk(self) -> nn.Module:
        chunks = [c for c in self.model_chunks if isinstance(c, VeScaleFSDP)]
        if len(chunks) != 1:
            raise ValueError(
                f"sharded optimizer checkpoints need exactly one VeScaleFSDP model chunk, this optimizer has "
                f"{len(chunks)} (virtual pipeline stages are not supported yet); resume with --no-load-optim"
            )
        return chunks[0]

    def save_sharded(self, path: str) -> None:
        """Write every rank's optimizer shards (and weights) under ``path``; collective."""
        extra = {"grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}
        checkpoint.save(path, self._chunk(), self.optimizer, extra=extra)
        self._sharded_checkpoint = path

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state (its shards only), and where :meth:`save_sharded`
        last wrote every rank's."""
        out: Dict[str, Any] = {"optimizer": self.optimizer.state_dict(),
                               "shard_numels": [p.numel() for p in self.get_parameters()]}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        if self._sharded_checkpoint is not None:
            out["vescale_zero_checkpoint"] = self._sharded_checkpoint
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        path = state_dict.get("vescale_zero_checkpoint")
        if path is not None:  # every rank's shards, at any data-parallel size
            if not os.path.isdir(path):
                raise checkpoint.CheckpointError(
                    f"the optimizer state was saved as sharded checkpoint {path}, which is not there (moved with "
                    "its Megatron checkpoint?); put it back, or resume with --no-load-optim"
                )
            extra = checkpoint.load(path, self._chunk(), self.optimizer)
            if self.grad_scaler is not None and extra.get("grad_scaler") is not None:
                self.grad_scaler.load_state_dict(extra["grad_scaler"])
            return
        if "optimizer" not in state_dict:
            raise KeyError(
                "not a VeScaleOptimizer state dict (no 'optimizer' key); a Megatron optimizer checkpoint "
                "holds differently laid-out state and cannot be loaded into ragged shards"
            )
        mine = [p.numel() for p in self.get_parameters()]
        if state_dict.get("shard_numels", mine) != mine:
            raise ValueError(
                "this optimizer state was saved by another data-parallel rank (its shards have other sizes): "
                "Megatron-LM's torch checkpoints keep data-parallel rank 0's optimizer state only. Save through "
                "use_vescale_fsdp_in_megatron_lm's save_checkpoint (it writes every rank's shards beside it), or with "
                "VeScaleOptimizer.save_sharded / vescale_zero.checkpoint, or resume with --no-load-optim"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "VeScaleOptimizer does not write Megatron dist-checkpoints (torch_dist) yet; save its per-rank "
            "state with vescale_zero.checkpoint.save(path, model, optimizer)"
        )


def _meta_twin(sharded: nn.Parameter) -> nn.Parameter:
    """A meta parameter with the *full* shape and the tags of ``sharded``, so Megatron's
    grouping rules (no weight decay on 1-D tensors and biases, ...) see the real shape."""
    twin = nn.Parameter(torch.empty(sharded.sharded_range.shape, device="meta", dtype=sharded.dtype),
                        requires_grad=sharded.requires_grad)
    for key, value in vars(sharded).items():
        if key not in ("sharded_range", "main_grad"):
            setattr(twin, key, value)
    return twin


class _TwinChunk:
    """What ``_get_param_groups`` reads of a model chunk: ``named_parameters()``."""

    def __init__(self, named: List[Tuple[str, nn.Parameter]]) -> None:
        self._named = named

    def named_parameters(self):
        return iter(self._named)


def get_vescale_optimizer(
    config: OptimizerConfig,
    model_chunks: List[VeScaleFSDP],
    config_overrides: Optional[Dict[Any, Any]] = None,
    *,
    optimizer: Optional[str] = None,
    block: Optional[int] = None,
    **unused: Any,
) -> VeScaleOptimizer:
    """Megatron's ``get_megatron_optimizer`` for ``VeScaleFSDP`` chunks: Megatron's own
    parameter groups (weight-decay and LR multipliers, expert flag), on the shards.

    ``config.optimizer``: ``"adam"`` (AdamW when ``decoupled_weight_decay``, else Adam),
    ``"sgd"``, ``"adamw8bit"`` (:class:`vescale_zero.optim.AdamW8bit`), ``"shampoo"``
    (:class:`vescale_zero.optim.Shampoo`) or ``"muon"`` (:class:`vescale_zero.optim.Muon`,
    Megatron's ``muon_*`` settings), the last two with AdamW for 1-D parameters; ``optimizer``
    overrides it (Megatron-LM's ``--optimizer`` does not know ``adamw8bit``). Other
    keyword arguments of ``get_megatron_optimizer`` (process-group options) are accepted
    and unused: the groups come from the model chunks.
    """
    name = optimizer or config.optimizer
    if not all(isinstance(chunk, VeScaleFSDP) for chunk in model_chunks):
        raise TypeError("get_vescale_optimizer needs VeScaleFSDP model chunks (build the model with --use-vescale-fsdp)")
    if name not in SUPPORTED_OPTIMIZERS:
        raise ValueError(f"--use-vescale-fsdp: optimizer {name!r} is not supported; choose one of {SUPPORTED_OPTIMIZERS}")
    if config.use_distributed_optimizer:
        raise ValueError("--use-vescale-fsdp already shards the optimizer state; drop --use-distributed-optimizer")
    if config.optimizer_cpu_offload:
        raise ValueError("--use-vescale-fsdp does not offload the optimizer to CPU; drop --optimizer-cpu-offload")
    twin_of: Dict[int, nn.Parameter] = {}
    chunks = []
    for chunk in model_chunks:
        named = []
        for fqn, p in chunk.named_parameters():
            twin = _meta_twin(p)
            twin_of[id(twin)] = p
            named.append((fqn, twin))
        chunks.append(_TwinChunk(named))
    groups = _get_param_groups(chunks, config, config_overrides)
    for group in groups:
        group["params"] = [twin_of[id(t)] for t in group["params"]]
        # What Megatron's scheduler sets on its first step, so a run without one is right too.
        group["lr"] = group["max_lr"] * group.get("lr_mult", 1.0)
        group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)
    groups = [g for g in groups if g["params"]]
    if name == "adam":
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        inner = cls(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                    weight_decay=config.weight_decay)
    elif name == "adamw8bit":
        inner = AdamW8bit(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                          weight_decay=config.weight_decay, **({"block": block} if block else {}))
    elif name == "shampoo":
        inner = Shampoo(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay,
                        adamw_lr=config.lr, adamw_betas=(config.adam_beta1, config.adam_beta2),
                        adamw_eps=config.adam_eps, **({"block": block} if block else {}))
    elif name == "muon":
        if len({id(getattr(c, "dp_cp_group", None)) for c in model_chunks}) > 1 or any(
            not getattr(p, "allreduce", True) for g in groups for p in g["params"]
        ):
            raise ValueError("--vescale-optimizer muon: expert parameters (another data-parallel group) are not "
                             "supported yet; use adam for MoE models")
        inner = Muon(groups, lr=config.lr, momentum=getattr(config, "muon_momentum", 0.95),
                     nesterov=getattr(config, "muon_use_nesterov", True), ns_steps=getattr(config, "muon_num_ns_steps", 5),
                     weight_decay=config.weight_decay, adamw_lr=config.lr,
                     adamw_betas=(config.adam_beta1, config.adam_beta2), adamw_eps=config.adam_eps,
                     process_group=model_chunks[0].dp_cp_group)
    else:
        inner = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
    return VeScaleOptimizer(inner, config, model_chunks)
