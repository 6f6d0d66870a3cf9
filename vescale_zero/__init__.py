"""vescale-zero: RaggedShard FSDP with a structure-aware planner and zero-copy DBuffer."""

from . import checkpoint  # the subpackage: vz.checkpoint.save(...)
from .clip_grad import clip_grad_norm_, clip_grads_with_norm_, sharded_grad_norm
from .dbuffer import DBuffer
from .dtensor_interop import install_dtensor_interop
from .fill import fill_group_by_group
from .fully_shard import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    RaggedFSDPModule,
    fully_shard,
    fully_shard_layers,
    sharded_counterpart,
)
from .gathered import gathered_parameters
from .granularity import preset_granularity, resolve_granularities
from .materialize import materialize
from .nonfinite import NonFiniteStepSkipper, skip_nonfinite_steps
from .placement import RaggedShard
from .planner import ShardPlan, TensorSpec, plan
from .ragged_tensor import RaggedDTensor, local_piece
from .report import ShardingReport, reset_comm_stats, sharding_report
from .state_dict import full_state_dict, load_full_state_dict

__version__ = "0.1.0"

install_dtensor_interop()  # [Note: torch's DTensor functions meet RaggedShard]

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
