"""``offload_optimizer`` / ``offload_param`` under ``"stage": "ragged"``.

[Note: offload under ragged]
ZeRO-3 keeps several sharded copies of a parameter: a 16-bit partition (what ``offload_param``
moves to the host), and the fp32 master partition, its gradient and the optimizer state (what
``offload_optimizer`` moves, after which DeepSpeed steps with its CPU optimizer). Ragged
sharding keeps one: each group's fp32 master shard, which the optimizer holds, with its
gradient shard and the optimizer state beside it; the 16-bit compute copy only exists
gathered, on the device, while its group computes. So under ragged:

    offload_optimizer  device cpu        every group's master shard, gradient shard and optimizer
                                         state in host memory (fully_shard's offload_policy=
                                         torch's CPUOffloadPolicy(pin_memory)): gathers copy the
                                         shard to the device, reduce-scatters' results come back
                                         to the host, the optimizer steps there. The optimizer is
                                         DeepSpeed's choice at ZeRO-3 with offload (a config Adam /
                                         AdamW is DeepSpeedCPUAdam, Adagrad / Lion their CPU
                                         kernels; a client optimizer other than those is refused
                                         unless "zero_force_ds_cpu_optimizer": false)
    offload_param      device cpu        beside offload_optimizer cpu: the same shards (the
                                         parameters' shards are the masters), meaning the same
    offload_param      device cpu,       ZeRO-Infinity's parameter offload: every group's master
    alone                                shard and gradient shard in host memory (the same
                                         CPUOffloadPolicy), gathered to the device for forward and
                                         backward, and the optimizer where the config puts it: on
                                         the device, the one DeepSpeed picks without offload
                                         (FusedAdam for Adam), its state there; each step copies
                                         the masters and gradients in and the masters back
                                         ([Note: the optimizer steps on the device])
    offload_optimizer  device nvme       the optimizer state in files (config.nvme_offload_of,
                                         nvme_offload.py); the master shards stay on the device,
                                         so offload_param beside it is refused, and so is
    offload_param      device nvme       (a file-backed master shard is not implemented)
    legacy cpu_offload / cpu_offload_param: true     as DeepSpeed reads them (offload_* cpu)

Sub-keys that only serve NVMe swapping or Superchips (``buffer_count``, ``fast_init``,
``pipeline_read`` / ``pipeline_write``, ``nvme_path``, ``buffer_size``, ``max_in_cpu``,
``super_offload``, ``cpuadam_cores_perc``) are warned once each and ignored with ``cpu``, as
ZeRO-3 ignores them there; ``ratio`` below 1 (part of the optimizer on the device) and
contradictions (``nvme`` without ``nvme_path``, the two keys on different devices or with
different ``pin_memory``) are refused, naming the fix.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Literal, Optional

import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from pydantic import BaseModel, ConfigDict
from torch.distributed.fsdp import CPUOffloadPolicy

from vescale_zero import local_piece
from vescale_zero.hosts import is_ragged, like_param, slot_of

__all__ = ["OFFLOAD_KEYS", "OffloadOptions", "read_offload", "warn_ignored", "offload_policy", "stage0_offload_keys",
           "OptimizerOnDevice"]

OFFLOAD_KEYS = ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory")
"""The ragged section's keys read here (the last three: DeepSpeed's deprecated spellings)."""

_NOT_FOR_CPU = {  # sub-keys with no effect when the device is cpu (at stage 3 as well)
    "offload_optimizer": ("buffer_count", "fast_init", "pipeline_read", "pipeline_write", "nvme_path",
                          "super_offload", "cpuadam_cores_perc"),
    "offload_param": ("buffer_count", "buffer_size", "max_in_cpu", "nvme_path"),
}


class OffloadOptions(BaseModel):
    """Where the master shards, gradient shards and optimizer state live (see [Note: offload under ragged])."""

    model_config = ConfigDict(frozen=True)

    device: Literal["cpu"]
    pin_memory: bool = True
    optimizer: bool = True
    """The optimizer (its state, its step) in host memory too; False: ``offload_param`` alone."""


def _device(section: Any) -> str:
    return "none" if section is None else OffloadDeviceEnum(section.device).value


def read_offload(zero3: DeepSpeedZeroConfig) -> tuple[Optional[OffloadOptions], List[str]]:
    """``(CPU offload or None, sub-keys ignored)`` from the ragged section as DeepSpeed parsed it at
    stage 3 (deprecated spellings already turned into ``offload_*``); refuses what ragged cannot honour
    (a partial offload on either device). ``offload_optimizer`` to ``nvme`` is ``config.nvme_offload_of``'s
    (``None`` here)."""
    opt, param = zero3.offload_optimizer, zero3.offload_param
    opt_device, param_device = _device(opt), _device(param)
    if param_device == "nvme" or (opt_device == "nvme" and param_device != "none"):
        raise ValueError(
            f"zero_optimization.offload_param (device {param_device!r}) with offload_optimizer (device {opt_device!r}) "
            "is not implemented with stage 'ragged': a parameter's only persistent shard is the optimizer's fp32 "
            "master, which stays on the device when the optimizer state goes to NVMe and has no NVMe form; remove "
            "offload_param (keeping offload_optimizer 'nvme': state in files), or set both devices to 'cpu'")
    if opt_device != "none" and opt.ratio < 1.0:
        raise ValueError(
            f"zero_optimization.offload_optimizer.ratio {opt.ratio} is not implemented with stage 'ragged' (it keeps "
            "part of the optimizer on the device), which offloads every group's optimizer state; remove ratio (or "
            "set 1.0), or use stage 3 for partial offload")
    if opt_device == "nvme":
        return None, []
    if param_device == "cpu" and opt_device == "none":
        ignored = [f"offload_param.{sub}" for sub in _NOT_FOR_CPU["offload_param"] if sub in param.model_fields_set]
        return OffloadOptions(device="cpu", pin_memory=param.pin_memory, optimizer=False), ignored
    if opt_device == "none":
        return None, []
    if param_device == "cpu" and param.pin_memory != opt.pin_memory:
        raise ValueError(
            f"zero_optimization: offload_optimizer.pin_memory {opt.pin_memory} and offload_param.pin_memory "
            f"{param.pin_memory} disagree; under stage 'ragged' both keys place the same shards (the fp32 masters): "
            "give both the same pin_memory")
    ignored = [f"{key}.{sub}" for key, section in (("offload_optimizer", opt), ("offload_param", param))
               if section is not None for sub in _NOT_FOR_CPU[key] if sub in section.model_fields_set]
    return OffloadOptions(device="cpu", pin_memory=opt.pin_memory), ignored


def warn_ignored(ignored: List[str]) -> None:
    for key in ignored:
        warnings.warn(f"zero_optimization.{key} has no effect with device 'cpu' under stage 'ragged' (NVMe swapping "
                      "or Superchip offload only); ignored", UserWarning, stacklevel=4)


def offload_policy(offload: Optional[OffloadOptions]) -> Optional[CPUOffloadPolicy]:
    """What ``fully_shard(offload_policy=...)`` gets for the config's offload (``None``: none)."""
    if offload is None:
        return None
    return CPUOffloadPolicy(pin_memory=offload.pin_memory)


def stage0_offload_keys(offload: Optional[OffloadOptions]) -> Dict[str, Any]:
    """The keys DeepSpeed's stage-0 engine sees, so that it picks its optimizer as ZeRO-3 does with
    offload (``zero_use_cpu_optimizer``: DeepSpeedCPUAdam for a config Adam / AdamW, the client
    optimizer check of ``zero_force_ds_cpu_optimizer``); DeepSpeed does nothing else with them at stage 0."""
    return {} if offload is None or not offload.optimizer else {"offload_optimizer": {"device": offload.device}}


class OptimizerOnDevice:
    """[Note: the optimizer steps on the device]
    ``offload_param`` alone keeps every group's master shard and gradient shard in host memory
    (the CPUOffloadPolicy of ``offload_optimizer``) and the optimizer on the device, as ZeRO-3
    keeps its optimizer there with that key. The optimizer holds the sharded parameters, whose
    pieces are in host memory, so around each ``optimizer.step()`` (its own step pre- and
    post-hooks, whoever calls it):

    * before: each offloaded parameter is replaced, in its param group, by a twin of the same
      layout whose piece is a device copy of the master's, holding a device copy of the
      gradient; the parameter's optimizer state moves to the twin (its per-element tensors to
      the device, where they stay: a state loaded from a checkpoint arrives in host memory);
    * the optimizer steps the twins on the device, creating its state there on the first step;
    * after: each twin's piece is copied back into the master shard, and the parameter takes its
      place and its state again.

    Between steps the device holds only the optimizer state: masters and gradients are in host
    memory, and a step holds a device copy of both (the memory ZeRO-3 holds on the device
    throughout with this key: its fp32 partitions and their gradients)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._swapped: List[tuple] = []
        optimizer.register_step_pre_hook(self._to_device)
        optimizer.register_step_post_hook(self._back)

    @staticmethod
    def _on(value: Any, param: torch.Tensor, device: torch.device) -> Any:
        """A per-element state tensor of ``param`` on ``device``; anything else (``step``) as it is."""
        if not torch.is_tensor(value) or value.device == device:
            return value
        piece = local_piece(param)
        if is_ragged(value) and value.shape == param.shape:
            return like_param(local_piece(value).to(device), param)
        if not is_ragged(value) and value.dim() == 1 and value.numel() == piece.numel():
            return value.to(device)
        return value

    def _to_device(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for group in optimizer.param_groups:
            params = group["params"]
            for j, param in enumerate(params):
                slot = slot_of(param) if is_ragged(param) else None
                if slot is None or slot[0].offload is None:
                    continue
                device = slot[0].device
                twin = like_param(local_piece(param).to(device), param)
                if param.grad is not None:
                    twin.grad = like_param(local_piece(param.grad).to(device), param)
                if param in optimizer.state:
                    state = optimizer.state.pop(param)
                    optimizer.state[twin] = {k: self._on(v, param, device) for k, v in state.items()}
                params[j] = twin
                self._swapped.append((params, j, param, twin))

    def _back(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        swapped, self._swapped = self._swapped, []
        with torch.no_grad():
            for params, j, param, twin in swapped:
                local_piece(param).copy_(local_piece(twin))
                params[j] = param
                if twin in optimizer.state:
                    optimizer.state[param] = optimizer.state.pop(twin)
