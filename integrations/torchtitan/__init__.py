"""torchtitan adapter: torchtitan's ``parallelize_*`` functions shard with ``vescale_zero.fully_shard``.

    import vescale_zero.integrations.torchtitan as vz_torchtitan
    vz_torchtitan.install()          # once, before torchtitan builds the model (its Trainer, or your loop)

[Note: the torchtitan switch]
Every torchtitan decoder (Llama-3, Qwen3, DeepSeek-V3, GPT-OSS, ...) and VLM encoder is sharded by
``torchtitan.distributed.fsdp`` (``apply_fsdp_to_decoder``, ``apply_fsdp_to_vision_encoder``), which
calls the ``fully_shard`` it imported from torch. ``install()`` puts ours in its place (the host
patch ``torchtitan.distributed.fsdp.fully_shard``, vescale_zero/host_patches.py), so torchtitan's own
code shards with RaggedShard groups: its lists of modules (``[norm, lm_head]``, tied embeddings),
``shard_placement_fn`` for experts, ``dp_mesh_dims``, ``CPUOffloadPolicy``, and the ``FSDPModule``
methods it calls after (``set_gradient_divide_factor(1.0)``, explicit prefetching) keep their
meaning (``docs/torch_api.md``, ``docs/fsdp2_api.md``). The rest of torchtitan is unchanged:
``to_empty`` + ``init_weights()`` initialise the shards (ragged_tensor
[Note: random fills draw the whole tensor]), its optimizer container steps the sharded parameters,
its ``CheckpointManager`` saves and loads them with DCP (checkpoints interchangeable with FSDP2's),
its ``clip_grad_norm_`` reduces their gradients' norms. Models torchtitan shards elsewhere (Flux's
own ``parallelize``, experiments) keep torch's ``fully_shard``. ``uninstall()`` puts torch's back.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from torch import nn

import vescale_zero as vz
from vescale_zero import host_patches

__all__ = ["install", "uninstall", "fully_shard", "torchtitan_installed", "TORCHTITAN"]

TORCHTITAN = "torchtitan"
"""The host patch set (``vescale_zero.host_patches``) of this switch."""


# host patch torchtitan.distributed.fsdp.fully_shard: checked against torchtitan 0.3.0
def fully_shard(module: Union[nn.Module, Sequence[nn.Module]], **kwargs: Any) -> Any:
    """What ``torchtitan.distributed.fsdp`` calls once installed: ``vescale_zero.fully_shard``,
    which takes torch's arguments with their meaning ([Note: the torchtitan switch])."""
    return vz.fully_shard(module, **kwargs)


def torchtitan_installed() -> bool:
    """Whether torchtitan can be imported here (the host patch applies only then)."""
    import importlib.util

    return importlib.util.find_spec("torchtitan") is not None


def install() -> None:
    """Make torchtitan shard with ``vescale_zero.fully_shard`` ([Note: the torchtitan switch])."""
    if not torchtitan_installed():
        raise ImportError("vescale_zero.integrations.torchtitan.install(): torchtitan is not installed; "
                          "pip install 'vescale-zero[torchtitan]' (torchtitan 0.3)")
    host_patches.install(TORCHTITAN)


def uninstall() -> None:
    """torchtitan shards with torch's ``fully_shard`` again (modules sharded before stay ours)."""
    host_patches.uninstall(TORCHTITAN)
