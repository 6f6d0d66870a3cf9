"""vescale-zero: RaggedShard FSDP with a structure-aware planner and zero-copy DBuffer.

This module is the front door for users (re-exports only). The package, in layers, each
importing only the layers below it (``tests/test_layers.py`` checks it)::

    tools/        5  cli (vescale-zero), model_shapes, gpu_check (python -m vescale_zero.gpu_check)
    optim/        4  structure-aware optimizers, optimizer state files
    checkpoint/   4  sharded checkpoints, FSDP2 conversion, consolidation
    api/          3  what users call: fully_shard, the module's methods, full parameters, state dicts
    runtime/      2  one group's life: buffers, gather, reduce, the reduce-scatter scheduler, hooks
    primitives/   1  placement, planner, granularity, DBuffer, collectives, ragged tensors
    torch_compat     the one door to torch internals (any layer)
    host_patches     every change to a host's code, applied by install(host) ([Note: host patches])
    hosts            the front door for the adapters (vescale_zero.integrations), and only theirs
"""

from . import checkpoint, host_patches  # checkpoint: the subpackage (vz.checkpoint.save(...))
from .api.clip_grad import clip_grad_norm_, clip_grads_with_norm_, sharded_grad_norm
from .api.full_parameters import fill_group_by_group, gathered_parameters
from .api.fully_shard import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    RaggedFSDPModule,
    fully_shard,
    fully_shard_layers,
    sharded_counterpart,
)
from .api.materialize import materialize
from .api.nonfinite import NonFiniteStepSkipper, skip_nonfinite_steps
from .api.report import ShardingReport, reset_comm_stats, sharding_report
from .api.state_dict import full_state_dict, load_full_state_dict
from .primitives.dbuffer import DBuffer
from .primitives.granularity import preset_granularity, resolve_granularities
from .primitives.placement import RaggedShard
from .primitives.planner import ShardPlan, TensorSpec, plan
from .primitives.ragged_tensor import RaggedDTensor, local_piece

__version__ = "0.1.0"

host_patches.install("torch")  # [Note: torch's DTensor functions meet RaggedShard]; 2.11's rule lookup

__all__ = [
    "fully_shard",
    "fully_shard_layers",
    "sharded_counterpart",
    "full_state_dict",
    "load_full_state_dict",
    "materialize",
    "fill_group_by_group",
    "gathered_parameters",
    "RaggedFSDPModule",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "OffloadPolicy",
    "RaggedShard",
    "RaggedDTensor",
    "local_piece",
    "TensorSpec",
    "ShardPlan",
    "plan",
    "DBuffer",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "sharded_grad_norm",
    "skip_nonfinite_steps",
    "NonFiniteStepSkipper",
    "sharding_report",
    "reset_comm_stats",
    "ShardingReport",
    "preset_granularity",
    "resolve_granularities",
    "checkpoint",
]
