"""``--use-vescale-fsdp`` and our other flags, for Megatron-LM's ``extra_args_provider``.

    pretrain(..., extra_args_provider=add_vescale_fsdp_args)

    --use-vescale-fsdp                 shard with RaggedFSDP instead of DDP / FSDP
    --vescale-granularity G            'element' (default), 'row', '<N>rows' or an int
    --vescale-no-reshard-after-forward keep layers gathered from forward to backward
    --vescale-no-prefetch              gather each layer only when it runs
    --vescale-fp8-all-gather-tile T    gather weights as float8, one scale per TxT tile
    --vescale-optimizer NAME           'adamw8bit' (block-wise 8-bit AdamW), 'shampoo' (blocked
                                       Shampoo) or 'muon'; default: Megatron's --optimizer
    --vescale-optimizer-block N        its block (8-bit: 256 elements; Shampoo: 128 rows/cols)
    --vescale-optimizer-aware          with muon: matrices whole on one rank where that moves fewer bytes
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from vescale_zero.optim import AdamW8bit, Muon, Shampoo

from .data_parallel import RaggedFSDPOptions, clash_message
from .notices import warn_once
from .optimizer_offload import optimizer_offload

__all__ = [
    "add_vescale_fsdp_args", "validate_vescale_args", "vescale_options_from_args", "vescale_optimizer_name",
    "vescale_optimizer_block", "check_megatron_optimizer", "STRUCTURED_OPTIMIZERS", "flags_without_effect",
    "warn_flags_without_effect", "warn_once",
]

STRUCTURED_OPTIMIZERS = {"adamw8bit": AdamW8bit, "shampoo": Shampoo, "muon": Muon}


def _granularity(text: str) -> Union[int, str]:
    return int(text) if text.strip().isdigit() else text


def add_vescale_fsdp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags (an ``extra_args_provider`` for Megatron-LM's ``pretrain``)."""
    group = parser.add_argument_group(title="vescale-zero (ragged FSDP)")
    group.add_argument("--use-vescale-fsdp", action="store_true",
                       help="Shard parameters, gradients and optimizer state with vescale-zero's RaggedShard FSDP.")
    group.add_argument("--vescale-granularity", type=_granularity, default=None,
                       help="Atomic block of every parameter: 'element' (default), 'row', '<N>rows' or an int.")
    group.add_argument("--vescale-no-reshard-after-forward", dest="vescale_reshard_after_forward",
                       action="store_false", help="Keep each layer gathered from its forward to its backward.")
    group.add_argument("--vescale-no-prefetch", dest="vescale_prefetch", action="store_false",
                       help="Do not gather the next layer while the current one computes.")
    group.add_argument("--vescale-fp8-all-gather-tile", type=int, default=None, metavar="T",
                       help="Gather parameters as float8 with one scale per TxT tile (e.g. 128).")
    group.add_argument("--vescale-optimizer", choices=["adamw8bit", "shampoo", "muon"], default=None,
                       help="A vescale-zero structure-aware optimizer instead of Megatron's --optimizer.")
    group.add_argument("--vescale-optimizer-aware", action="store_true",
                       help="With Muon: keep matrices whole on one rank where that moves fewer bytes per step.")
    group.add_argument("--vescale-optimizer-block", "--vescale-8bit-block", dest="vescale_optimizer_block", type=int,
                       default=None, help="Its block: 8-bit quantization block in elements (default 256), or "
                       "Shampoo's preconditioner block side (default 128).")
    return parser


def validate_vescale_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations that fight ragged sharding, naming the fix."""
    if not getattr(args, "use_vescale_fsdp", False):
        if getattr(args, "vescale_optimizer", None):
            raise ValueError("--vescale-optimizer needs --use-vescale-fsdp")
        return
    # --use-distributed-optimizer is accepted: RaggedFSDP already shards the optimizer state (what it asks)
    for field in ("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp"):
        if getattr(args, field, False):
            raise ValueError(clash_message(field))
    check_megatron_optimizer(args)
    if getattr(args, "vescale_optimizer_aware", False) and vescale_optimizer_name(args) != "muon" \
            and "muon" not in str(getattr(args, "optimizer", "") or ""):
        raise ValueError("--vescale-optimizer-aware plans for Muon's matrices: add --vescale-optimizer muon, or "
                         "drop it")
    block = getattr(args, "vescale_optimizer_block", None)
    if block is not None and block <= 0:
        raise ValueError(f"--vescale-optimizer-block must be a positive number, got {block}")


def check_megatron_optimizer(args: argparse.Namespace) -> None:
    """Megatron-LM's ``--optimizer muon`` / ``dist_muon`` under ``--use-vescale-fsdp`` runs
    vescale-zero's Muon on the shards (Megatron's own Muon cannot see sharded parameters); refuse
    it beside a different ``--vescale-optimizer``."""
    megatron_name = str(getattr(args, "optimizer", "") or "")
    ours = vescale_optimizer_name(args)
    if "muon" in megatron_name and ours not in (None, "muon"):
        raise ValueError(
            f"--optimizer {megatron_name} and --vescale-optimizer {ours} ask for two optimizers: under "
            f"--use-vescale-fsdp pass --vescale-optimizer muon (vescale-zero's Muon on the shards) with "
            f"--optimizer adam, or --vescale-optimizer {ours} with --optimizer adam")


def vescale_optimizer_block(args: argparse.Namespace) -> int:
    """The block of ``--vescale-optimizer`` (its class default unless given)."""
    block = getattr(args, "vescale_optimizer_block", None)
    if block is not None:
        return block
    cls = STRUCTURED_OPTIMIZERS[vescale_optimizer_name(args)]
    block = inspect.signature(cls).parameters.get("block")
    return block.default if block is not None else None


def vescale_optimizer_name(args: argparse.Namespace) -> Optional[str]:
    """The optimizer name :func:`get_vescale_optimizer` should build (``None``: --optimizer)."""
    return getattr(args, "vescale_optimizer", None)


def vescale_options_from_args(args: argparse.Namespace) -> RaggedFSDPOptions:
    granularity: Any = getattr(args, "vescale_granularity", None)
    name = vescale_optimizer_name(args)
    if name is not None:
        if granularity is not None:
            raise ValueError(
                f"--vescale-optimizer {name} sets the granularity itself (its blocks whole on one rank); "
                "drop --vescale-granularity"
            )
        cls = STRUCTURED_OPTIMIZERS[name]
        if hasattr(cls, "granularity"):  # Muon needs none: it joins each matrix on a root rank
            granularity = cls.granularity(vescale_optimizer_block(args))
    aware = None
    if getattr(args, "vescale_optimizer_aware", False):  # each micro-batch gathers again; the optimizer moves once
        batches = [getattr(args, k, None) for k in ("global_batch_size", "micro_batch_size", "data_parallel_size")]
        aware = Muon.optimizer_aware(micro_batches=max(1, batches[0] // (batches[1] * batches[2]))
                                     if all(batches) else 1)
    return RaggedFSDPOptions(
        granularity=granularity,
        optimizer_aware=aware,
        reshard_after_forward=getattr(args, "vescale_reshard_after_forward", True),
        prefetch=getattr(args, "vescale_prefetch", True),
        fp8_all_gather_tile=getattr(args, "vescale_fp8_all_gather_tile", None),
        optimizer_offload=optimizer_offload(args),  # Megatron-LM's --optimizer-cpu-offload: optimizer_offload.py
    )


_GROUPS = ("RaggedFSDP's buckets are its groups (one flat buffer per transformer layer, one for the rest of the "
           "model), each reduce-scattered once per step")
_NO_EFFECT: List[Tuple[str, str, Callable[[Any], bool], str]] = [
    # Megatron-LM's default: no_shard up to 0.17, optim_grads_params from 0.18 (what RaggedFSDP does: nothing to say)
    ("--data-parallel-sharding-strategy", "data_parallel_sharding_strategy",
     lambda v: v not in (None, "no_shard", "optim_grads_params"),
     "it picks what Megatron-FSDP shards; RaggedFSDP always shards parameters, gradients and optimizer state over "
     "data parallelism (what 'optim_grads_params' asks for)"),
    ("--ddp-reduce-scatter-with-fp32-accumulation", "ddp_reduce_scatter_with_fp32_accumulation", bool,
     "RaggedFSDP reduce-scatters in the reduce dtype, which --accumulate-allreduce-grads-in-fp32 (Megatron-LM's "
     "default under --bf16) makes fp32, so the sum is accumulated in fp32 there; without it, in bf16/fp16"),
    ("--check-for-large-grads", "check_for_large_grads", bool,
     "RaggedFSDP checks the reduced gradients for NaN / Inf only (--check-for-nan-in-loss-and-grad), not for "
     "unexpectedly large ones"),
    ("--ddp-bucket-size", "ddp_bucket_size", lambda v: v is not None, _GROUPS),
    ("--ddp-num-buckets", "ddp_num_buckets", lambda v: v is not None, _GROUPS),
    ("--ddp-pad-buckets-for-high-nccl-busbw", "ddp_pad_buckets_for_high_nccl_busbw", bool,
     "every rank's piece of a RaggedFSDP group starts on 16 bytes already (DEFAULT_ALIGN_BYTES); the groups are "
     "not padded further"),
    ("--use-torch-optimizer-for-cpu-offload", "use_torch_optimizer_for_cpu_offload", bool,
     "under --optimizer-cpu-offload RaggedFSDP's optimizer (torch's, or --vescale-optimizer's) steps the offloaded "
     "shards where they live, on the host, whichever optimizer class Megatron would pick"),
    ("--overlap-cpu-optimizer-d2h-h2d", "overlap_cpu_optimizer_d2h_h2d", bool,
     "under --optimizer-cpu-offload RaggedFSDP copies each group's shard to the device on a copy stream of its own "
     "and its reduced gradients back without waiting (vescale_zero.runtime.offload), always"),
    ("--use-precision-aware-optimizer", "use_precision_aware_optimizer", bool,
     "RaggedFSDP's sharded parameters are the fp32 master weights, updated in place by a torch optimizer whose "
     "states take their dtype (fp32); for lower-precision optimizer states use --vescale-optimizer adamw8bit"),
] + [(flag, flag[2:].replace("-", "_"), lambda v: v not in (None, "fp32", torch.float32),
      "RaggedFSDP keeps fp32 master shards and fp32 optimizer states (for 8-bit states: --vescale-optimizer "
      "adamw8bit); the gradients are reduced in fp32 under --accumulate-allreduce-grads-in-fp32, else in the "
      "model's dtype")
     for flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")]
_NO_PREFETCH = ("RaggedFSDP overlaps each group's parameter all-gather with the previous group's compute by "
                "prefetching, which --vescale-no-prefetch turns off")


def flags_without_effect(args: argparse.Namespace) -> List[Tuple[str, str]]:
    """``[(flag, why)]``: Megatron-LM flags that ``args`` sets and that change nothing under
    ``--use-vescale-fsdp`` (nothing without it)."""
    if not getattr(args, "use_vescale_fsdp", False):
        return []
    out = [(flag, why) for flag, field, is_set, why in _NO_EFFECT if is_set(getattr(args, field, None))
           # Megatron-LM's validate_args asks for it beside --optimizer-cpu-offload: no news to the user
           and not (flag == "--use-precision-aware-optimizer" and getattr(args, "optimizer_cpu_offload", False))]
    # --overlap-param-gather asks what RaggedFSDP's prefetch does (its default): an effect unless that is off
    if getattr(args, "overlap_param_gather", False) and not getattr(args, "vescale_prefetch", True):
        out.append(("--overlap-param-gather", _NO_PREFETCH))
    return out


def warn_flags_without_effect(args: argparse.Namespace) -> None:
    """Say once per flag (:func:`warn_once`) which of Megatron-LM's flags have no effect under
    ``--use-vescale-fsdp``, and why."""
    for flag, why in flags_without_effect(args):
        warn_once(flag, f"{flag} has no effect under --use-vescale-fsdp: {why}")
