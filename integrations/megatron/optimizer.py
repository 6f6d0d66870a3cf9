"""``RaggedOptimizer``: Megatron's optimizer interface over ragged-sharded parameters.

The training loop of Megatron-LM calls ``optimizer.step()`` and reads
``(update_successful, grad_norm, num_zeros_in_grad)``; its LR scheduler edits
``optimizer.param_groups``. The sharded parameters *are* the master parameters (fp32
shards, see ``RaggedFSDP``), so there is no copy between model and main parameters.

[Note: norms over shards] Each element of every gradient lives on exactly one rank:
data-parallel shards are disjoint, tensor-parallel duplicates (LayerNorms, TP size > 1)
count on TP rank 0 only (expert-TP rank 0 for experts), a word embedding tied across
pipeline stages counts on the first stage only (``param.shared``), and under HSDP
(``--num-distributed-optimizer-instances N``: every instance holds the same reduced shards)
on the first instance only. One all-reduce of the
local sum of squares over the whole world is then the norm of the full gradient: what
Megatron-LM computes over its model-parallel group on replicated gradients.

[Note: optimizer checkpoints] Megatron-LM's torch checkpoints are written by data-parallel
rank 0 alone, so they cannot hold the other ranks' shards. :meth:`RaggedOptimizer.save_sharded`
writes every rank's shards with :mod:`vescale_zero.checkpoint` (the Megatron-LM switch calls
it from ``save_checkpoint``, into ``iter_N/vescale_zero_optim``); :meth:`state_dict` then
points there, and :meth:`load_state_dict` -- called by every rank on resume -- loads that
checkpoint, at any data-parallel size.

[Note: distributed-optimizer torch checkpoints] Megatron-LM under ``--use-distributed-optimizer``
with ``--ckpt-format torch`` (which ``--use-vescale-fsdp`` accepts) calls ``load_state_dict`` with
the distributed optimizer's ``state_dict()`` (hyperparameters, step, loss scale: no tensors)
and then ``load_parameter_state(distrib_optim.pt)``: a checkpoint written by megatron-core's
DDP + distributed optimizer is loaded from that file by parameter (distrib_optim_file.py
[Note: distrib_optim.pt layout]) in model space, as the dist-checkpoint formats below; one of
ours was loaded whole by ``load_state_dict`` and the second call does nothing.

[Note: optimizer dist-checkpoints] In Megatron's ``torch_dist`` checkpoints the state of an
element-wise optimizer is kept in "model space": ``optimizer.state.exp_avg.<model key>``
shaped like the model's (TP-local, full) tensor, as Megatron's non-distributed optimizer
and its distributed optimizer's ``fully_reshardable`` format write it.
:meth:`RaggedOptimizer.sharded_state_dict` describes Adam's and SGD's state in that form
with the model tensor's metadata: to save, on the model's boxes (views of this rank's state
shards, no gather: dist_checkpoint.py); to load, as full tensors, so checkpoints move
both ways between megatron-core DDP and ``RaggedFSDP`` at any TP/PP/DP layout. Per-block
state (8-bit, Shampoo, Muon) has no such form: it is saved with :meth:`save_sharded` and
the dist-checkpoint holds a pointer to it.

[Note: host reads in the step] Megatron's optimizer API makes the host decide: ``step()``
returns the grad norm as a float (megatron-core's ``get_grad_norm_fp32`` reads it with
``.item()``, and clips on the host by it), the zero count too when it is logged, and under
fp16 the skip of an overflowing step is a host branch (its ``MixedPrecisionOptimizer`` reads
``found_inf`` with ``.item()``). Those reads stay, once per step each, where megatron-core
makes them; nothing else reads a device value: the gradients are unscaled by the scaler's
``inv_scale`` tensor and checked for inf/nan in one fused pass into one flag for all of them.

[Note: fp32 masters] In a bf16/fp16 run Megatron's optimizer keeps fp32 master weights and
writes them beside the bf16 model tensors: as ``optimizer.state.fp32_param.<model key>``
(its mixed-precision optimizer, and the distributed optimizer's ``fully_sharded_model_space``
format), or as ``optimizer.state.param.<model key>`` (the distributed optimizer's
``fully_reshardable`` format, the one Megatron-LM writes with
``--dist-ckpt-optim-fully-reshardable``); the metadata Megatron passes to
``sharded_state_dict`` (``distrib_optim_sharding_type``, on load the checkpoint's own) says
which. Its loader asks for them. Ours are the sharded parameters themselves (fp32): the same boxes
of them are written under both keys, and on load the masters
are read from ``fp32_param`` (after the model's load put bf16-rounded weights there), so a
bf16 job moves both ways without rounding its masters.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.transformer.module import param_is_not_shared
from torch import nn

from vescale_zero import checkpoint, load_full_state_dict, local_piece
from vescale_zero.hosts import (
    collective_device,
    full_optimizer_state,
    grad_norm_over_groups,
    load_full_optimizer_state,
    sharded_params_by_key,
)
from vescale_zero.integrations.loss_scaling import unscale_and_find_inf
from vescale_zero.optim import AdamW8bit, Muon, Shampoo

from .data_parallel import RaggedFSDP
from .dist_checkpoint import boxes_by_parameter, state_boxes
from .distrib_optim_file import megatron_parameter_state
from .hsdp import replica_rank, shard_group
from .megatron_compat import common_state, muon_nesterov, not_tensor_parallel_duplicate, param_groups
from .optimizer_offload import check_offload_matches

__all__ = ["RaggedOptimizer", "get_vescale_optimizer", "SUPPORTED_OPTIMIZERS", "check_dist_checkpoint_optimizer"]

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


class RaggedOptimizer(MegatronOptimizer):
    """A torch optimizer on the sharded parameters, with Megatron's step protocol.

    Args:
        optimizer: built on the sharded parameters of ``RaggedFSDP`` chunks.
        config: Megatron's ``OptimizerConfig`` (``clip_grad``, ``log_num_zeros_in_grad``,
            ``fp16`` loss scaling: ``loss_scale`` / ``initial_loss_scale`` / ...).
        model_chunks: the ``RaggedFSDP`` chunks it optimizes (for sharded checkpoints).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 model_chunks: Optional[List[nn.Module]] = None) -> None:
        super().__init__(optimizer, config)
        self.model_chunks = list(model_chunks or [])
        self._sharded_checkpoint: Optional[str] = None
        self._megatron_state: Optional[Dict[str, Any]] = None  # see [Note: distributed-optimizer torch checkpoints]
        self.is_stub_optimizer = False
        params = self.get_parameters()
        self.grad_stats_parallel_group = dist.group.WORLD
        # the device of the norm / zero-count / overflow all-reduces: the parameters', or the
        # current accelerator on a rank without parameters (never the CPU under NCCL)
        self._device = collective_device(self.grad_stats_parallel_group, params[0].device if params else None)
        self.grad_scaler = _grad_scaler(config, self._device)
        self._one = torch.ones(1, dtype=torch.float32, device=self._device)
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._etp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
        # HSDP: the instances hold equal shards; the first one counts (see [Note: norms over shards])
        self._counts_gradients = all(replica_rank(getattr(c, "dense_mesh", None)) == 0 for c in self.model_chunks)

    # ---- gradients that count --------------------------------------------------------
    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        """This rank's unique gradient pieces (see [Note: norms over shards])."""
        grads = []
        if not self._counts_gradients:
            return grads
        for p in self.get_parameters():
            if p.grad is None or not param_is_not_shared(p):
                continue
            expert = not getattr(p, "allreduce", True)
            tp_group = self._etp_group if expert and self._etp_group is not None else self._tp_group
            if not_tensor_parallel_duplicate(p, tp_group):  # [Note: one door to Megatron's releases]
                grads.append(local_piece(p.grad))  # this rank's piece: the norm adds the pieces up
        return grads

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        pieces = [(self.grad_stats_parallel_group, self.get_main_grads_for_grad_norm())]  # unique across it
        return grad_norm_over_groups(pieces, 2.0, self._device).item()

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
        """Unscale fp16 gradients; True if any rank found inf/nan (every rank then skips). One
        host read, the skip decision, as megatron-core's own ([Note: host reads in the step])."""
        if self.grad_scaler is None:
            return False
        grads = [local_piece(p.grad) for p in self.get_parameters() if p.grad is not None]
        found = unscale_and_find_inf(grads, self.grad_scaler.inv_scale, self._device, self.grad_stats_parallel_group)
        found_inf = bool(found.item() > 0)
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
        chunks = [c for c in self.model_chunks if isinstance(c, RaggedFSDP)]
        if len(chunks) != 1:
            raise ValueError(
                f"sharded optimizer checkpoints need exactly one RaggedFSDP model chunk, this optimizer has "
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
                               "shard_numels": [local_piece(p).numel() for p in self.get_parameters()]}
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        if self._sharded_checkpoint is not None:
            out["vescale_zero_checkpoint"] = self._sharded_checkpoint
        return out

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what :meth:`state_dict` gave, or what ``dist_checkpointing.load`` filled in
        the template of :meth:`sharded_state_dict` (written by us or by Megatron's own
        optimizers in model space, see [Note: optimizer dist-checkpoints])."""
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
        if state_dict and all(isinstance(k, int) for k in state_dict):  # chained: {0: dense, 1: experts}
            parts = [state_dict[k] for k in sorted(state_dict)]
            if all(_MODEL_SPACE in part for part in parts):
                self._load_model_space({**parts[0], _MODEL_SPACE: {
                    key: value for part in parts for key, value in part[_MODEL_SPACE].items()}})
                return
        if _MODEL_SPACE in state_dict:
            self._load_model_space(state_dict)
            return
        if _is_megatron_distributed_state(state_dict):  # its tensors come by load_parameter_state
            self._megatron_state = state_dict
            return
        if "optimizer" not in state_dict:
            raise KeyError(
                "not a RaggedOptimizer state dict (no 'optimizer' key); a Megatron optimizer checkpoint "
                "holds differently laid-out state and cannot be loaded into ragged shards"
            )
        mine = [local_piece(p).numel() for p in self.get_parameters()]
        if state_dict.get("shard_numels", mine) != mine:
            raise ValueError(
                "this optimizer state was saved by another data-parallel rank (its shards have other sizes): "
                "Megatron-LM's torch checkpoints keep data-parallel rank 0's optimizer state only. Save through "
                "use_vescale_fsdp_in_megatron_lm's save_checkpoint (it writes every rank's shards beside it), or with "
                "RaggedOptimizer.save_sharded / vescale_zero.checkpoint, or resume with --no-load-optim"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    # ---- Megatron-LM --use-distributed-optimizer, --ckpt-format torch ------------------
    def save_parameter_state(self, filename: str) -> None:
        """Nothing to write (Megatron-LM calls it under --use-distributed-optimizer): the
        switch's ``save_checkpoint`` has written every rank's shards beside the checkpoint
        (:meth:`save_sharded`), and :meth:`state_dict` points there."""

    def load_parameter_state(self, filename: str, *, update_legacy_format: bool = False) -> None:
        """After :meth:`load_state_dict` took a Megatron distributed optimizer's ``state_dict()``,
        load its parameter state from ``filename`` (its ``distrib_optim.pt``; see
        [Note: distributed-optimizer torch checkpoints]); after our own, nothing (loaded)."""
        pending, self._megatron_state = self._megatron_state, None
        if pending is None:
            return
        if self.model_space_keys() != ("exp_avg", "exp_avg_sq"):
            raise ValueError(
                f"{filename} holds Adam's state (Megatron's distributed optimizer), which this "
                f"{type(self.optimizer).__name__} cannot take: resume with Adam (--optimizer adam, no "
                "--vescale-optimizer), or the weights only with --no-load-optim")
        # memory-mapped: each rank reads its own ranges of the full tensors only
        state = torch.load(filename, map_location="cpu", mmap=True, weights_only=True)
        chunk = self._chunk()
        self._load_model_space({**pending, _MODEL_SPACE: megatron_parameter_state(
            chunk.module, self.optimizer, filename, state)})

    def parameter_state_pending(self) -> bool:
        """Whether :meth:`load_state_dict` took a Megatron distributed optimizer's state and
        :meth:`load_parameter_state` has not yet loaded its tensors."""
        return self._megatron_state is not None

    def check_parameter_state_loaded(self) -> None:
        """Raise if :meth:`load_state_dict` took a Megatron distributed optimizer's state whose
        parameter state (``distrib_optim.pt``) was never loaded."""
        if self._megatron_state is not None:
            self._megatron_state = None
            raise ValueError(
                "the checkpoint's optimizer state was written by Megatron's distributed optimizer, its tensors in "
                "distrib_optim.pt beside the model file, which was not found: put it back, or resume the weights "
                "only with --no-load-optim")

    # ---- Megatron dist-checkpoints (see [Note: optimizer dist-checkpoints]) ------------
    def model_space_keys(self) -> Optional[Tuple[str, ...]]:
        """The element-wise state keys of the inner optimizer, or ``None`` if its state is
        not element-wise (and so cannot be written in model space)."""
        opt = self.optimizer
        if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
            return ("exp_avg", "exp_avg_sq") + (
                ("max_exp_avg_sq",) if any(g.get("amsgrad") for g in opt.param_groups) else ()
            )
        if type(opt) is torch.optim.SGD:
            return ("momentum_buffer",) if any(g.get("momentum") for g in opt.param_groups) else ()
        return None

    def sharded_state_dict(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False,
                           metadata: Optional[dict] = None, **unused: Any) -> Dict[str, Any]:
        """Megatron's optimizer ``sharded_state_dict``: model-space ``ShardedTensor``s built on
        ``model_sharded_state_dict`` -- to save, the boxes of :meth:`RaggedFSDP.sharded_state_dict`
        (or of Megatron-LM's ``sharded_state_dict`` under ``checkpoint_parameters``), over this
        rank's state shards; to load (``is_loading``), full tensors on a template built with
        ``RaggedFSDP.sharded_state_dict(is_loading=True)`` (or under ``full_parameters``). For
        per-block optimizers, a pointer to the shards :meth:`save_sharded` wrote. Collective."""
        from dataclasses import replace

        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

        chunk = self._chunk()
        names = self.model_space_keys()
        common: Dict[str, Any] = {
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None
        }
        if names is None:
            if is_loading:
                return {"vescale_zero_checkpoint": None, **common}
            if self._sharded_checkpoint is None:
                raise ValueError(
                    f"{type(self.optimizer).__name__} keeps per-block state, which Megatron's torch_dist checkpoints "
                    "cannot describe: call RaggedOptimizer.save_sharded(path) first (Megatron-LM's save_checkpoint "
                    "does it under use_vescale_fsdp_in_megatron_lm) so the checkpoint can point to it"
                )
            return {"vescale_zero_checkpoint": self._sharded_checkpoint, **common}
        boxes = boxes_by_parameter(model_sharded_state_dict)
        if boxes:  # the streamed save's boxes (dist_checkpoint.py): write the state on them, no gather
            if is_loading:
                raise ValueError("the model's sharded state dict holds this rank's boxes (a save's); to load, build it "
                                 "with RaggedFSDP.sharded_state_dict(is_loading=True) (full tensors)")
            return self._streamed_sharded_state_dict(boxes, names, metadata, common)
        meta: Dict[int, Any] = {}
        for sh in nested_values(model_sharded_state_dict):
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
                param = chunk.sharded_param_of(sh.data)
                if param is not None:
                    meta.setdefault(id(param), sh)
        with chunk.shards_in_place():
            keyed = sharded_params_by_key(chunk.module)
            if is_loading:
                trained = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
                full = {key: {n: torch.empty(p.sharded_range.shape, dtype=p.dtype, device=p.device) for n in names}
                        for key, p in keyed.items() if id(p) in trained}
                step = None
            else:
                full, step = full_optimizer_state(chunk.module, self.optimizer)
        parts, expert, prefix = self._model_space_parts(metadata)
        tensors: Dict[Optional[bool], Dict[str, Dict[str, Any]]] = {part: {} for part in parts}
        for key, states in full.items():
            sh = meta.get(id(keyed[key]))
            if sh is None:
                raise ValueError(
                    f"{key!r} is not in the model's sharded state dict: build it with RaggedFSDP.sharded_state_dict() "
                    "(or inside RaggedFSDP.full_parameters()) in the same call as this one"
                )
            if self._keeps_masters():  # see [Note: fp32 masters]: the full fp32 tensor itself
                states = {**states, _master_key(metadata): torch.empty_like(sh.data) if is_loading else sh.data}
            part = (id(keyed[key]) in expert) if expert else None
            chained = f"chained_{int(part)}." if prefix else ""
            for name, tensor in states.items():
                kwargs: Dict[str, Any] = dict(key=f"{chained}optimizer.state.{name}.{sh.key}", data=tensor)
                if isinstance(sh, ShardedTensor):
                    kwargs["dtype"] = tensor.dtype
                tensors[part].setdefault(key, {})[name] = replace(sh, **kwargs)
                if isinstance(sh, ShardedTensor):
                    tensors[part][key][name].validate_metadata_integrity()
        return self._model_space_out(parts, tensors, step, common)

    def _model_space_parts(self, metadata: Optional[dict]) -> Tuple[List[Optional[bool]], set, bool]:
        """``(parts, expert parameter ids, prefix)``: Megatron chains a dense and an expert
        optimizer when the model has experts, and its checkpoints follow: {0: dense, 1: experts},
        keys prefixed "chained_<i>." unless the metadata says chained_optim_avoid_prefix."""
        expert = {id(p) for g in self.optimizer.param_groups if g.get("is_expert_parallel") for p in g["params"]}
        parts: List[Optional[bool]] = [False, True] if expert else [None]
        return parts, expert, bool(expert) and not (metadata or {}).get("chained_optim_avoid_prefix", False)

    def _model_space_out(self, parts: List[Optional[bool]], tensors: Dict[Optional[bool], Dict[str, Any]],
                         step: Optional[float], common: Dict[str, Any]) -> Dict[Any, Any]:
        groups = self.optimizer.state_dict()["param_groups"]
        out = {}
        for part in parts:
            # Where Megatron's own (non-distributed) optimizer keeps the step and its groups
            # (matched by wd_mult / lr_mult / ...: ours come from Megatron's _get_param_groups);
            # its mixed-precision optimizer nests them under "optimizer".
            counters: Dict[str, Any] = {
                "state": {"common_step": step},
                "param_groups": [{k: v for k, v in g.items() if k != "params"}  # Megatron's are local
                                 for g in groups if part is None or bool(g.get("is_expert_parallel")) == part]}
            if self._keeps_masters():
                counters = {"optimizer": counters}
            out[part] = {_MODEL_SPACE: tensors[part], **counters, **common}
        return out[None] if parts == [None] else {int(part): out[part] for part in parts}

    def _streamed_sharded_state_dict(self, boxes: Dict[int, List[Any]], names: Tuple[str, ...],
                                     metadata: Optional[dict], common: Dict[str, Any]) -> Dict[Any, Any]:
        """The model-space state on the model's boxes
        (dist_checkpoint.py [Note: streamed dist-checkpoint save]): views of this rank's state
        shards (and of its fp32 masters, the shards themselves); one all-reduce of the step."""
        parts, expert, prefix = self._model_space_parts(metadata)
        tensors: Dict[Optional[bool], Dict[str, Any]] = {part: {} for part in parts}
        steps = set()
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})
                if "step" in state:
                    steps.add(float(state["step"]))
                mine = boxes.get(id(param))
                states = {n: state[n] for n in names if n in state}
                if not mine or not states:
                    continue
                if self._keeps_masters():  # see [Note: fp32 masters]: the fp32 shard itself
                    states[_master_key(metadata)] = param
                part = (id(param) in expert) if expert else None
                chained = f"chained_{int(part)}." if prefix else ""
                key = mine[0].key  # stacked layers share a key: the entry is named by where it starts too
                tensors[part][f"{key}@{mine[0].global_offset}"] = {
                    name: state_boxes(mine, tensor, f"{chained}optimizer.state.{name}.{key}")
                    for name, tensor in states.items()}
        if len(steps) > 1:
            raise ValueError(f"the optimizer's step differs between parameters ({sorted(steps)}); cannot save one step")
        step = torch.tensor([steps.pop() if steps else -1.0], dtype=torch.float64, device=self._device)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank whose shards are all empty has none
        return self._model_space_out(parts, tensors, step.item() if step.item() >= 0 else None, common)

    def _keeps_masters(self) -> bool:
        """Whether Megatron's optimizer for this model keeps fp32 masters (bf16/fp16 runs)."""
        return bool(self.config.bf16 or self.config.fp16)

    def _load_model_space(self, state_dict: Dict[str, Any]) -> None:
        if state_dict.get("param_state_sharding_type") not in _MODEL_SPACE_FORMATS:
            raise ValueError(
                f"the checkpoint's distributed-optimizer state is {state_dict['param_state_sharding_type']!r}, "
                "laid out by Megatron's buckets; re-save it with --dist-ckpt-optim-fully-reshardable (model space), "
                "or resume with --no-load-optim"
            )
        nested = state_dict.get("optimizer") if isinstance(state_dict.get("optimizer"), dict) else {}
        step = (state_dict.get("state") or nested.get("state") or {}).get("common_step")
        if step is None:  # Megatron's distributed optimizer keeps it in its param groups
            groups = nested.get("param_groups") or []
            step = next((g["step"] for g in groups if "step" in g), None)
        chunk = self._chunk()
        states = {key: dict(st) for key, st in state_dict[_MODEL_SPACE].items()}
        masters = {key: st.pop(name) for key, st in states.items() for name in _MASTERS if name in st}
        with chunk.shards_in_place():
            if masters:  # over the bf16-rounded weights the model's load put in the shards
                load_full_state_dict(chunk.module, masters, strict=False)
            load_full_optimizer_state(chunk.module, self.optimizer, states, float(step) if step is not None else None)
        if self.grad_scaler is not None and state_dict.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])


_MODEL_SPACE = "vescale_zero_model_space"


def _is_megatron_distributed_state(state_dict: Dict[str, Any]) -> bool:
    """Whether ``state_dict`` is Megatron's ``DistributedOptimizer.state_dict()``: the inner
    optimizer's hyperparameters without its state or its groups' parameters."""
    inner = state_dict.get("optimizer")
    return (isinstance(inner, dict) and "state" not in inner and bool(inner.get("param_groups"))
            and all("params" not in g for g in inner["param_groups"]))


_MASTERS = ("fp32_param", "param")  # [Note: fp32 masters]


def _master_key(metadata: Optional[dict]) -> str:
    """The name of the fp32 masters in a checkpoint of this ``metadata`` ([Note: fp32 masters])."""
    return "param" if (metadata or {}).get("distrib_optim_sharding_type") == "fully_reshardable" else "fp32_param"
_MODEL_SPACE_FORMATS = (None, "fully_reshardable", "fully_sharded_model_space")


def check_dist_checkpoint_optimizer(path: str) -> None:
    """Refuse, before any rank starts loading, a Megatron ``torch_dist`` checkpoint at
    ``path`` whose distributed-optimizer state is laid out by Megatron's gradient buckets
    (``dp_reshardable``, Megatron-LM's default): it maps to parameters only through
    Megatron's own bucket layout. No-op for other checkpoints."""
    state = common_state(path)  # [Note: one door to Megatron's releases]
    optimizer = state.get("optimizer") if isinstance(state, dict) else None
    fmt = optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None
    if fmt not in _MODEL_SPACE_FORMATS:
        raise ValueError(
            f"{path}: the distributed-optimizer state is saved as {fmt!r}, laid out by Megatron's gradient buckets, "
            "which only Megatron's own optimizer at the same TP/PP layout can read. Re-save it once with Megatron "
            "(--load this --save new --dist-ckpt-optim-fully-reshardable, same layout) and load that, or resume "
            "the weights only with --no-load-optim"
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
    model_chunks: List[RaggedFSDP],
    config_overrides: Optional[Dict[Any, Any]] = None,
    *,
    optimizer: Optional[str] = None,
    block: Optional[int] = None,
    **unused: Any,
) -> RaggedOptimizer:
    """Megatron's ``get_megatron_optimizer`` for ``RaggedFSDP`` chunks: Megatron's own
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
    if not all(isinstance(chunk, RaggedFSDP) for chunk in model_chunks):
        raise TypeError("get_vescale_optimizer needs RaggedFSDP model chunks "
                        "(build the model with --use-vescale-fsdp)")
    if name not in SUPPORTED_OPTIMIZERS:
        raise ValueError(f"--use-vescale-fsdp: optimizer {name!r} is not supported; "
                         f"choose one of {SUPPORTED_OPTIMIZERS}")
    # config.use_distributed_optimizer: accepted, RaggedFSDP already shards the optimizer state
    # config.optimizer_cpu_offload: the chunks' offloaded groups hold their shards and so this
    # optimizer's state in host memory (optimizer_offload.py), as long as they were sharded so
    check_offload_matches(config, model_chunks)
    twin_of: Dict[int, nn.Parameter] = {}
    chunks = []
    for chunk in model_chunks:
        named = []
        for fqn, p in chunk.named_parameters():
            twin = _meta_twin(p)
            twin_of[id(twin)] = p
            named.append((fqn, twin))
        chunks.append(_TwinChunk(named))
    # megatron-core 0.15's conditions, positional in its get_megatron_optimizer: [Note: one door to Megatron's releases]
    conditions = {k: unused[k] for k in ("no_weight_decay_cond", "scale_lr_cond", "lr_mult",
                                         "default_skip_embedding_weight_decay") if unused.get(k) is not None}
    groups = param_groups(chunks, config, config_overrides, **conditions)
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
                     nesterov=muon_nesterov(config),
                     ns_steps=getattr(config, "muon_num_ns_steps", 5),
                     weight_decay=config.weight_decay, adamw_lr=config.lr,
                     adamw_betas=(config.adam_beta1, config.adam_beta2), adamw_eps=config.adam_eps,
                     process_group=shard_group(getattr(model_chunks[0], "dense_mesh", model_chunks[0].dp_cp_group)))
    else:
        inner = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)
    return RaggedOptimizer(inner, config, model_chunks)
