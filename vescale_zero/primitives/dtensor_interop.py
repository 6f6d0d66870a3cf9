"""torch's own DTensor functions, given a RaggedShard placement.

[Note: torch's DTensor functions meet RaggedShard]
torch 2.13's DTensor knows ``Shard``, ``Replicate`` and ``Partial``; its functions have no
extension point for another placement and raise ("unsupported placements RaggedShard(...)",
"redistribute from ... not supported yet") or copy the wrong range. Users reach them with a
sharded parameter's own layout (``p.device_mesh``, ``p.placements``): FSDP2's recipes load
pretrained weights with ``distribute_tensor(full, p.device_mesh, p.placements)`` or torch's
``set_model_state_dict`` / ``set_optimizer_state_dict``, and round-trip pieces through
``DTensor.from_local(p.to_local(), ...)``. So these few functions are wrapped: given a
RaggedShard placement they build a :class:`~vescale_zero.primitives.ragged_tensor.RaggedDTensor`; given
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
first. The wrappers are made here (``routed_*``, each given torch's function) and installed once
per process when vescale_zero is imported, by ``vescale_zero/host_patches.py`` (``install("torch")``,
[Note: host patches]); this module is the one place that knows these torch internals.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .ragged_tensor import RaggedDTensor, check_ragged_piece, ragged_from_full, ragged_placement_of, ragged_spec

__all__ = ["routed_from_local", "routed_redistribute", "routed_distribute_tensor", "routed_distribute_tensors"]

_ORIGINALS: Dict[str, Callable] = {}
"""torch's functions, as the ``routed_*`` factories were given them (what a non-ragged call runs)."""


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
        given = {"run_check": run_check, "shape": shape, "stride": stride}
        if grad_placements is not None:  # torch 2.11's from_local has no grad_placements: pass it only if given
            given["grad_placements"] = grad_placements
        return _ORIGINALS["from_local"](local_tensor, device_mesh, placements, **given)
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

    return wrapped


# host patch torch.distributed.tensor.DTensor.from_local: checked against torch 2.11.0-2.15.0
def routed_from_local(original: Callable) -> staticmethod:
    """``DTensor.from_local``, routed for RaggedShard placements (a static method, as torch's)."""
    _ORIGINALS["from_local"] = original
    return staticmethod(_wrapper(original, _from_local))


# host patch torch.distributed.tensor.DTensor.redistribute: checked against torch 2.11.0-2.15.0
def routed_redistribute(original: Callable) -> Callable:
    """``DTensor.redistribute``, routed for RaggedShard placements."""
    _ORIGINALS["redistribute"] = original
    return _wrapper(original, _redistribute)


_DISTRIBUTE_WRAPPERS: Dict[int, Callable] = {}


# host patch torch.distributed.tensor.distribute_tensor: checked against torch 2.11.0-2.15.0
# host patch torch.distributed.tensor._api.distribute_tensor: checked against torch 2.11.0-2.15.0
# host patch torch.distributed._state_dict_utils.distribute_tensor: checked against torch 2.11.0-2.15.0
def routed_distribute_tensor(original: Callable) -> Callable:
    """``distribute_tensor``, routed for RaggedShard placements: one wrapper for the names that hold
    torch's one function (``torch.distributed.tensor``, ``_api``, ``_state_dict_utils``)."""
    _ORIGINALS["distribute_tensor"] = original
    if id(original) not in _DISTRIBUTE_WRAPPERS:
        _DISTRIBUTE_WRAPPERS[id(original)] = _wrapper(original, _distribute_tensor)
    return _DISTRIBUTE_WRAPPERS[id(original)]


# host patch torch.distributed._state_dict_utils._distribute_tensors: checked against torch 2.11.0-2.15.0
def routed_distribute_tensors(original: Callable) -> Callable:
    """``_state_dict_utils._distribute_tensors`` (``set_*_state_dict`` with ``broadcast_from_rank0``),
    routed for ragged tensors."""
    _ORIGINALS["_distribute_tensors"] = original
    return _wrapper(original, _distribute_tensors)
