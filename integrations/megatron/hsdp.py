"""HSDP under Megatron: ``--num-distributed-optimizer-instances N`` as a 2-D mesh.

Megatron's ``initialize_model_parallel(num_distributed_optimizer_instances=N)`` splits each
data-parallel (x context-parallel) group into N *instances* of consecutive ranks (its
``intra_dp_cp`` groups) and joins the ranks at the same place of every instance (its
``inter_dist_opt`` group, one for dense and expert parameters alike). Under
``--use-vescale-fsdp`` that is HSDP: shard inside an instance, replicate across them::

    dp_cp ranks  [0 1 2 3 4 5 6 7], N = 2        mesh ("replicate", "shard")
    instance 0   [0 1 2 3]  <- intra_dp_cp        [[0 1 2 3],
    instance 1   [4 5 6 7]                          [4 5 6 7]]   columns: inter_dist_opt

[Note: Megatron HSDP mesh] The core takes a 2-D ``DeviceMesh`` over the whole world, or one
sliced from such a mesh (vescale_zero.fully_shard [Note: HSDP sub-mesh]). Beside tensor /
pipeline parallelism the data-parallel ranks are a slice of the world, so we build a 3-D mesh
``("model", "replicate", "shard")`` from Megatron's own groups -- the model-parallel group
(the ranks holding other slices of the model with the same data-parallel place), the
inter-instance group and the instance group -- and hand the core its
``["replicate", "shard"]`` slice; no process group is created. Megatron's rank layouts are
sums of per-dimension offsets, so the rank at (model m, replica i, shard j) is
``model[m] + replicate[i] + shard[j] - 2 * rank``; we check that the mesh so built covers the
world and that its data-parallel slice is exactly Megatron's data-parallel group, and refuse
otherwise.

[Note: experts under N instances] Megatron splits the expert-data-parallel group the same
way (``intra_expt_dp``, same inter-instance group): expert parameters are sharded inside the
instance's expert-data-parallel group and replicated across instances, as their optimizer
state is under Megatron's partial distributed optimizer. Gradient scaling is unchanged:
1/(dp x cp) before a SUM over shard and replicas (grad_reduce [Note: HSDP]).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["hsdp_mesh", "check_outer_dp_sharding", "ddp_process_groups", "data_parallel_meshes", "shard_group",
           "replica_rank"]

OUTER_DP_SHARDING = "no_shard"
"""The only ``outer_dp_sharding_strategy`` RaggedFSDP runs: replicas across instances."""


def check_outer_dp_sharding(ddp_config) -> None:
    """Refuse an ``outer_dp_sharding_strategy`` other than ``'no_shard'`` (replicate across
    instances, which is HSDP); the others shard optimizer state across instances too."""
    strategy = getattr(ddp_config, "outer_dp_sharding_strategy", OUTER_DP_SHARDING)
    if strategy != OUTER_DP_SHARDING:
        raise ValueError(
            f"--use-vescale-fsdp: outer_dp_sharding_strategy={strategy!r} is not supported; RaggedFSDP shards "
            "inside each distributed-optimizer instance and replicates across instances "
            f"(outer_dp_sharding_strategy={OUTER_DP_SHARDING!r}). To shard over more ranks, use fewer "
            "--num-distributed-optimizer-instances"
        )


def _not_built_for(instances: int, found: str) -> ValueError:
    return ValueError(
        f"--use-vescale-fsdp with num_distributed_optimizer_instances={instances}: Megatron's process groups were not "
        f"built for {instances} instances ({found}); call parallel_state.initialize_model_parallel(..., "
        f"num_distributed_optimizer_instances={instances}) (Megatron-LM: --num-distributed-optimizer-instances "
        f"{instances}), with data-parallel x context-parallel size divisible by it"
    )


def ddp_process_groups(pg_collection: Any, config: Any, ddp_config: Any) -> Dict[str, Any]:
    """Megatron's ``ProcessGroupCollection.setup_process_groups_for_ddp``, with a clear error
    when ``num_distributed_optimizer_instances`` > 1 but Megatron's groups were built for one."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    try:
        return ProcessGroupCollection.setup_process_groups_for_ddp(pg_collection, config, ddp_config)
    except AssertionError as e:
        if ddp_config.num_distributed_optimizer_instances > 1:
            raise _not_built_for(ddp_config.num_distributed_optimizer_instances, f"Megatron: {e}") from e
        raise


def _ranks(group: Optional[dist.ProcessGroup]) -> List[int]:
    return dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]


def hsdp_mesh(
    dp_group: dist.ProcessGroup,
    instance_group: dist.ProcessGroup,
    inter_instance_group: dist.ProcessGroup,
    model_group: Optional[dist.ProcessGroup],
    device_type: str,
    what: str = "data-parallel",
) -> DeviceMesh:
    """The ``("replicate", "shard")`` mesh of this rank (see [Note: Megatron HSDP mesh]).

    Args:
        dp_group: Megatron's whole data-parallel group of these parameters (``dp_cp`` or
            ``expt_dp``), which the mesh must equal.
        instance_group: the ranks of this rank's instance (``intra_dp_cp`` / ``intra_expt_dp``).
        inter_instance_group: the same place in every instance (``inter_dist_opt``).
        model_group: the other model-parallel ranks with this data-parallel place (Megatron's
            ``tp-pp`` model-parallel group, ``tp-ep-pp`` for experts); ``None``: no model
            parallelism.
        device_type: the mesh's device type (``"cuda"``, ``"cpu"``, ...).
        what: names the group in errors.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model, replicate, shard = _ranks(model_group), _ranks(inter_instance_group), _ranks(instance_group)
    grid = torch.tensor([[[m + r + s - 2 * rank for s in shard] for r in replicate] for m in model], dtype=torch.int)
    dp_slice = sorted(grid[model.index(rank)].flatten().tolist())
    if dp_slice != sorted(_ranks(dp_group)) or sorted(grid.flatten().tolist()) != list(range(world)):
        raise ValueError(
            f"RaggedFSDP: Megatron's distributed-optimizer instance groups do not tile the {what} group: "
            f"instance {shard} x inter-instance {replicate} gives {dp_slice}, but the {what} group is "
            f"{sorted(_ranks(dp_group))} (model-parallel group {model}, world {world}). Use Megatron's "
            "initialize_model_parallel(num_distributed_optimizer_instances=N) groups, or pass them in pg_collection "
            "as it builds them"
        )
    if model_group is None:  # the data-parallel group is the world: the 2-D mesh covers it
        return DeviceMesh.from_group([inter_instance_group, instance_group], device_type, mesh=grid[0],
                                     mesh_dim_names=("replicate", "shard"))
    root = DeviceMesh.from_group([model_group, inter_instance_group, instance_group], device_type, mesh=grid,
                                 mesh_dim_names=("model", "replicate", "shard"))
    return root["replicate", "shard"]


def data_parallel_meshes(groups: Dict[str, Any], num_instances: int, device_type: str
                         ) -> Tuple[Union[dist.ProcessGroup, DeviceMesh], Union[dist.ProcessGroup, DeviceMesh]]:
    """``(dense, expert)``: what ``fully_shard`` shards dense and expert parameters over.

    ``groups``: ``ProcessGroupCollection.setup_process_groups_for_ddp``'s dictionary. One
    instance: Megatron's ``dp_cp`` and ``expt_dp`` groups (flat sharding). ``N`` instances:
    a ``("replicate", "shard")`` mesh for each (see [Note: Megatron HSDP mesh] and
    [Note: experts under N instances]).
    """
    dense, expert = groups["dp_cp_group"], groups["expt_dp_group"]
    if num_instances == 1:
        return dense, expert
    inter, intra = groups.get("inter_dist_opt_group"), groups.get("intra_dp_cp_group")
    if inter is None or intra is None or intra.size() * num_instances != dense.size() or inter.size() != num_instances:
        raise _not_built_for(num_instances, f"data-parallel x context-parallel group of {dense.size()} ranks, "
                             f"instance group of {intra.size() if intra is not None else None}, inter-instance "
                             f"group of {inter.size() if inter is not None else None}")
    from megatron.core import parallel_state

    initialized = parallel_state.model_parallel_is_initialized()
    dense_model = parallel_state.get_model_parallel_group() if initialized else None
    if dense_model is None and dense.size() != dist.get_world_size():
        raise ValueError("--use-vescale-fsdp with several distributed-optimizer instances beside model parallelism "
                         "needs Megatron's parallel_state (initialize_model_parallel) for the model-parallel group")
    dense_mesh = hsdp_mesh(dense, intra, inter, dense_model, device_type, "data-parallel x context-parallel")
    if expert is None:
        return dense_mesh, expert
    intra_expert = groups.get("intra_expt_dp_group")
    expert_model = parallel_state.get_expert_tensor_model_pipeline_parallel_group() if initialized else None
    if intra_expert is None or (expert_model is None and expert.size() != dist.get_world_size()):
        raise ValueError("--use-vescale-fsdp with several distributed-optimizer instances and experts needs "
                         "Megatron's intra-instance expert-data-parallel group (initialize_model_parallel)")
    expert_mesh = hsdp_mesh(expert, intra_expert, inter, expert_model, device_type, "expert-data-parallel")
    return dense_mesh, expert_mesh


def shard_group(mesh: Union[dist.ProcessGroup, DeviceMesh]) -> dist.ProcessGroup:
    """The group parameters are sharded over: the mesh's ``"shard"`` group, or the group."""
    return mesh.get_group("shard") if isinstance(mesh, DeviceMesh) else mesh


def replica_rank(mesh: Union[dist.ProcessGroup, DeviceMesh, None]) -> int:
    """This rank's instance (place in the ``"replicate"`` dimension); 0 without HSDP."""
    return mesh.get_local_rank("replicate") if isinstance(mesh, DeviceMesh) else 0
