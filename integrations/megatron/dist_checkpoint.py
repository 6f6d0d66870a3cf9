"""Megatron ``torch_dist`` saves of ``RaggedFSDP`` that write each rank's own shard, no gather.

[Note: streamed dist-checkpoint save] Megatron's ``ShardedTensor`` places a rank's piece of a
tensor by ``global_offset`` / ``local_shape``: a box. A ragged shard is a flat range of the
(TP-local) tensor, which is at most ``2 * ndim - 1`` boxes (vescale_zero.api.state_dict
``flat_range_boxes``), each a view of the rank's master shard. :func:`checkpoint_parameters`
lets Megatron's own ``sharded_state_dict`` build every key and its metadata as under its DDP,
on stand-ins (meta tensors of the full TP-local shape with the parameter's attributes:
``tensor_model_parallel``, ``partition_dim``, ...), then replaces each ``ShardedTensor`` on a
stand-in by this rank's boxes -- one ``ShardedTensor`` per box, same key and global shape,
its offsets, ``axis_fragmentations=None`` (an irregular grid, which Megatron leaves to
PyTorch's distributed checkpoint) -- so the save writes views of the shards::

    TP-local weight (4, 5), data-parallel rank 1 owns flat [7, 18):
        ShardedTensor(key, data=shard[0:3].view(1, 3), global_offset=tp_off + (1, 2))
        ShardedTensor(key, data=shard[3:8].view(1, 5), global_offset=tp_off + (2, 0))
        ShardedTensor(key, data=shard[8:11].view(1, 3), global_offset=tp_off + (3, 0))

Replica ids stay Megatron's (the tied output layer, tensor-parallel duplicates), except for
the data-parallel place (the last item): data-parallel pieces are disjoint now, so every rank
of an instance writes its own; under HSDP (``--num-distributed-optimizer-instances``) the
instances hold equal shards and the first one writes (the place is the instance's rank).
Each box carries ``(sharded parameter, its LocalPieces, the box)`` (:data:`LOCAL_PIECE`):
``RaggedOptimizer.sharded_state_dict`` writes Adam's state on the same boxes from the local
state shards. Loading any layout is Megatron's reshard into full tensors
(``RaggedFSDP.full_parameters``); boxes written by any rank read back fine.

Details: Megatron's prepended axes (stacked layers, experts) become leading box axes of size 1
(PyTorch's checkpoint takes an irregular chunk by its full-rank shape); a
``ShardedTensorFactory`` on a stand-in (a gated MLP's fc1 halves) is built here, as the save
would, and each of its tensors -- contiguous views of the stand-in -- gets the boxes of its
part; an entry with no box on this rank is dropped (other ranks write it); anything else
derived from a stand-in is refused, naming ``full_parameters`` as the way out.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from vescale_zero import local_piece
from vescale_zero.hosts import LocalPieces, copy_parameter_attributes, groups_of, put_parameters, replace_parameters

__all__ = ["checkpoint_parameters", "LOCAL_PIECE", "SHARD_ONLY_ATTRIBUTES", "STREAMING", "boxes_by_parameter",
           "state_boxes"]

LOCAL_PIECE = "vescale_local_piece"
"""Attribute of a box ``ShardedTensor`` made here: ``(sharded parameter, LocalPieces, box)``."""


STREAMING = "_vescale_streaming_save"
"""Set on a ``RaggedFSDP`` chunk while :func:`checkpoint_parameters` is on."""

SHARD_ONLY_ATTRIBUTES = ("sharded_range", "main_grad", "grad_added_to_main_grad")
"""A sharded parameter's attributes that a full (or stand-in) tensor in its place does not take."""


def _standin(param: nn.Parameter, pieces: LocalPieces, dtype: torch.dtype) -> nn.Parameter:
    """A meta parameter of the full (TP-local) shape with ``param``'s attributes."""
    plain = nn.Parameter(torch.empty(pieces.shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)
    return copy_parameter_attributes(param, plain, skip=SHARD_ONLY_ATTRIBUTES)


def _instance(group: Any) -> int:
    """This rank's instance under HSDP (its rank in the replicate group), else 0."""
    replicate = getattr(group, "replicate_group", None)
    return dist.get_rank(replicate) if replicate is not None else 0


def _data_parallel_place(replica_id: Any, instance: int) -> Any:
    """Megatron's replica id with its data-parallel item (the last) set to ``instance``."""
    if isinstance(replica_id, tuple):
        return replica_id[:-1] + (instance,) if replica_id else replica_id
    return instance


@contextmanager
def checkpoint_parameters(chunk: Any) -> Iterator[None]:
    """For the duration, ``chunk.module`` holds meta stand-ins of its sharded parameters and
    the ``sharded_state_dict`` of every module from ``chunk.module`` down to the model gives
    this rank's boxes (see [Note: streamed dist-checkpoint save]). No communication; nothing
    full is allocated. Saving only: a load needs real tensors (``chunk.full_parameters``).
    Nested: the outer one stands."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if getattr(chunk, STREAMING, False):
        yield
        return
    standins: Dict[int, Tuple[nn.Parameter, nn.Parameter, LocalPieces, int]] = {}
    made: Dict[int, nn.Parameter] = {}
    for group in groups_of(chunk.module):
        for i, sp in enumerate(group.sharded_params):
            pieces = LocalPieces.of(group, i)
            plain = _standin(sp, pieces, group.master.local.dtype)
            made[id(sp)] = plain
            standins[id(plain)] = (plain, sp, pieces, _instance(group))
    swapped = replace_parameters(chunk.module, lambda param: made.get(id(param)))

    def owner(data: Any):
        """``(standin entry, flat offset)`` if ``data`` is a stand-in or a contiguous view of one."""
        if not isinstance(data, torch.Tensor):
            return None, 0
        base = data if id(data) in standins else data._base
        entry = standins.get(id(base)) if base is not None else None
        if entry is None or entry[0] is not base:
            return None, 0
        if not data.is_contiguous():
            raise ValueError(f"a sharded state dict entry is a non-contiguous view of a parameter "
                             f"{tuple(base.shape)}; RaggedFSDP's streamed save cannot describe it as boxes")
        return entry, data.storage_offset()

    def boxes(sh: ShardedTensor) -> Any:
        entry, offset = owner(sh.data)
        if entry is None:
            return sh
        _, sp, pieces, instance = entry
        local = local_piece(sp).detach().reshape(-1)
        pre = sh.prepend_axis_num
        out = []
        for box in pieces.boxes_within(offset, sh.local_shape):
            offsets, sizes, _ = box
            # Prepended axes (Megatron's stacked layers, experts) become leading axes of size 1:
            # PyTorch's checkpoint takes an irregular chunk by its full-rank shape.
            data = LocalPieces.take(local, box).view((1,) * pre + tuple(sizes))
            st = replace(sh, data=data, dtype=data.dtype, local_shape=tuple(data.shape), axis_fragmentations=None,
                         global_offset=sh.global_offset[:pre] + tuple(
                             g + o for g, o in zip(sh.global_offset[pre:], offsets)),
                         prepend_axis_num=0, replica_id=_data_parallel_place(sh.replica_id, instance))
            setattr(st, LOCAL_PIECE, (sp, pieces, box))
            out.append(st)
        return out

    def rewrite(value: Any) -> Any:
        """``value`` with every ShardedTensor on a stand-in replaced by this rank's boxes: one
        box stays a ShardedTensor, several become a list, none drop the entry (another rank
        writes that tensor; an empty entry would differ between the ranks' common states)."""
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                item = rewrite(item)
                if not (isinstance(item, list) and not item) or not _mapped(value[key]):
                    out[key] = item
            value.clear()
            value.update(out)
            return value
        if isinstance(value, list):
            items = []
            for item in value:
                got = rewrite(item)
                items.extend(got if isinstance(got, list) and _mapped(item) else [got])
            value[:] = items
            return value
        if isinstance(value, ShardedTensorFactory) and owner(value.data)[0] is not None:
            built = rewrite(value.build())  # what Megatron's save would build
            return built if built else []
        if isinstance(value, ShardedTensor) and owner(value.data)[0] is not None:
            got = boxes(value)
            return got[0] if len(got) == 1 else got
        return value

    def _mapped(value: Any) -> bool:
        return isinstance(value, (ShardedTensor, ShardedTensorFactory)) and owner(value.data)[0] is not None

    targets, overridden = [], []
    module = chunk.module
    while isinstance(module, nn.Module):
        targets.append(module)
        inner = getattr(module, "module", None)
        if hasattr(module, "pre_process") or not isinstance(inner, nn.Module):
            break
        module = inner
    for target in targets:
        if hasattr(target, "sharded_state_dict"):
            original = target.sharded_state_dict

            def streamed(*args: Any, _original=original, **kwargs: Any) -> Any:
                out = rewrite(_original(*args, **kwargs))
                dict_list_map_inplace(_refuse_meta, out)
                return out

            # host patch megatron.core.transformer.module.MegatronModule.sharded_state_dict: checked against megatron-core 0.15.3-0.19.2  # noqa: E501
            target.sharded_state_dict = streamed  # an instance attribute: Megatron-LM calls the unwrapped model's
            overridden.append(target)
    setattr(chunk, STREAMING, True)
    try:
        yield
    finally:
        setattr(chunk, STREAMING, False)
        for target in overridden:
            del target.sharded_state_dict
        put_parameters(swapped)


def _refuse_meta(value: Any) -> Any:
    data = getattr(value, "data", None)
    if isinstance(data, torch.Tensor) and data.device.type == "meta":
        raise ValueError(f"{getattr(value, 'key', value)!r}: Megatron's sharded_state_dict gave a tensor derived from "
                         "a RaggedFSDP stand-in that the streamed save cannot map to the shards; save inside "
                         "RaggedFSDP.full_parameters() instead (gathers the parameters)")
    return value


def boxes_by_parameter(model_sharded_state_dict: Any) -> Dict[int, List[Any]]:
    """id(sharded parameter) -> the box ``ShardedTensor``s :func:`checkpoint_parameters` made
    of it, found in a (nested) model sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    out: Dict[int, List[Any]] = {}
    for sh in nested_values(model_sharded_state_dict):
        piece = getattr(sh, LOCAL_PIECE, None)
        if piece is not None:
            mine = out.setdefault(id(piece[0]), [])
            if not mine or mine[0].key == sh.key:  # a parameter tied under two keys: the first one's
                mine.append(sh)
    return out


def state_boxes(boxes: List[Any], state: torch.Tensor, key: str) -> List[Any]:
    """The boxes of a model tensor, re-keyed ``key``, over ``state`` (a tensor shaped like the
    parameter's shard: an optimizer state or the fp32 master) instead of the parameter."""
    out = []
    for sh in boxes:
        data = LocalPieces.take(local_piece(state).detach(), getattr(sh, LOCAL_PIECE)[2]).view(sh.local_shape)
        st = replace(sh, key=key, data=data, dtype=data.dtype)
        setattr(st, LOCAL_PIECE, getattr(sh, LOCAL_PIECE))
        out.append(st)
    return out
