"""Megatron's ``--optimizer-cpu-offload`` under ``--use-vescale-fsdp``: which groups live on the host.

Megatron's own offload (megatron-core's ``HybridDeviceOptimizer``) copies parameters to the CPU
when its optimizer is built and steps them there. Here the sharded parameters *are* the master
weights the optimizer holds, so offloading them is a placement decision made when
``RaggedFSDP`` shards the model (``fully_shard(..., offload_policy=CPUOffloadPolicy(...))``,
vescale_zero.runtime.offload): an offloaded group keeps its master shard, its gradient shard and so the
optimizer's state in host memory, and the optimizer steps there; gathers and reduce-scatters
stay on the device. The settings reach the wrapper from the same source as the optimizer's:

* Megatron-LM: its parsed arguments (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``,
  ``--no-pin-cpu-params`` / ``--no-pin-cpu-grads``) through ``vescale_options_from_args``;
* megatron-core alone: ``RaggedFSDPOptions(optimizer_offload=optimizer_offload(optimizer_config))``.

``get_vescale_optimizer`` checks that the chunks were sharded with the settings of its
``OptimizerConfig`` (:func:`check_offload_matches`).

[Note: offload fraction] Megatron offloads parameters in the order of its optimizer's groups
until the offloaded elements reach ``fraction`` of the rank's total (the parameter that crosses
the threshold is offloaded too; 0 offloads nothing, 1 everything). A group is one buffer, so
here whole groups are offloaded, in module order (``RaggedFSDP.vescale_groups``: the root group
-- embeddings, final norm, output layer -- then each transformer layer, its experts after it),
by the same rule: at least ``fraction`` of the rank's parameters, the first group that reaches
it included. With fraction 1 every group is offloaded.

[Note: pinning] ``CPUOffloadPolicy`` has one ``pin_memory`` for every host buffer; Megatron has
two flags (``pin_cpu_params``, ``pin_cpu_grads``, both on by default). The host buffers are
pinned when both are on; turning either off turns pinning off for all of them (said once). On a
machine without an accelerator nothing is pinned either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

from torch.distributed.fsdp import CPUOffloadPolicy

from .notices import warn_once

__all__ = ["OptimizerOffload", "optimizer_offload", "groups_to_offload", "check_offload_matches"]


@dataclasses.dataclass(frozen=True)
class OptimizerOffload:
    """Megatron's optimizer CPU offload settings, as ``RaggedFSDP`` applies them."""

    fraction: float = 1.0
    """At least this fraction of the rank's parameters, whole groups ([Note: offload fraction])."""
    pin_memory: bool = True
    """Pin the host buffers ([Note: pinning])."""

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"optimizer offload fraction must be in (0, 1], got {self.fraction} "
                             "(Megatron's --optimizer-offload-fraction; 0 means no offload)")

    def policy(self) -> CPUOffloadPolicy:
        """The policy ``fully_shard`` takes for an offloaded group."""
        return CPUOffloadPolicy(pin_memory=self.pin_memory)


def optimizer_offload(source: Any) -> Optional[OptimizerOffload]:
    """The offload that Megatron's settings in ``source`` ask for (Megatron-LM's parsed arguments
    or megatron-core's ``OptimizerConfig``: the same field names), ``None`` for none.

    ``optimizer_cpu_offload`` off, or ``optimizer_offload_fraction`` 0 (``OptimizerConfig``'s
    default, with which Megatron's optimizer offloads nothing either): ``None``."""
    if not getattr(source, "optimizer_cpu_offload", False):
        return None
    fraction = float(getattr(source, "optimizer_offload_fraction", 1.0))
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        warn_once("--optimizer-offload-fraction", "--optimizer-cpu-offload with --optimizer-offload-fraction 0 "
                  "(megatron-core OptimizerConfig's default) offloads nothing, as in Megatron; pass "
                  "--optimizer-offload-fraction 1.0 (optimizer_offload_fraction=1.0) to offload every group")
        return None
    pin_params = bool(getattr(source, "pin_cpu_params", True))
    pin_grads = bool(getattr(source, "pin_cpu_grads", True))
    if pin_params != pin_grads:
        off = "--no-pin-cpu-params" if not pin_params else "--no-pin-cpu-grads"
        warn_once(off, f"{off} under --use-vescale-fsdp turns pinning off for every host buffer of an offloaded "
                  "group (its master shard, gradient shard and optimizer state share one pin_memory setting)")
    return OptimizerOffload(fraction=fraction, pin_memory=pin_params and pin_grads)


def groups_to_offload(numels: Sequence[int], fraction: float) -> List[bool]:
    """Which of the groups (their parameter counts, in order) to offload: each, in order, while
    fewer than ``fraction`` of all their elements are offloaded ([Note: offload fraction])."""
    threshold = fraction * sum(numels)
    out, offloaded = [], 0
    for numel in numels:
        take = offloaded < threshold or fraction >= 1.0
        out.append(take)
        offloaded += numel if take else 0
    return out


def check_offload_matches(config: Any, model_chunks: Sequence[Any]) -> None:
    """Refuse an ``OptimizerConfig`` whose offload settings differ from those the chunks were
    sharded with: where the optimizer state lives is fixed when ``RaggedFSDP`` shards the model."""
    wanted = optimizer_offload(config)
    for i, chunk in enumerate(model_chunks):
        got = chunk.options.optimizer_offload
        if got == wanted:
            continue
        raise ValueError(
            f"the optimizer config asks for optimizer offload {wanted} (optimizer_cpu_offload="
            f"{bool(getattr(config, 'optimizer_cpu_offload', False))}, optimizer_offload_fraction="
            f"{getattr(config, 'optimizer_offload_fraction', None)}) but RaggedFSDP model chunk {i} was sharded "
            f"with {got}: under --use-vescale-fsdp the optimizer state lives where the sharded parameters do, "
            "chosen when the model is wrapped. Build RaggedFSDP with options=RaggedFSDPOptions(optimizer_offload="
            "optimizer_offload(optimizer_config)) (Megatron-LM's --optimizer-cpu-offload reaches it by itself), or "
            "give the optimizer the same settings")
