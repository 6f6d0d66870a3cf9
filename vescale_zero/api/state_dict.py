"""Full (unsharded) state dicts of a ``fully_shard``-ed module, for interchange.

A full state dict has the keys and shapes of the unsharded module's ``state_dict()``,
so it is interchangeable with checkpoints of DDP, Megatron's DDP or an unsharded model::

    rank k:   master.local = [ piece of a | piece of b ]      (a sharded group)
    gather:   [ a (full) | b (full) | pad ]  one all-gather of the master shards
    keys:     {"layer.a": a.view(shape_a), "layer.b": b.view(shape_b), ...}

``load_full_state_dict`` goes the other way without communication: each rank copies
the flat range it owns of every tensor into its master shard. With
``broadcast_from_rank0`` only rank 0 holds the dict, and each group's full buffer is
broadcast in turn (see [Note: broadcast load]).

``full_optimizer_state`` / ``load_full_optimizer_state`` do the same for element-wise
optimizer state (Adam's moments, SGD's momentum: one value per parameter element), keyed
by the parameter's state-dict key -- the "model space" layout of Megatron's checkpoints
and of ``torch.optim`` on an unsharded model::

    rank k:   state[p_k]["exp_avg"]  = piece of exp_avg(p)   (shaped like p_k, the shard)
    gather:   the group's pieces laid out as the master shard, one all-gather per key
    result:   {"layer.p": {"exp_avg": full exp_avg(p), ...}, ...}

``flat_range_boxes`` / :class:`LocalPieces` describe a rank's flat range of a tensor as a
few rectangular boxes, for checkpoint formats that know only boxes (Megatron's
``ShardedTensor``): a streamed save writes each rank's own pieces, no gather::

    shape (4, 5), flat range [7, 18):   . . . . .
                                        . . # # #   box ((1, 2), (1, 3))
                                        # # # # #   box ((2, 0), (1, 5))
                                        # # # . .   box ((3, 0), (1, 3))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.comm_device import current_device
from ..primitives.placement import Box, flat_range_boxes
from ..primitives.ragged_tensor import like_param, local_piece
from ..primitives.tensor_parallel import USE_DCP, refuse_tensor_parallel, tp_local_of_whole, whole_from_tp_local
from ..runtime.param_group import GroupState, ParamGroup
from .full_parameters import gather_group_full
from .fully_shard import BUFFER_NEEDS_INIT, groups_of

__all__ = ["full_state_dict", "load_full_state_dict", "full_optimizer_state", "load_full_optimizer_state",
           "restored_step", "sharded_params_by_key", "ELEMENT_WISE_STATE", "flat_range_boxes", "Box", "LocalPieces"]

ELEMENT_WISE_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
"""Optimizer state keys holding one value per parameter element (torch's Adam/AdamW/SGD)."""


def _managed_index(module: nn.Module) -> Dict[int, Tuple[ParamGroup, int]]:
    """id(parameter object) -> (group, index) for sharded and unsharded parameters."""
    index: Dict[int, Tuple[ParamGroup, int]] = {}
    for group in groups_of(module):
        for i in range(len(group.managed)):
            index[id(group.sharded_params[i])] = (group, i)
            index[id(group.unsharded_params[i])] = (group, i)
    return index


def _full_views(group: ParamGroup, local: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """One all-gather of ``local`` (laid out as the group's shard) into a new flat buffer (or
    into the front of ``scratch``); each managed tensor whole, as a view into it. Collective."""
    return gather_group_full(group, local, scratch).views


def _gather_pieces(group: ParamGroup, pieces: List[Optional[torch.Tensor]], dtype: torch.dtype) -> List[torch.Tensor]:
    """:func:`_full_views` of this rank's ``pieces`` (one per tensor, shaped like its shard;
    ``None`` reads as zeros), laid out as the master shard first."""
    local = torch.zeros(group.plan.shard_size, dtype=dtype, device=group.device)
    for (start, end, shard_off), piece in zip(group.plan.local_slices(group.rank), pieces):
        if piece is not None and end > start:
            local.narrow(0, shard_off, end - start).copy_(local_piece(piece).reshape(-1))
    return _full_views(group, local)


def _gather_group(group: ParamGroup, keep: bool, cpu_offload: bool, compute_dtype: bool,
                  scratch: Optional[torch.Tensor] = None) -> Dict[int, torch.Tensor]:
    """id(sharded parameter) -> its full tensor, for one group (``{}`` unless ``keep``). Collective.

    [Note: one group at a time] With ``cpu_offload`` (or without ``keep``) nothing of a
    group's full buffer outlives its call, so every group gathers into one ``scratch`` buffer
    of the largest group's size: the device holds one group's full buffer whatever the
    collective backend does with the previous one (a gloo worker thread may drop its last
    reference to a finished collective's output a moment after ``wait()`` returns, so a
    fresh buffer per group can coexist with the last).
    """
    dtype = group.param_dtype if compute_dtype else group.master.local.dtype
    out: Dict[int, torch.Tensor] = {}
    for m, param, full in zip(group.managed, group.sharded_params, _full_views(group, group.master.local, scratch)):
        if m.tp is not None:  # the TP-local tensor: gathered over tp too, by every rank (a collective)
            full = whole_from_tp_local(full, param._spec)
        if keep:
            # with cpu_offload each tensor gets its own storage (serialisers refuse views of one buffer)
            out[id(param)] = full.to(device="cpu", dtype=dtype, copy=True) if cpu_offload else full.to(dtype)
    return out


def sharded_params_by_key(module: nn.Module) -> Dict[str, nn.Parameter]:
    """State-dict key -> sharded parameter, for every managed parameter under ``module``
    (a tied parameter under its first name only)."""
    index = _managed_index(module)
    out: Dict[str, nn.Parameter] = {}
    seen = set()
    for key, value in module.state_dict(keep_vars=True).items():
        hit = index.get(id(value))
        if hit is not None:
            param = hit[0].sharded_params[hit[1]]
            if id(param) not in seen:
                seen.add(id(param))
                out[key] = param
    return out


def full_state_dict(
    module: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False, compute_dtype: bool = False,
    keep: Optional[bool] = None,
) -> Dict[str, torch.Tensor]:
    """The module's ``state_dict()`` with every sharded parameter gathered to its full shape.

    Collective: every rank of every group under ``module`` must call it. Each group costs
    one all-gather of its master shards; by default the full tensors of a group share one
    buffer and every rank gets the whole dict.

    Args:
        rank0_only: only global rank 0 keeps the result (the others take part in the
            gathers, keep nothing and get ``{}``): with ``cpu_offload`` the device holds one
            group's full buffer at a time, as ZeRO-3's consolidated save does.
        cpu_offload: every tensor of the result on the CPU, each gathered one its own copy made
            group by group (by default a group's full tensors are views into one buffer).
        compute_dtype: each gathered parameter in its group's compute dtype
            (``mp_policy.param_dtype``: what a 16-bit save holds) instead of its master dtype.
        keep: whether this rank keeps the result, in place of ``rank0_only``'s rule (for
            hosts whose saving ranks are not global rank 0 alone: Megatron's torch format
            saves on data-parallel rank 0 of every model-parallel rank).
    """
    if keep is None:
        keep = not rank0_only or dist.get_rank() == 0
    state = module.state_dict(keep_vars=True)
    index = _managed_index(module)
    gathered: Dict[int, torch.Tensor] = {}
    groups = groups_of(module)
    scratch: Dict[tuple, torch.Tensor] = {}
    if cpu_offload or not keep:  # nothing of a group's buffer is kept: [Note: one group at a time]
        sizes: Dict[tuple, int] = {}
        for group in groups:
            key = (group.master.local.dtype, group.device)
            sizes[key] = max(sizes.get(key, 0), group.plan.global_size)
        scratch = {key: torch.empty(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}
    for group in groups:
        gathered.update(_gather_group(group, keep, cpu_offload, compute_dtype,
                                      scratch.get((group.master.local.dtype, group.device))))
    scratch.clear()
    if not keep:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        hit = index.get(id(value))
        if hit is not None:
            group, i = hit
            out[key] = gathered[id(group.sharded_params[i])]
        elif torch.is_tensor(value):
            out[key] = value.detach().cpu() if cpu_offload else value.detach()
        else:
            out[key] = value
    return out


def _load_problem(state_dict: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
                  index: Dict[int, Tuple[ParamGroup, int]], strict: bool) -> Optional[Exception]:
    """The error loading ``state_dict`` into a module whose ``state_dict(keep_vars=True)`` is
    ``current`` must raise (missing / unexpected keys under ``strict``, a wrong shape), else ``None``."""
    # A missing ``_extra_state`` is the module's business: its load hooks fill a default
    # (Megatron's linear layers do; its GPTModel drops the tied output layer's).
    missing = sorted(k for k in set(current) - set(state_dict) if not k.endswith("_extra_state"))
    unexpected = sorted(set(state_dict) - set(current))
    if strict and (missing or unexpected):
        return KeyError(
            f"state dict does not match the model: missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}; pass strict=False to load the "
            "common keys only, or check that the checkpoint was saved from the same model"
        )
    for key, value in state_dict.items():
        hit = index.get(id(current[key])) if key in current else None
        shape = None if hit is None else tuple(hit[0].sharded_params[hit[1]].shape)  # global
        if hit is not None and tuple(value.shape) != shape:
            return ValueError(
                f"{key!r}: the state dict holds shape {tuple(value.shape)}, the model {shape}; a full state dict "
                "must come from the same model (same tensor/pipeline-parallel layout)"
            )
    return None


def _split(
    state_dict: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
    index: Dict[int, Tuple[ParamGroup, int]],
) -> Tuple[Dict[Tuple[ParamGroup, int], torch.Tensor], Dict[str, Any]]:
    """``({(group, index): full tensor}, {key: value})``: the sharded parameters ``state_dict``
    holds (a tied one once) and the rest of its entries the module knows (buffers, ...)."""
    sharded: Dict[Tuple[ParamGroup, int], torch.Tensor] = {}
    rest: Dict[str, Any] = {}
    for key, value in state_dict.items():
        if key not in current:
            continue
        hit = index.get(id(current[key]))
        if hit is None:
            rest[key] = value
        else:
            sharded.setdefault(hit, value)
    return sharded, rest


def load_full_state_dict(
    module: nn.Module, state_dict: Optional[Mapping[str, torch.Tensor]], strict: bool = True, *,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load a full state dict (see :func:`full_state_dict`) into a sharded module.

    By default every rank needs the whole ``state_dict`` (it reads only its own ranges); no
    communication. With ``broadcast_from_rank0`` (FSDP2's ``StateDictOptions`` name) only
    global rank 0 needs it -- the others pass ``None`` or ``{}`` -- and it is broadcast one
    group's full buffer at a time (see [Note: broadcast load]); collective, and every group
    under ``module`` must be sharded over all ranks. With ``strict``, missing or unexpected
    keys raise ``KeyError`` naming them; a tensor of the wrong shape always raises
    ``ValueError`` (with ``broadcast_from_rank0``, on every rank).
    """
    for group in groups_of(module):
        if group.device.type == "meta":
            raise RuntimeError(
                "load_full_state_dict: the model's shards are still on the meta device; allocate them first with "
                "model.to_empty(device=...) (FSDP2's recipe), then load"
            )
        if group.state is not GroupState.SHARDED:
            group.reshard()  # full parameters gathered before the load must not outlive it
    current = module.state_dict(keep_vars=True)
    index = _managed_index(module)
    if broadcast_from_rank0:
        loaded, rest = _broadcast_from_rank0(module, state_dict or {}, current, index, strict)
    else:
        if state_dict is None:
            raise ValueError("load_full_state_dict: state_dict is None; pass the full state dict on every rank, or "
                             "broadcast_from_rank0=True to pass it on rank 0 only")
        problem = _load_problem(state_dict, current, index, strict)
        if problem is not None:
            raise problem
        sharded, rest = _split(state_dict, current, index)
        with torch.no_grad():
            for (group, i), value in sharded.items():
                if group.managed[i].tp is not None:  # this rank's TP-local part of the whole tensor
                    value = tp_local_of_whole(value, group.sharded_params[i]._spec)
                group.master.copy_local_from_full(i, value)
        loaded = set(sharded)
    # materialize [Note: deferred initialisation]: what is loaded is initialised
    for group in {g for g, _ in loaded}:
        if all((group, i) in loaded for i in range(len(group.managed))):
            group.needs_init = False
    if rest:
        module.load_state_dict(rest, strict=False)
        for key in rest:
            if torch.is_tensor(current[key]) and hasattr(current[key], BUFFER_NEEDS_INIT):
                delattr(current[key], BUFFER_NEEDS_INIT)


def _broadcast_from_rank0(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor],
    index: Dict[int, Tuple[ParamGroup, int]], strict: bool,
) -> Tuple[Set[Tuple[ParamGroup, int]], Dict[str, Any]]:
    """Rank 0's ``state_dict`` loaded into every rank's shards, one group at a time;
    returns ``(loaded, rest)``: the ``(group, index)`` of every tensor filled here, and the
    entries left to load locally (buffers, extra state).

    [Note: broadcast load] Rank 0 first broadcasts a header -- the error to raise (so every
    rank raises it, none hangs in the next broadcast), which tensors it holds and the small
    rest (buffers, extra state) -- then, per group, the group's full buffer (master dtype,
    the group's device) filled by rank 0; each rank copies its own ranges out of it before
    the next group's buffer exists::

        rank 0:  state_dict (any device) -> [ a | b | pad ] --broadcast--> every rank
        rank k:  master.local[a's range] <- buffer[a's range], ...; buffer freed
    """
    groups = groups_of(module)
    world = dist.get_world_size()
    narrow = [g for g in groups if dist.get_world_size(g.process_group) != world]
    if narrow:
        # one broadcast of a group's buffer fills every rank's copy of it alike: a group narrower than the
        # world may be another module on other ranks (a pipeline stage, an expert), or, beside tensor
        # parallelism, hold another TP-local piece of each tensor on each tp rank
        tp = any(m.tp is not None for g in groups for m in g.managed)
        why, torchs = ("tensor parallelism", ", or load it from rank 0 with torch's set_model_state_dict(model, "
                       "state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))") if tp \
            else ("model or expert parallelism, or a sub-mesh", "")
        raise ValueError(
            f"load_full_state_dict(broadcast_from_rank0=True) needs every group sharded over all {world} ranks; "
            f"{len(narrow)} group(s) are sharded over {dist.get_world_size(narrow[0].process_group)} ({why}): pass "
            f"the full state dict on every rank instead{torchs}"
        )
    position = {id(g): n for n, g in enumerate(groups)}
    header: List[Any] = [None]
    if dist.get_rank() == 0:
        problem = _load_problem(state_dict, current, index, strict)
        sharded, rest = _split(state_dict, current, index) if problem is None else ({}, {})
        header[0] = {
            "problem": None if problem is None else (type(problem), problem.args[0]),
            "present": sorted((position[id(g)], i) for g, i in sharded),
            "rest": {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in rest.items()},
        }
    with current_device(groups[0].device if groups else None):
        dist.broadcast_object_list(header, src=0)
    if header[0]["problem"] is not None:
        kind, message = header[0]["problem"]
        raise kind(message)
    present: Dict[int, List[int]] = {}
    for n, i in header[0]["present"]:
        present.setdefault(n, []).append(i)
    with torch.no_grad():
        for n, group in enumerate(groups):
            if n in present:
                _broadcast_group(group, present[n], sharded if dist.get_rank() == 0 else None)
    return {(groups[n], i) for n, i in header[0]["present"]}, header[0]["rest"]


def _broadcast_group(group: ParamGroup, indices: List[int],
                     source: Optional[Dict[Tuple[ParamGroup, int], torch.Tensor]]) -> None:
    """One broadcast of ``group``'s full buffer from rank 0 (which fills tensors ``indices``
    from ``source``); every rank copies its ranges of them into its master shard."""
    flat = torch.zeros(group.plan.global_size, dtype=group.master.local.dtype, device=group.device)
    offsets = group.plan.offsets
    if source is not None:
        for i in indices:
            flat.narrow(0, offsets[i], group.plan.specs[i].numel).copy_(source[group, i].detach().reshape(-1))
    dist.broadcast(flat, src=0)
    for i in indices:
        group.master.copy_local_from_full(i, flat.narrow(0, offsets[i], group.plan.specs[i].numel))


def full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer,
) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Optional[float]]:
    """``({param key: {state key: full tensor}}, step)`` for element-wise optimizer state.

    Collective over every group under ``module`` (one all-gather per group and state
    key). Keys are the module's state-dict keys (the first name of a tied parameter).
    Raises ``ValueError`` for state that is not one value per element (8-bit blocks,
    Shampoo preconditioners, ...): such state has no full-tensor form.
    """
    refuse_tensor_parallel(groups_of(module), "full_optimizer_state", USE_DCP)
    keys = {id(p): key for key, p in sharded_params_by_key(module).items()}
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    steps = set()
    for group in groups_of(module):
        states = [optimizer.state.get(p, {}) for p in group.sharded_params]
        names = sorted({k for st in states for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0})
        for st in states:
            if "step" in st:
                steps.add(float(st["step"]))
        unknown = [k for k in names if k not in ELEMENT_WISE_STATE]
        if unknown:
            raise ValueError(
                f"optimizer {type(optimizer).__name__} keeps state {unknown} that is not one value per parameter "
                f"element, so it has no full-tensor (model-space) form; save it with vescale_zero.checkpoint.save "
                f"(per-rank shards, reshardable) instead"
            )
        for name in names:
            dtype = next(st[name].dtype for st in states if name in st)
            full = _gather_pieces(group, [st.get(name) for st in states], dtype)
            for param, st, tensor in zip(group.sharded_params, states, full):
                if name in st and id(param) in keys:
                    out.setdefault(keys[id(param)], {})[name] = tensor
    if len(steps) > 1:
        raise ValueError(f"the optimizer's step differs between parameters ({sorted(steps)}); cannot save one step")
    return out, (steps.pop() if steps else None)


def restored_step(value: Any, param: torch.Tensor, group: Mapping[str, Any]) -> Any:
    """A loaded optimizer ``step`` placed as torch's ``Optimizer.load_state_dict`` places it.

    [Note: where the step lives] torch keeps ``step`` as a CPU tensor for the plain
    (for-loop / foreach) kernels, which read it on the host, but as an fp32 tensor on the
    parameter's device for ``fused=True`` and ``capturable=True``, whose kernels (and CUDA
    graphs) read it on the device and refuse a CPU step ("params and state_steps must be on
    supported devices"). A step that a checkpoint holds on the CPU therefore moves to the
    parameter's device, as fp32, when ``param``'s group is fused or capturable, and is kept as
    it is otherwise (torch's ``_process_value_according_to_param_policy``). Values that are not
    tensors (our own optimizers count steps in Python ints) are kept as they are."""
    if torch.is_tensor(value) and (group.get("fused") or group.get("capturable")):
        return value.to(dtype=torch.float32, device=param.device)
    return value


def load_full_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Mapping[str, torch.Tensor]],
    step: Optional[float], strict: bool = True,
) -> None:
    """Load ``state`` (see :func:`full_optimizer_state`) into the optimizer of a sharded
    module: each rank keeps the flat range it owns; no communication. With ``strict``, a
    parameter the optimizer trains but ``state`` lacks raises ``KeyError``; a tensor of the
    wrong shape always raises ``ValueError``."""
    refuse_tensor_parallel(groups_of(module), "load_full_optimizer_state", USE_DCP)
    keys = {id(p): key for key, p in sharded_params_by_key(module).items()}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    trained = set(group_of)
    missing = []
    with torch.no_grad():
        for group in groups_of(module):
            for i, sp in enumerate(group.sharded_params):
                key = keys.get(id(sp))
                if key is None or id(sp) not in trained:
                    continue
                if key not in state:
                    missing.append(key)
                    continue
                shape = tuple(group.managed[i].shape)
                start, end = group.master.local_range(i)
                target = optimizer.state[sp]
                for name, value in state[key].items():
                    if tuple(value.shape) != shape:
                        raise ValueError(
                            f"optimizer state {name!r} of {key!r} has shape {tuple(value.shape)}, the parameter "
                            f"{shape}; the checkpoint must come from the same model (same tensor/pipeline layout)"
                        )
                    piece = value.detach().reshape(-1)[start:end].to(dtype=sp.dtype, device=sp.device)
                    target[name] = like_param(piece.clone(), sp)
                if step is not None:
                    target["step"] = restored_step(torch.tensor(float(step), dtype=torch.float32), sp,
                                                   group_of[id(sp)])
    if strict and missing:
        raise KeyError(
            f"the optimizer state holds no entry for {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            "it was saved for another model, or load with --no-load-optim"
        )


@dataclass(frozen=True)
class LocalPieces:
    """This rank's flat range ``[start, end)`` of one tensor of ``shape`` (its ragged shard),
    to be described as boxes (:func:`flat_range_boxes`) whose data are views of the rank's
    flat local piece -- nothing is gathered or copied."""

    shape: Tuple[int, ...]
    start: int
    end: int

    @classmethod
    def of(cls, group: ParamGroup, index: int) -> "LocalPieces":
        """Tensor ``index`` of a ``fully_shard`` group, on this rank (from its placement)."""
        start, end = group.sharded_params[index].local_range
        return cls(tuple(group.managed[index].shape), start, end)

    def boxes_within(self, offset: int = 0, shape: Optional[Sequence[int]] = None) -> List[Box]:
        """This rank's boxes of the contiguous sub-tensor of ``shape`` that starts at flat
        ``offset`` of the tensor (default: the whole tensor), in the sub-tensor's coordinates;
        each box's third item is where its data starts in the local flat piece."""
        shape = self.shape if shape is None else tuple(shape)
        lo, hi = max(self.start, offset), min(self.end, offset + math.prod(shape))
        return [(o, z, f + offset - self.start) for o, z, f in flat_range_boxes(shape, lo - offset, hi - offset)]

    @staticmethod
    def take(local: torch.Tensor, box: Box) -> torch.Tensor:
        """The data of ``box`` (from :meth:`boxes_within`): a view of the flat ``local`` piece."""
        _, sizes, at = box
        return local.reshape(-1).narrow(0, at, math.prod(sizes)).view(sizes)
