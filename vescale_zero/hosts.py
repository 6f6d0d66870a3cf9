"""The front door for adapters: what a host's adapter (``vescale_zero.integrations``) may use of the core.

Users enter through ``vescale_zero/__init__.py`` (``import vescale_zero as vz``); the adapters for
DeepSpeed and Megatron enter through the public API too, plus this module. It re-exports, from the
layers below, the few internals a host needs to plug our sharding into its own engine, and nothing
else: an adapter imports ``vescale_zero``, ``vescale_zero.hosts``, ``vescale_zero.optim``,
``vescale_zero.checkpoint`` (their public ``__init__``), ``vescale_zero.torch_compat`` and the
registry of host patches, never another core module (``tests/test_layers.py`` checks it). A name
that an adapter needs and that is not here is added here first, with its line in the table.

============================  ==========================================================================
what hosts may use            names
============================  ==========================================================================
groups of a module            ``groups_of`` (every ``ParamGroup`` at or under a module, module order),
                              ``ParamGroup`` (its ``managed`` parameters, ``process_group``,
                              ``master`` / ``grads`` buffers, ``requires_grad_sync``), ``GroupState``
                              (gathered or not), ``HSDP_DIM_NAMES`` (the names of a 2-D mesh)
a parameter's slot            ``slot_of`` (``(group, index)`` of a sharded parameter),
                              ``copy_parameter_attributes`` (a host's attributes onto our parameters)
full parameters for a while   ``replace_parameters`` / ``put_parameters`` (full tensors installed as
                              the module's parameters, and the shards put back), ``Owner`` (who holds a
                              parameter, for ``vz.fill_group_by_group``'s sources)
local pieces                  ``is_ragged`` (a ``RaggedDTensor``), ``like_param`` (a flat piece in a
                              parameter's layout); ``vz.local_piece`` is public
state dicts and optimizers    ``sharded_params_by_key``, ``full_optimizer_state``,
                              ``load_full_optimizer_state``, ``restored_step`` (a loaded ``step`` placed
                              as torch places it), ``LocalPieces`` (a rank's flat range as boxes),
                              ``grad_norm_over_groups`` (a norm over pieces of several groups)
the hosts' hooks              ``outside_compile`` (a hook run eagerly under ``torch.compile``),
                              ``carry_job_timeout`` (the job's timeout onto a host's process groups),
                              ``collective_device`` (where a small collective's tensor lives),
                              ``StateOffloader`` (storages moved to host memory and back),
                              ``GranularityPolicy`` (the type of ``fully_shard``'s ``granularity``)
checkpoint helpers            ``CheckpointError``, ``CHECKPOINT_DOMAIN`` (a parameter's name qualifier),
                              ``METADATA_FILE``, ``latest_tag``, ``read_dcp`` (a DCP directory whole),
                              ``write_whole`` (a one-rank checkpoint), ``refuse`` (a notice for another
                              framework's reader)
============================  ==========================================================================
"""

from .api.clip_grad import grad_norm_over_groups
from .api.full_parameters import Owner
from .api.fully_shard import HSDP_DIM_NAMES, groups_of
from .api.param_swap import put_parameters, replace_parameters
from .api.state_dict import (
    LocalPieces,
    full_optimizer_state,
    load_full_optimizer_state,
    restored_step,
    sharded_params_by_key,
)
from .checkpoint.format import (
    CHECKPOINT_DOMAIN,
    METADATA_FILE,
    CheckpointError,
    latest_tag,
    read_dcp,
    refuse,
    write_whole,
)
from .primitives.comm_device import collective_device
from .primitives.granularity import GranularityPolicy
from .primitives.ragged_tensor import is_ragged, like_param
from .runtime.eager_hooks import outside_compile
from .runtime.group_progress import GroupState
from .runtime.job_timeout import carry_job_timeout
from .runtime.param_attributes import copy_parameter_attributes
from .runtime.param_group import ParamGroup, slot_of
from .runtime.state_offload import StateOffloader

__all__ = [
    # groups of a module
    "groups_of", "ParamGroup", "GroupState", "HSDP_DIM_NAMES",
    # a parameter's slot
    "slot_of", "copy_parameter_attributes",
    # full parameters for a while
    "replace_parameters", "put_parameters", "Owner",
    # local pieces
    "is_ragged", "like_param",
    # state dicts and optimizers
    "sharded_params_by_key", "full_optimizer_state", "load_full_optimizer_state", "restored_step", "LocalPieces",
    "grad_norm_over_groups",
    # the hosts' hooks
    "outside_compile", "carry_job_timeout", "collective_device", "StateOffloader", "GranularityPolicy",
    # checkpoint helpers
    "CheckpointError", "CHECKPOINT_DOMAIN", "METADATA_FILE", "latest_tag", "read_dcp", "write_whole", "refuse",
]
