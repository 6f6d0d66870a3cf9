"""torch's own DTensor functions, given a RaggedShard placement.

[Note: torch's DTensor functions meet RaggedShard]
torch 2.13's DTensor knows ``Shard``, ``Replicate`` and ``Partial``; its functions have no
extension point for another placement and raise ("unsupported placements RaggedShard(...)",
"redistribute from ... not supported yet") or copy the wrong range. Users reach them with a
sharded parameter's own layout (``p.device_mesh``, ``p.placements``): FSDP2's recipes load
pretrained weights with ``distribute_tensor(full, p.device_mesh, p.placements)`` or torch's
``set_model_state_dict`` / ``set_optimizer_state_dict``, and round-trip pieces through
``DTensor.from_local(p.to_local(), ...)``. So these few functions are wrapped: given a
RaggedShard placement they build a :class:`~vescale_zero.ragged_tensor.RaggedDTensor`; given
anything else they are torch's own, called unchanged::

    torch function (name patched)               with a RaggedShard placement
    DTensor.from_local(piece, mesh, pl,         the piece itself as a RaggedDTensor (a view;
        shape=..., stride=...)                  its length and the contiguous stride checked)
    DTensor.redistribute(mesh, pl)              the whole tensor (one gather), this rank's range
        of a DTensor not ragged                 of it (a ragged one redistributes itself)
    distribute_tensor(full, mesh, pl,           rank ``src_data_rank``'s values (one broadcast;
        src_data_rank=0)                        ``None``: each rank's own), this rank's range
    _state_dict_utils._distribute_tensors       each ragged tensor's range of the full tensor
        (set_model_state_dict /                 broadcast from rank 0, copied into it (torch's
        set_optimizer_state_dict,               box slice cannot describe a flat range)
        broadcast_from_rank0=True)

A full state dict on every rank (``full_state_dict=True`` alone) reaches ``distribute_tensor``
through the name ``_state_dict_utils`` imported, so that name is routed too. Code that bound
``distribute_tensor`` before ``import vescale_zero`` (``from torch.distributed.tensor import
distribute_tensor`` above it) keeps torch's function, which refuses a ragged placement with
torch's error: call it as ``torch.distributed.tensor.distribute_tensor``, or import vescale_zero
first. The wrappers are installed once per process when vescale_zero is imported and declared
in ``integrations/host_patches.py`` ([Note: host patches]); this module is the one place that
knows these torch internals.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .ragged_tensor import RaggedDTensor, check_ragged_piece, ragged_from_full, ragged_placement_of, ragged_spec

__all__ = ["install_dtensor_interop", "PATCHED"]

PATCHED = (
    "torch.distributed.tensor.DTensor.from_local",
    "torch.distributed.tensor.DTensor.redistribute",
    "torch.distributed.tensor.distribute_tensor",
    "torch.distributed.tensor._api.distribute_tensor",
    "torch.distributed._state_dict_utils.distribute_tensor",
    "torch.distributed._state_dict_utils._distribute_tensors",
)
"""What :func:`install_dtensor_interop` replaces (each declared in HOST_PATCHES)."""

_ORIGINALS: Dict[str, Callable] = {}


def _mesh_of(device_mesh: Optional[DeviceMesh], what: str) -> DeviceMesh:
    if device_mesh is None:
        raise ValueError(f"{what} with a RaggedShard placement needs its device_mesh (the sharded parameter's "
                         "p.device_mesh)")
    return device_mesh


def _from_local(local_tensor: torch.Tensor, device_mesh: Optional[DeviceMesh] = None,
                placements: Optional[Sequence[Any]] = None, *, run_check: bool = False,
                shape: Optional[Sequence[int]] = None, stride: Optional[Sequence[int]] = None,
                grad_placements: Optional[Sequence[Any]] = None) -> DTensor:
    placement = ragged_placement_of(placements)
    if placement is None:
        return _ORIGINALS["from_local"](local_tensor, device_mesh, placements, run_check=run_check, shape=shape,
                                        stride=stride, grad_placements=grad_placements)
    mesh = _mesh_of(device_mesh, "DTensor.from_local")
    if shape is None:
        raise ValueError(f"DTensor.from_local with {placement} needs shape= (the global shape, p.shape): a ragged "
                         "piece does not tell it")
    spec = ragged_spec(mesh, placement, shape, local_tensor.dtype, placements)
    if stride is not None and tuple(stride) != tuple(spec.tensor_meta.stride):
        raise ValueError(f"DTensor.from_local with {placement}: stride {tuple(stride)} is not the contiguous stride "
                         f"{tuple(spec.tensor_meta.stride)} of shape {tuple(shape)} (a ragged tensor is laid out flat)")
    what = f"DTensor.from_local: a local tensor of {local_tensor.numel()} elements for shape {tuple(shape)}"
    check_ragged_piece(spec, local_tensor.numel(), what)
    return RaggedDTensor(local_tensor.reshape(-1), spec, requires_grad=local_tensor.requires_grad)


def _redistribute(self: DTensor, device_mesh: Optional[DeviceMesh] = None, placements: Optional[Sequence[Any]] = None,
                  *, async_op: bool = False, forward_dtype: Optional[torch.dtype] = None,
                  backward_dtype: Optional[torch.dtype] = None) -> DTensor:
    if ragged_placement_of(placements) is None:
        return _ORIGINALS["redistribute"](self, device_mesh, placements, async_op=async_op,
                                          forward_dtype=forward_dtype, backward_dtype=backward_dtype)
    mesh = device_mesh or self.device_mesh
    if mesh != self.device_mesh:
        raise NotImplementedError(f"redistribute to {tuple(placements)} on another mesh than the tensor's: "
                                  "redistribute on its own mesh")
    return ragged_from_full(self.full_tensor(), mesh, placements)


def _distribute_tensor(tensor: torch.Tensor, device_mesh: Optional[DeviceMesh] = None,
                       placements: Optional[Sequence[Any]] = None, *, src_data_rank: Optional[int] = 0) -> DTensor:
    if ragged_placement_of(placements) is None:
        return _ORIGINALS["distribute_tensor"](tensor, device_mesh, placements, src_data_rank=src_data_rank)
    mesh = _mesh_of(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        if tensor.device_mesh == mesh and tuple(tensor.placements) == tuple(placements):
            return tensor
        raise ValueError(f"Cannot distribute a DTensor with placements {tensor.placements} to {tuple(placements)}: "
                         "call redistribute instead")
    full = tensor.detach()
    if full.device.type != mesh.device_type and not full.is_meta:
        full = full.to(mesh.device_type)
    if src_data_rank is not None and not full.is_meta:
        # every rank gets rank src_data_rank's values, as torch's distribute_tensor scatters them
        full = full.contiguous().clone()
        for dim in range(mesh.ndim):
            dist.broadcast(full, group=mesh.get_group(dim), group_src=src_data_rank)
    out = ragged_from_full(full, mesh, placements)
    return out.requires_grad_(tensor.requires_grad) if tensor.requires_grad else out


def _distribute_tensors(local_state_dict: Dict[str, Any], keys: list, device: torch.device,
                        pg: Optional[dist.ProcessGroup] = None) -> None:
    """torch's broadcast load left ``(local state, full tensor)`` under each DTensor's key: a
    ragged one takes its range of the full tensor (copied into it, or a new tensor if it is on
    the meta device); the others go to torch's function."""
    rest = []
    for key in keys:
        entry = local_state_dict.get(key)
        if not (isinstance(entry, tuple) and isinstance(entry[0], RaggedDTensor)):
            rest.append(key)
            continue
        local, full = entry
        if local.is_meta:
            local_state_dict[key] = ragged_from_full(full, local.device_mesh, local.placements)
            continue
        with torch.no_grad():
            local.copy_(full)  # this rank's range (ragged_tensor._copy)
        local_state_dict[key] = local
    if rest:
        _ORIGINALS["_distribute_tensors"](local_state_dict, rest, device, pg)


def _wrapper(original: Callable, replacement: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    wrapped.__vz_dtensor_interop__ = True
    return wrapped


def install_dtensor_interop() -> None:
    """Route torch's DTensor functions for RaggedShard placements
    ([Note: torch's DTensor functions meet RaggedShard]); once per process."""
    if _ORIGINALS:
        return
    from torch.distributed import tensor as dtensor_module

    from .torch_compat import dtensor_api as _api
    from .torch_compat import state_dict_utils as _state_dict_utils

    _ORIGINALS["from_local"] = DTensor.from_local
    _ORIGINALS["redistribute"] = DTensor.redistribute
    _ORIGINALS["distribute_tensor"] = _api.distribute_tensor
    _ORIGINALS["_distribute_tensors"] = _state_dict_utils._distribute_tensors
    distribute = _wrapper(_api.distribute_tensor, _distribute_tensor)
    # host patch torch.distributed.tensor.DTensor.from_local: checked against torch 2.11.0-2.15.0
    DTensor.from_local = staticmethod(_wrapper(_ORIGINALS["from_local"], _from_local))
    # host patch torch.distributed.tensor.DTensor.redistribute: checked against torch 2.11.0-2.15.0
    DTensor.redistribute = _wrapper(_ORIGINALS["redistribute"], _redistribute)
    # host patch torch.distributed.tensor.distribute_tensor: checked against torch 2.11.0-2.15.0
    dtensor_module.distribute_tensor = distribute
    # host patch torch.distributed.tensor._api.distribute_tensor: checked against torch 2.11.0-2.15.0
    _api.distribute_tensor = distribute
    # host patch torch.distributed._state_dict_utils.distribute_tensor: checked against torch 2.11.0-2.15.0
    _state_dict_utils.distribute_tensor = distribute
    # host patch torch.distributed._state_dict_utils._distribute_tensors: checked against torch 2.11.0-2.15.0
    _state_dict_utils._distribute_tensors = _wrapper(_ORIGINALS["_distribute_tensors"], _distribute_tensors)
