"""The on-disk format of vescale-zero checkpoints: every module of the package reads and
writes it through this one (which imports no sibling).

One directory per checkpoint::

    CKPT/
      metadata.json        {"format": FORMAT, "world_size": W, "sha256": [per rank: its file's, or
                            null if it wrote none (HSDP: a replica other than the first)],
                            "common_sha256": ..., "index": [{name: [start, end]} per rank],
                            "whole": true}   (only in checkpoints converted from elsewhere)
      common.pt            written once: {"aliases": {saved name: [tied names]},
                            "optim_groups": [hyper-parameters per param group] | None,
                            "buffers": {name: tensor}, "extra": the caller's object,
                            "frozen": [names of parameters that do not require grad],
                            "frozen_excluded": whether their pieces were left out}
                            (older checkpoints have neither key: nothing left out)
      rank00000.pt         one per writing rank: {"params": {name: Piece},
      rank00001.pt           "optim_states": {"name::key": Piece},      per element
      ...                    "optim_blocks": {"name::key": Piece},      per block (by entry)
                             "optim_scalars": {"name::key": (start, end, value)}}
    DIR/latest             a tag (a checkpoint directory name under DIR), moved by rename

    Piece = (full shape, start, end, values): the flat range [start, end) of the tensor

A piece is a flat range of a parameter (or of its per-element optimizer state), so a
checkpoint can be read at any world size and granularity: each reader asks for its own
ranges and copies them out of whichever pieces overlap (:func:`fill`); per-block state is
cut by entry instead (:func:`entries`). A checkpoint converted from another framework
(``"whole": true``) is written as if by one rank holding every tensor whole
(:func:`write_whole`).

[Note: domains] Pieces are matched by name across every rank's file, which is right when
the ranks differ only in data parallelism. Under tensor / pipeline / expert parallelism one
name means different tensors on different ranks (each TP rank's slice); an integration
sets ``param.checkpoint_domain`` (e.g. ``"tp1-pp0"``) on the sharded parameters, and names
are qualified by it (``"tp1-pp0/decoder..."``), so pieces only meet pieces of the same tensor.

Crash safety (checkpoint.sharded [Note: crash safety]): writers fill a temporary directory
and publish it with one ``os.replace`` after the metadata (with every file's sha256) is
written; readers check the metadata and the checksum of every file they read, and name the
file when one is wrong. Every file is fsynced before the step that publishes it (the
metadata, the rename, a ``latest`` pointer), and the directory after, so a machine that goes
down -- not only a killed process -- leaves the previous checkpoint and ``latest`` as they
were.

Other frameworks' directories are recognised here too (:func:`is_dcp_checkpoint`), and a
DCP directory is read whole in one process (:func:`read_dcp`), for the converters and for
loading a DCP checkpoint directly.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..torch_compat import read_dcp_state_dict

__all__ = [
    "FORMAT", "METADATA_FILE", "COMMON_FILE", "CHECKPOINT_DOMAIN", "Piece", "CheckpointError",
    "rank_file", "sha256_file", "save_synced", "fsync_dir", "write_rank_file", "write_common", "write_metadata",
    "write_whole",
    "read_metadata", "read_checked", "read_rank_file", "written_ranks", "read_common", "fill", "entries",
    "write_latest", "read_latest", "latest_tag", "is_dcp_checkpoint", "other_checkpoint", "read_dcp",
]

FORMAT = "vescale-zero/ragged-v1"
METADATA_FILE = "metadata.json"
COMMON_FILE = "common.pt"
CHECKPOINT_DOMAIN = "checkpoint_domain"
"""The attribute of a sharded parameter that qualifies its saved name (see [Note: domains])."""

Piece = Tuple[Tuple[int, ...], int, int, Any]
"""``(full shape, start, end, values)``: elements (or entries) ``[start, end)`` along dim 0
of the flattened tensor of ``full shape``; ``values`` is a tensor, or a list of entries."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial or corrupt; the message names the file."""


# ---- files and checksums -----------------------------------------------------------------


def rank_file(ckpt: str, rank: int) -> str:
    """The path of rank ``rank``'s file in checkpoint directory ``ckpt``."""
    return os.path.join(ckpt, f"rank{rank:05d}.pt")


def save_synced(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` and ``fsync``: the bytes are on disk before anything that
    publishes them (a rename, the metadata) can be."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created or renamed into it) durable;
    a no-op where the platform or file system cannot sync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- writing -------------------------------------------------------------------------------


def write_rank_file(ckpt: str, rank: int, params: Dict[str, Piece], states: Dict[str, Piece],
                    blocks: Dict[str, Piece], scalars: Dict[str, Tuple[int, int, Any]]) -> str:
    """Write rank ``rank``'s pieces (CPU tensors) into ``ckpt``; returns the file's path."""
    path = rank_file(ckpt, rank)
    save_synced({"params": params, "optim_states": states, "optim_blocks": blocks, "optim_scalars": scalars}, path)
    return path


def write_common(ckpt: str, aliases: Dict[str, List[str]], optim_groups: Optional[List[Dict[str, Any]]],
                 buffers: Dict[str, torch.Tensor], extra: Any, frozen: Sequence[str] = (),
                 frozen_excluded: bool = False) -> str:
    """Write ``common.pt`` into ``ckpt``; returns its path."""
    path = os.path.join(ckpt, COMMON_FILE)
    common = {"aliases": aliases, "optim_groups": optim_groups, "buffers": buffers, "extra": extra,
              "frozen": list(frozen), "frozen_excluded": frozen_excluded}
    save_synced(common, path)
    return path


def write_metadata(ckpt: str, world_size: int, sha256: List[str], index: List[Dict[str, List[int]]],
                   whole: bool = False) -> None:
    """Write ``metadata.json`` (last, once every other file of ``ckpt`` is written)."""
    meta: Dict[str, Any] = {"format": FORMAT, "world_size": world_size}
    if whole:
        meta["whole"] = True
    meta.update(sha256=sha256, common_sha256=sha256_file(os.path.join(ckpt, COMMON_FILE)), index=index)
    with open(os.path.join(ckpt, METADATA_FILE), "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(ckpt)


def write_whole(dst: str, tensors: Dict[str, torch.Tensor], optim_state: Optional[Dict[str, Dict[str, Any]]] = None,
                optim_groups: Optional[List[Dict[str, Any]]] = None, extra: Any = None) -> None:
    """Publish a one-rank checkpoint at ``dst`` holding every tensor whole (``"whole": true``).

    ``optim_state`` maps a parameter name to its state: tensors of the parameter's numel
    are per element, anything else (``step``) is kept as is. Written to a temporary name
    and renamed, like :func:`vescale_zero.checkpoint.save`.
    """
    params, states, scalars = {}, {}, {}
    for name, t in tensors.items():
        t = t.detach().to("cpu", copy=True)
        params[name] = (tuple(t.shape), 0, t.numel(), t.reshape(-1).float() if t.is_floating_point() else t.reshape(-1))
    for name, state in (optim_state or {}).items():
        if name not in params:
            raise CheckpointError(f"optimizer state for {name!r}, which is not a tensor of the model state dict")
        shape, _, numel, _ = params[name]
        for key, value in state.items():
            if torch.is_tensor(value) and value.numel() == numel and numel > 1:
                flat = value.detach().to("cpu", torch.float32).reshape(-1).clone()
                states[f"{name}::{key}"] = (shape, 0, numel, flat)
            else:
                kept = value.detach().cpu().clone() if torch.is_tensor(value) else value
                scalars[f"{name}::{key}"] = (0, numel, kept)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} exists; convert into a new directory")
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".tmp-", dir=parent)
    try:
        file = write_rank_file(tmp, 0, params, states, {}, scalars)
        write_common(tmp, {}, optim_groups, {}, extra)
        write_metadata(tmp, 1, [sha256_file(file)], [{name: [0, p[2]] for name, p in params.items()}], whole=True)
        os.replace(tmp, dst)
        fsync_dir(parent)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


def write_latest(directory: str, tag: str) -> None:
    """Point ``directory/latest`` at ``tag``, atomically (rank 0 only)."""
    tmp = os.path.join(directory, f".latest-{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, "latest"))
    fsync_dir(directory)


def refuse(message: str) -> None:
    """Raise :class:`CheckpointError` with ``message``: what a notice file left for another
    framework's reader calls when that reader unpickles it (the reader then shows why it cannot
    read this checkpoint, and what to do instead)."""
    raise CheckpointError(message)


# ---- reading -------------------------------------------------------------------------------


def latest_tag(directory: str) -> Optional[str]:
    """The tag ``directory/latest`` points at (ours or DeepSpeed's: the same one-line file), or
    ``None`` if there is no such file or it is empty."""
    file = os.path.join(directory, "latest")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return f.read().strip() or None


def read_latest(directory: str) -> str:
    """The tag ``directory/latest`` points at; refused if there is none."""
    tag = latest_tag(directory)
    if tag is None:
        raise CheckpointError(f"{os.path.join(directory, 'latest')} is missing or empty: pass a tag, or save a "
                              "checkpoint with save_latest=True first")
    return tag


def read_metadata(path: str) -> Dict[str, Any]:
    """``metadata.json`` of checkpoint ``path``, refused if missing, corrupt or of another format."""
    meta_path = os.path.join(path, METADATA_FILE)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}{_interrupted_resave(path)}")
    other = other_checkpoint(path)
    if other is not None:
        raise CheckpointError(other)
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{meta_path} is missing: {path!r} is a partial checkpoint (its save did not finish)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}")
    return meta


def _interrupted_resave(path: str) -> str:
    """A hint if ``path`` is missing because a save over it was killed between moving the
    old checkpoint aside (``PATH.old-<id>``) and moving the new one in."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        old = sorted(n for n in os.listdir(parent) if n.startswith(name + ".old-")
                     and os.path.exists(os.path.join(parent, n, METADATA_FILE)))
    except OSError:
        return ""
    if not old:
        return ""
    return (f"; a save over it was interrupted, and {os.path.join(parent, old[-1])!r} holds the checkpoint it was "
            f"replacing: rename that back to {name!r} to load it")


def read_checked(file: str, digest: str) -> Dict[str, Any]:
    """``file`` read once, checked against ``digest`` (its sha256), then unpickled from memory."""
    with open(file, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{file} does not match its sha256 in metadata.json: the file is corrupt or truncated")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def written_ranks(meta: Dict[str, Any]) -> List[int]:
    """The ranks that wrote a file: every rank of the saving world, except under HSDP, where
    only the first replica's shard group writes (``sha256`` is ``null`` for the others)."""
    return [r for r, digest in enumerate(meta["sha256"]) if digest is not None]


def read_rank_file(path: str, rank: int, digest: Optional[str]) -> Dict[str, Any]:
    """Rank ``rank``'s file of checkpoint ``path``, checked against its sha256."""
    file = rank_file(path, rank)
    if digest is None:
        raise CheckpointError(f"{file}: metadata.json says rank {rank} wrote no file (another replica holds its "
                              "pieces), yet its index lists pieces there: the metadata is corrupt")
    if not os.path.exists(file):
        raise CheckpointError(f"{file} is missing (the checkpoint was written by {rank + 1}+ ranks)")
    return read_checked(file, digest)


def read_common(path: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Buffers, hyper-parameters, aliases and extra (in rank 0's file before common.pt)."""
    if "common_sha256" not in meta:
        return read_rank_file(path, 0, meta["sha256"][0])
    file = os.path.join(path, COMMON_FILE)
    if not os.path.exists(file):
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
    return read_checked(file, meta["common_sha256"])


# ---- cutting pieces --------------------------------------------------------------------------


def fill(target: torch.Tensor, start: int, end: int, pieces: List[Piece], what: str) -> None:
    """Copy flat range [start, end) of ``what`` out of the saved pieces into ``target``."""
    covered = 0
    for _, s, e, values in pieces:
        lo, hi = max(s, start), min(e, end)
        if lo < hi:
            target[lo - start : hi - start].copy_(values[lo - s : hi - s])
            covered += hi - lo
    if covered != end - start:
        raise CheckpointError(f"{what}: the checkpoint holds {covered} of the {end - start} elements this rank needs")


def entries(first: int, last: int, pieces: List[Piece], what: str) -> Any:
    """Entries ``[first, last)`` of per-block state joined from the saved pieces: a tensor
    (concatenated along dim 0) or a list, like the saved values."""
    parts, covered = [], 0
    for _, s, e, values in sorted(pieces, key=lambda piece: piece[1]):
        lo, hi = max(s, first), min(e, last)
        if lo < hi:
            parts.append(values[lo - s : hi - s])
            covered += hi - lo
    if covered != last - first:
        raise CheckpointError(f"{what}: the checkpoint holds {covered} of the {last - first} blocks this rank needs")
    sample = pieces[0][3]
    if torch.is_tensor(sample):
        return torch.cat(parts) if parts else sample[:0].clone()
    return [entry for part in parts for entry in part]


# ---- other frameworks' directories -------------------------------------------------------------


def _deepspeed_tag_dir(path: str) -> bool:
    """Whether ``path`` holds a DeepSpeed model-states file (a ``save_checkpoint`` tag directory)."""
    return os.path.isdir(path) and any(n.endswith("model_states.pt") for n in os.listdir(path))


def other_checkpoint(path: str) -> Optional[str]:
    """If ``path`` is not itself a vescale-zero checkpoint but something a user may take for
    one -- a DeepSpeed, FSDP2 (DCP) or Megatron checkpoint, or a directory of our own
    checkpoints -- what it is and the command to use instead; ``None`` otherwise."""
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        try:
            with open(os.path.join(path, METADATA_FILE)) as f:
                meta = json.load(f)
        except ValueError:
            return None  # ours or not, read_metadata names the corrupt file
        if isinstance(meta, dict) and "sharded_backend" in meta:
            return (f"{path!r} is a Megatron torch_dist checkpoint, not a vescale-zero one: convert it first with "
                    f"`vescale-zero convert --from megatron {path} DST`, then use DST")
        return None
    if is_dcp_checkpoint(path):
        return (f"{path!r} is a DCP (PyTorch FSDP2) checkpoint, not a vescale-zero one: convert it first with "
                f"`vescale-zero convert --from fsdp2 {path} DST`, then use DST")
    if _deepspeed_tag_dir(path):
        parent, tag = os.path.split(os.path.normpath(path))
        return (f"{path!r} is a DeepSpeed checkpoint (tag {tag!r}), not a vescale-zero one: convert it first with "
                f"`vescale-zero convert --from deepspeed {parent or '.'} DST --tag {tag}`, then use DST")
    tag = latest_tag(path)
    if tag is not None and _deepspeed_tag_dir(os.path.join(path, tag)):
        return (f"{path!r} is a DeepSpeed save directory (latest tag {tag!r}), not a vescale-zero checkpoint: "
                f"convert it first with `vescale-zero convert --from deepspeed {path} DST`, then use DST")
    if tag is not None and os.path.exists(os.path.join(path, tag, METADATA_FILE)):
        return (f"{path!r} is a directory of checkpoints, not one checkpoint: its latest is "
                f"{os.path.join(path, tag)!r}")
    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        return (f"{path!r} is a Megatron save directory, not a vescale-zero checkpoint: convert it first with "
                f"`vescale-zero convert --from megatron {path} DST`, then use DST")
    return None


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a bare ``torch.distributed.checkpoint`` directory, as FSDP2 jobs
    write them (Megatron's ``torch_dist`` ones have a ``metadata.json`` of their own)."""
    return os.path.isfile(os.path.join(path, ".metadata")) and not os.path.exists(os.path.join(path, METADATA_FILE))


def read_dcp(src: str) -> Dict[str, Any]:
    """Every tensor of the DCP directory ``src``, whole, read in this process with DCP's
    own reader (as ``dcp_to_torch_save`` does); no process group needed."""
    from torch.distributed.checkpoint import FileSystemReader

    state: Dict[str, Any] = {}
    read_dcp_state_dict(state, FileSystemReader(src))
    return state
