"""Save and load the ragged shards of live ``fully_shard`` models, with resharding and
crash safety (the files: :mod:`vescale_zero.checkpoint.format`).

Each rank writes only its own pieces; rank 0 adds ``common.pt`` and, once every rank file
is written, the metadata. A piece is a flat range ``[start, end)`` of a parameter, so
loading is independent of the layout that wrote it: each rank asks for its own ranges
under the *current* plan (any world size, any granularity) and copies them out of
whichever files overlap (the metadata's index says which; the others are not read).

[Note: per-block state]
Structure-aware optimizers keep state per *block* rather than per element: 8-bit AdamW
one scale per ``block`` elements, Shampoo two preconditioners per tile. Such state is
addressed by entry: an optimizer that has it defines ``sharded_state_span(param, key)``
returning ``(first, last, total)``, the entries ``[first, last)`` (of ``total`` for the
whole parameter) that ``param``'s piece holds along dim 0 of the state tensor (or the
positions of a state list). They are saved as entry ranges and re-cut on load like
elements, so per-block state reshards to any world size whose pieces keep the blocks
whole (which the optimizer's granularity policy guarantees)::

    param  [ e0 e1 e2 e3 | e4 e5 e6 e7 | e8 e9 ]      block = 4 elements, 3 blocks
    saved  rank 0: elems [0, 6)  -- not block-aligned: the optimizer refuses it
    saved  rank 0: elems [0, 8)  scales [0, 2)    rank 1: elems [8, 10)  scales [2, 3)
    load   rank 0: elems [0, 4)  scales [0, 1)    rank 1: [4, 10) -> scales [1, 3)

[Note: HSDP checkpoints]
On a 2-D (replicate x shard) mesh every replica holds the same shards (and, its gradients
being all-reduced across replicas, the same optimizer state), so only the first replica's
shard group writes pieces: the file of a rank that is not replica 0 of any of its groups is
not written (its ``sha256`` in the metadata is ``null``, its index empty), and each piece is
on disk once, whatever the number of replicas. Loading needs nothing special: a rank's ranges
are those of its shard group's plan, so every replica of a 2-D mesh, or every rank of a flat
one, copies its own ranges out of the files that hold them::

    save 2 x 2 (replicas {0,2} {1,3})    rank0: [0, 5)  rank1: [5, 10)   rank2, rank3: no file
    load flat 3                          rank0: [0, 4) <- rank0's file   rank1: [4, 7) <- both ...
    load 2 x 2                           ranks 0 and 2: [0, 5)           ranks 1 and 3: [5, 10)

[Note: frozen parameters left out]
``save(..., exclude_frozen=True)`` (DeepSpeed's ``save_checkpoint(exclude_frozen_parameters=True)``,
which the Hugging Face Trainer passes for PEFT models) writes no piece of a parameter that does
not require grad (``common.pt`` lists the frozen names in every checkpoint, and says whether
they were left out); loading keeps the model's own values of
the listed parameters (the base weights a LoRA run builds from the pretrained model, as ZeRO-3
does) and refuses any other missing one. A strict load (``keep_frozen_left_out=False``; DeepSpeed's
``load_module_strict=True``, with which ZeRO-3 also refuses such a checkpoint) refuses it, naming them.

[Note: crash safety]
Every rank writes (and fsyncs) its file in ``CKPT.tmp-<id>/``; once every rank's checksum
has reached it (an all-gather: a dead rank makes it raise, so nothing is published) rank 0
writes the metadata and renames the directory to ``CKPT`` in one ``os.replace``. A
crash before that leaves only the temporary directory; a ``latest`` pointer is moved
(also by rename) only after the checkpoint is published. Loading verifies the metadata
and the checksum of every file it reads, and names the file when one is wrong.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..api.fully_shard import RaggedFSDPModule, groups_of
from ..api.state_dict import restored_step
from ..primitives.comm_device import collective_device, current_device
from ..primitives.ragged_tensor import like_param, local_piece, local_rows
from ..primitives.tensor_parallel import USE_DCP, refuse_tensor_parallel
from .format import (
    CHECKPOINT_DOMAIN,
    CheckpointError,
    Piece,
    entries,
    fill,
    fsync_dir,
    read_common,
    read_metadata,
    read_rank_file,
    sha256_file,
    write_common,
    write_metadata,
    write_rank_file,
    written_ranks,
)

__all__ = ["save", "load", "managed_pieces", "model_device"]

SpanFn = Callable[[torch.Tensor, str], Optional[Tuple[int, int, int]]]


def managed_pieces(model: nn.Module) -> List[Tuple[str, nn.Parameter, Tuple[int, ...], int, int]]:
    """``(name, sharded param, full shape, start, end)`` for every parameter of every group."""
    out = []
    for prefix, module in model.named_modules():
        if not isinstance(module, RaggedFSDPModule) or module.vescale_group is None:
            continue
        group = module.vescale_group
        for i, m in enumerate(group.managed):
            start, end = group.sharded_params[i].local_range  # from the placement
            name = f"{prefix}.{m.fqn}" if prefix else m.fqn
            domain = getattr(group.sharded_params[i], CHECKPOINT_DOMAIN, None)
            out.append((f"{domain}/{name}" if domain else name, group.sharded_params[i], tuple(m.shape), start, end))
    return out


def _aliases(model: nn.Module) -> Dict[str, List[str]]:
    """Saved name -> every other name of a tied parameter (``head.weight`` tied to the
    embedding is saved once, and :func:`consolidate` writes it under both names)."""
    module_names = {id(m): n for n, m in model.named_modules()}
    out: Dict[str, List[str]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, RaggedFSDPModule) or module.vescale_group is None:
            continue
        group = module.vescale_group
        for i, m in enumerate(group.managed):
            if len(m.owners) < 2:
                continue
            domain = getattr(group.sharded_params[i], CHECKPOINT_DOMAIN, None)
            names = []
            for owner, attr in m.owners:
                owner_name = module_names.get(id(owner), "")
                name = f"{owner_name}.{attr}" if owner_name else attr
                names.append(f"{domain}/{name}" if domain else name)
            saved = f"{prefix}.{m.fqn}" if prefix else m.fqn
            saved = f"{domain}/{saved}" if domain else saved
            out[saved] = [n for n in names if n != saved]
    return out


def _state_span_fn(optimizer: Any) -> Optional[SpanFn]:
    """The ``sharded_state_span`` of ``optimizer`` or of the optimizer it wraps (Megatron's
    and DeepSpeed's wrappers keep the real one as ``.optimizer``); see [Note: per-block state]."""
    seen = 0
    while optimizer is not None and seen < 4:
        fn = getattr(optimizer, "sharded_state_span", None)
        if callable(fn):
            return fn
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def model_device(model: nn.Module) -> Optional[torch.device]:
    """The device of ``model``'s sharded groups (else of its parameters), ``None`` if it has none."""
    for group in groups_of(model):
        return group.device
    return next((p.device for p in model.parameters()), None)


def _written_here(model: nn.Module) -> Set[int]:
    """Ids of the sharded parameters whose pieces this rank writes: all of them on a 1-D mesh;
    under HSDP only those of groups where this rank is replica 0 (see [Note: HSDP checkpoints])."""
    out: Set[int] = set()
    for group in groups_of(model):
        if group.replicate_group is None or dist.get_rank(group.replicate_group) == 0:
            out.update(id(p) for p in group.sharded_params)
    return out


def save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, extra: Any = None,
         exclude_frozen: bool = False) -> None:
    """Write ``model``'s (and ``optimizer``'s) shards of this rank under ``path``; collective.
    Under HSDP only the first replica's shard group writes (see [Note: HSDP checkpoints]).
    With ``exclude_frozen`` the parameters that do not require grad are left out (see
    [Note: frozen parameters left out])."""
    refuse_tensor_parallel(groups_of(model), "vescale_zero.checkpoint.save", USE_DCP)
    with current_device(model_device(model)):  # the object collectives' device on NCCL
        _save(path, model, optimizer, extra, exclude_frozen)


def _save(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Any,
          exclude_frozen: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    tmp = f"{path.rstrip(os.sep)}.tmp-{token[0]}"
    os.makedirs(tmp, exist_ok=True)
    params, states, blocks, scalars = {}, {}, {}, {}
    written = _written_here(model)
    by_param = {id(p): (name, shape, s, e) for name, p, shape, s, e in managed_pieces(model)}
    frozen = {name for name, p, *_ in managed_pieces(model) if not p.requires_grad}
    for name, p, shape, s, e in managed_pieces(model):
        if id(p) in written and not (exclude_frozen and name in frozen):
            params[name] = (shape, s, e, local_piece(p).detach().cpu().clone())
    if optimizer is not None:
        span_of = _state_span_fn(optimizer)
        for p, state in optimizer.state.items():
            if id(p) not in written:  # another replica writes the same state
                continue
            name, shape, s, e = by_param[id(p)]
            for key, value in state.items():
                span = span_of(p, key) if span_of is not None else None
                if span is not None:  # per-block state, see [Note: per-block state]
                    first, last, total = span
                    blocks[f"{name}::{key}"] = ((total,), first, last, _to_cpu(local_rows(value)))
                elif _per_element(value, p, e - s):
                    states[f"{name}::{key}"] = (shape, s, e, local_piece(value).detach().cpu().clone())
                else:  # a scalar (e.g. step), or other state tied to this piece
                    scalars[f"{name}::{key}"] = (s, e, _to_cpu(value))
    # A rank holding no piece of its own (a replica other than the first) writes no file.
    file = write_rank_file(tmp, rank, params, states, blocks, scalars) if written or not groups_of(model) else None
    if rank == 0:  # what every loading rank needs, apart from the big rank files
        write_common(
            tmp, _aliases(model),
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else None,
            {n: b.detach().cpu().clone() for n, b in model.named_buffers()}, extra, sorted(frozen), exclude_frozen,
        )
    # The index (which ranges each file holds) lets a loading rank open only the files it needs.
    mine = (sha256_file(file) if file else None, {name: [s, e] for name, (_, s, e, _) in params.items()})
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        write_metadata(tmp, world, [g[0] for g in gathered], [g[1] for g in gathered])
        old = None
        if os.path.exists(path):  # re-saving a tag: the old one goes only once the new one is whole
            old = f"{path.rstrip(os.sep)}.old-{token[0]}"
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        if old is not None:
            shutil.rmtree(old)
    dist.barrier()


def _per_element(value: Any, param: torch.Tensor, numel: int) -> bool:
    """Optimizer state with one value per element of this rank's piece (Adam's moments, 8-bit codes)."""
    if not torch.is_tensor(value):
        return False
    local = local_piece(value)
    return local.dim() == 1 and local.numel() == local_piece(param).numel() == numel


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return local_piece(value).detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _files_needed(meta: Dict[str, Any], managed: List[Tuple[str, nn.Parameter, Tuple[int, ...], int, int]],
                  whole: List[str]) -> List[int]:
    """Every rank file holding a range that overlaps one of this rank's pieces or a piece
    of the ``whole`` names; all files for a checkpoint without index."""
    index = meta.get("index")
    if index is None:
        return written_ranks(meta)
    needed = set()
    for r, ranges in enumerate(index):
        if any(name in ranges for name in whole):
            needed.add(r)
            continue
        for name, _, _, s, e in managed:
            saved = ranges.get(name)
            if saved is not None and max(saved[0], s) < min(saved[1], e):
                needed.add(r)
                break
    return sorted(needed)


def load(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         keep_frozen_left_out: bool = True) -> Any:
    """Load a checkpoint written by :func:`save` (or converted into our format) at any world
    size; returns its ``extra``. (:func:`vescale_zero.checkpoint.load` also takes DCP ones.)
    ``keep_frozen_left_out``: keep the model's values of the frozen parameters the checkpoint
    left out ([Note: frozen parameters left out]); False refuses such a checkpoint (a strict load).

    Collective: if any rank refuses the checkpoint, every rank raises (none goes on to
    train alone and hang in its next collective).

    [Note: load after forward] A group can hold gathered (full) parameters when the load
    comes: the root and groups with ``reshard_after_forward=False`` stay gathered after a
    forward without backward. Every group is resharded first, so the next forward gathers
    the loaded shards; and the shards are written in place (their version counter moves),
    so a group computing in another precision casts them again.
    """
    refuse_tensor_parallel(groups_of(model), "vescale_zero.checkpoint.load", USE_DCP)
    for group in groups_of(model):
        group.reshard()
    error: Optional[CheckpointError] = None
    try:
        extra = _load_local(path, model, optimizer, keep_frozen_left_out)
    except CheckpointError as e:
        error = e
    if dist.is_initialized():
        flag = torch.tensor([1.0 if error else 0.0], device=collective_device(None, model_device(model)))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            error = CheckpointError(f"another rank refused the checkpoint at {path!r}; see its error")
    if error is not None:
        raise error
    return extra


def _whole_name(name: str, saved: Dict[str, Any], path: str) -> str:
    """The name under which a whole-tensor checkpoint (written by
    :func:`vescale_zero.checkpoint.format.write_whole`, in the names of a model without model
    parallelism) holds the piece ``name`` of this model: the name itself, else without its
    domain (see :mod:`~vescale_zero.checkpoint.format` [Note: domains]) and without wrapper
    prefixes (``module.``, as torch's ``consume_prefix_in_state_dict_if_present``). A domain
    other than the first slice of every model-parallel dimension is refused: its tensors are
    slices the checkpoint does not name."""
    if name in saved:
        return name
    domain, _, plain = name.rpartition("/")
    if domain and any(c.isdigit() and c != "0" for c in domain):
        raise CheckpointError(
            f"{path} holds whole tensors of a model without tensor/pipeline/expert parallelism (it was converted), "
            f"and this rank holds the model-parallel slice {domain!r} of {plain!r}; load it at TP = PP = EP = 1 "
            "(any data-parallel size), or load the source checkpoint itself at this layout"
        )
    while plain not in saved and plain.startswith("module."):
        plain = plain[len("module."):]
    return plain


def _load_local(path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                keep_frozen_left_out: bool = True) -> Any:
    meta = read_metadata(path)
    managed = managed_pieces(model)
    sliced = set()  # names of model-parallel slices looked up in a whole checkpoint
    if meta.get("whole"):
        renamed = [(_whole_name(name, meta["index"][0], path), name) for name, *_ in managed]
        sliced = {whole for whole, name in renamed if "/" in name}
        managed = [(whole, *rest) for (whole, _), (_, *rest) in zip(renamed, managed)]
    common = read_common(path, meta)
    # Buffers of a converted (whole) checkpoint are among the pieces.
    loose = [n for n, _ in model.named_buffers() if n not in common["buffers"]]
    files = [read_rank_file(path, r, meta["sha256"][r]) for r in _files_needed(meta, managed, loose)]
    pieces: Dict[str, List[Piece]] = {}
    blocks: Dict[str, List[Piece]] = {}
    for f in files:
        for key, piece in list(f["params"].items()) + list(f["optim_states"].items()):
            pieces.setdefault(key, []).append(piece)
        for key, piece in f.get("optim_blocks", {}).items():
            blocks.setdefault(key, []).append(piece)
    with torch.no_grad():
        left_out = set(common.get("frozen", ())) if common.get("frozen_excluded") else set()
        if left_out and not keep_frozen_left_out:
            raise CheckpointError(
                f"{path} was saved without its frozen parameters {sorted(left_out)} (exclude_frozen); a strict load "
                "cannot restore them: load keeping the model's own values of them (DeepSpeed: load_checkpoint(..., "
                "load_module_strict=False), what the Hugging Face Trainer passes for PEFT models)")
        for name, p, shape, s, e in managed:
            saved = pieces.get(name)
            if saved is None and (name in left_out or s == e):  # [Note: frozen parameters left out]; a rank
                continue  # whose pieces are all empty may read no file (the ranks holding them check the shape)
            if saved is None or tuple(saved[0][0]) != shape:
                got = None if saved is None else tuple(saved[0][0])
                hint = ("; it holds whole tensors of a model without model parallelism (it was converted): load it at "
                        "TP = PP = EP = 1, into the model it was converted from") if name in sliced else ""
                raise CheckpointError(f"{path}: parameter {name!r} of shape {shape} is "
                                      f"{'missing' if got is None else f'saved as {got}'}{hint}")
            fill(local_piece(p).detach(), s, e, saved, name)  # not .data: see [Note: load after forward]
        for name, buf in model.named_buffers():
            saved = common["buffers"].get(name)
            piece_name = _whole_name(name, pieces, path) if meta.get("whole") else name
            if saved is None and piece_name in pieces:
                saved = torch.empty(buf.numel(), dtype=buf.dtype, device="cpu")
                fill(saved, 0, buf.numel(), pieces[piece_name], name)
            if saved is not None:
                buf.copy_(saved.view(buf.shape))
        if optimizer is not None:
            saved_groups = common["optim_groups"]
            if saved_groups is None and not any("::" in k for k in pieces) and not blocks:
                raise CheckpointError(f"{path} holds no optimizer state")
            if saved_groups and len(saved_groups) != len(optimizer.param_groups):
                raise CheckpointError(
                    f"{path} holds {len(saved_groups)} optimizer param groups and this optimizer has "
                    f"{len(optimizer.param_groups)}; build the optimizer with the same groups (e.g. the same "
                    "weight-decay split)"
                )
            by_id = {id(p): (name, s, e) for name, p, _, s, e in managed}
            span_of = _state_span_fn(optimizer)
            for i, group in enumerate(optimizer.param_groups):
                if saved_groups:  # a converted checkpoint may hold none: the optimizer keeps its own
                    group.update(saved_groups[i])
                for p in group["params"]:
                    if id(p) not in by_id:
                        raise CheckpointError(
                            f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a sharded "
                            "parameter of the model; build the optimizer after fully_shard, from model.parameters()"
                        )
                    name, s, e = by_id[id(p)]
                    state = _piece_scalars(files, name, s, e)
                    for key, saved in pieces.items():
                        if key.startswith(name + "::"):
                            t = torch.zeros(e - s, dtype=saved[0][3].dtype, device=p.device)
                            fill(t, s, e, saved, key)
                            state[key[len(name) + 2 :]] = like_param(t, p)  # a ragged parameter's state is ragged
                    for key, saved in blocks.items():
                        if key.startswith(name + "::"):
                            state[key[len(name) + 2 :]] = _load_blocks(span_of, p, key[len(name) + 2 :], saved, key)
                    if "step" in state:  # see [Note: where the step lives] (state_dict.py)
                        state["step"] = restored_step(state["step"], p, group)
                    if state:
                        optimizer.state[p] = state
    return common["extra"]


def _load_blocks(span_of: Optional[SpanFn], param: torch.Tensor, key: str, saved: List[Piece], what: str) -> Any:
    try:  # the optimizer refuses a piece that splits one of its blocks
        span = span_of(param, key) if span_of is not None else None
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from None
    if span is None:
        raise CheckpointError(f"{what} is per-block optimizer state, and this optimizer does not say which blocks "
                              "this rank holds (no sharded_state_span); load it into the optimizer that saved it")
    first, last, total = span
    if total != saved[0][0][0]:
        raise CheckpointError(
            f"{what}: the checkpoint holds {saved[0][0][0]} blocks for this parameter and this optimizer has "
            f"{total}; load with the block size it was saved with"
        )
    return _to_device(entries(first, last, saved, what), param.device)


def _piece_scalars(files: List[Dict[str, Any]], name: str, start: int, end: int) -> Dict[str, Any]:
    """Optimizer state of ``name`` that is neither per element nor per block: a true scalar
    (``step``) from any file; anything larger (a tensor, a list) only from the file whose
    piece is the same range, since without a span it cannot be cut and re-joined."""
    state: Dict[str, Any] = {}
    prefix = name + "::"
    for f in files:
        for key, (s, e, value) in f["optim_scalars"].items():
            if not key.startswith(prefix) or key[len(prefix):] in state:
                continue
            plain = isinstance(value, (int, float, bool, str, type(None)))
            small = value.numel() <= 1 if torch.is_tensor(value) else plain
            if small or (s, e) == (start, end):
                state[key[len(prefix):]] = value.clone() if torch.is_tensor(value) else value
    missing = {k[len(prefix):] for f in files for k in f["optim_scalars"] if k.startswith(prefix)} - set(state)
    if missing and end > start:
        raise CheckpointError(
            f"optimizer state {sorted(missing)} of {name!r} is stored per piece (its optimizer defines no "
            f"sharded_state_span to re-cut it) and this "
            f"rank's piece [{start}, {end}) differs from every saved one; load it with the world size and "
            "granularity it was saved with"
        )
    return state
