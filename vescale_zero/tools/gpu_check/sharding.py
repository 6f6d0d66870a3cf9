"""One model sharded by vescale-zero or by PyTorch FSDP2 the way each is set up for a model
too big for one device: built on meta, sharded unit by unit (innermost first) and then the
root, allocated on ``device`` and initialised module by module.

Shared by ``benchmarks/memory.py`` and the GPU check's memory section, so both measure the
same set-ups. Works on a real process group and on PyTorch's fake one
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, so a single
process stands for one rank of any world size; see :func:`fake_world`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...torch_compat import init_fake_process_group

__all__ = ["SHARDED_SYSTEMS", "init_module", "shard_on_meta", "fake_world"]

SHARDED_SYSTEMS = ("vescale", "fsdp2")


def init_module(m: nn.Module) -> None:
    """Module-by-module initialisation (values do not matter for memory)."""
    from ...testing.gpt import GPT

    if isinstance(m, GPT):
        nn.init.zeros_(m.pos)
    elif callable(getattr(m, "reset_parameters", None)):
        m.reset_parameters()


def shard_on_meta(system: str, model_fn: Callable[[], nn.Module], units_of: Callable[[nn.Module], List[nn.Module]],
                  device: torch.device, param_dtype: Optional[torch.dtype] = None, offload: bool = False) -> nn.Module:
    """``model_fn()`` built on meta and sharded over the default process group by ``system``
    (``"vescale"``: ``fully_shard_layers`` over the classes of ``units_of(model)``, then
    ``materialize``; ``"fsdp2"``: FSDP2 ``fully_shard`` on each unit then the root, ``to_empty``,
    then :func:`init_module`). ``param_dtype``: mixed precision, parameters and compute in it,
    fp32 reduce and master. ``offload``: each system's ``CPUOffloadPolicy`` (unpinned)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if system not in SHARDED_SYSTEMS:
        raise ValueError(f"system {system!r}: one of {SHARDED_SYSTEMS}")
    device = torch.device(device)
    with torch.device("meta"):
        model = model_fn()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    # pin_memory=False: FSDP2 pins for an accelerator, which a CPU-only process has not
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else None
    units = units_of(model)
    if system == "vescale":
        import vescale_zero as vz

        vz.fully_shard_layers(model, layer_classes=sorted({type(u).__name__ for u in units}), mp_policy=policy,
                              offload_policy=offload_policy)
        vz.materialize(model, init_fn=init_module, device=device)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if policy is not None:
        kw["mp_policy"] = policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    for unit in units:  # innermost first: units_of lists inner modules before the ones holding them
        fully_shard(unit, **kw)
    fully_shard(model, **kw)
    model.to_empty(device=device)
    with torch.no_grad():
        for m in model.modules():
            init_module(m)
    return model


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """The default process group, for the block, is PyTorch's fake one: this process is
    ``rank`` of ``world`` ranks whose collectives return at once (tensors are real)."""
    init_fake_process_group(rank, world)
    try:
        yield
    finally:
        dist.destroy_process_group()
