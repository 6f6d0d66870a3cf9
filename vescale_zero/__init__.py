"""vescale-zero: RaggedShard FSDP with a structure-aware planner and zero-copy DBuffer."""

from . import checkpoint  # the subpackage: vz.checkpoint.save(...)
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
from .primitives.dtensor_interop import install_dtensor_interop
from .primitives.granularity import preset_granularity, resolve_granularities
from .primitives.placement import RaggedShard
from .primitives.planner import ShardPlan, TensorSpec, plan
from .primitives.ragged_tensor import RaggedDTensor, local_piece

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
