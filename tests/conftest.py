"""The CI matrix's selection: the ``matrix`` marker (``pytest -m "matrix and not slow" tests``).

[Note: what the CI matrix runs]
CI runs the full suite once, on the pinned torch and the test extra's hosts. The oldest and the
newest torch of setup.py's range, each with the oldest / the newest release of every host, run
the tests named in ``MATRIX``: every road from a host into the core, once, at one world size --
``fully_shard`` and FSDP2's surface on ``torch_compat``'s internals, DCP and ``torch.compile``;
DeepSpeed's engine, its config, backward, checkpointing and offload keys; megatron-core's DDP,
optimizer and checkpoints, Megatron-LM's loop; transformers, accelerate and TRL -- so that every
road meets every release. What no host or torch release changes (the planner, the optimizers'
own arithmetic, the command-line tools) and the sweeps' other world sizes stay in the full suite.
The releases between the oldest and the newest run the registry's signatures and each host's
example job (``.ci/run``).
"""

from __future__ import annotations

import fnmatch
from typing import List

import pytest

MATRIX = (
    # torch: fully_shard, FSDP2's surface, the internals torch_compat reaches, DCP, compile
    "tests/test_main_job.py",
    "tests/test_torch_compat.py",
    "tests/test_warnings.py",
    "tests/test_fsdp2_arguments.py",
    "tests/test_fsdp2_surface.py::test_every_fsdp_module_method_is_ours_with_fsdp2s_recurse_default",
    "tests/test_fsdp2_surface.py::test_reshard_after_forward_values_as_fsdp2_validates_them",
    "tests/test_fsdp2_surface.py::*[[]3ranks]",
    "tests/test_torch_utilities.py::test_torch_utilities_on_sharded_parameters[3]",
    "tests/test_checkpoint.py::test_fsdp2_dcp_checkpoint_loads_and_training_continues",
    "tests/test_compile.py::test_compiled_trains_like_eager_ddp_and_unsharded_fp32[]",
    "tests/test_recompute.py::test_every_recompute_form_equals_the_run_without[3]",
    # every host: the registry against the installed releases, the release checks
    "tests/test_host_patches.py",
    "tests/test_host_releases.py",
    # DeepSpeed
    "tests/test_deepspeed.py",
    "tests/test_deepspeed_config.py",
    "tests/test_deepspeed_backward_paths.py",
    "tests/test_deepspeed_checkpointing.py",
    "tests/test_deepspeed_offload.py::test_ignored_and_refused_keys",
    "tests/test_deepspeed_nvme_offload.py::test_nvme_offload_config_errors",
    "tests/test_grad_accumulation.py::test_deepspeed_accumulation_beside_zero3",
    # megatron-core and Megatron-LM
    "tests/test_megatron.py::test_vescale_fsdp_equals_megatron_ddp",
    "tests/test_megatron.py::test_checkpoint_resume_and_ddp_state_dict_interchange",
    "tests/test_megatron.py::test_megatron_dist_checkpoint_of_this_release_converts_and_resumes",
    "tests/test_megatron.py::test_unsupported_settings_give_clear_errors",
    "tests/test_megatron_example.py",
    "tests/test_megatron_lm_train.py",
    # transformers, accelerate, TRL
    "tests/test_huggingface.py::test_sharded_llama_without_recompute_matches_unsharded",
    "tests/test_generation.py::test_trl_unwrap_model_for_generation_matches_zero3",
)
"""The tests the matrix runs ([Note: what the CI matrix runs]): node-id prefixes, or ``fnmatch``
patterns where they hold a ``*``."""


def _in_matrix(nodeid: str) -> bool:
    return any(fnmatch.fnmatchcase(nodeid, entry) if "*" in entry else nodeid.startswith(entry) for entry in MATRIX)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        if _in_matrix(item.nodeid):
            item.add_marker(pytest.mark.matrix)
