"""The scripts a DeepSpeed checkpoint directory carries, for a ragged engine's checkpoints.

DeepSpeed's engine copies its ``zero_to_fp32.py`` and ``zero_to_torch.py`` into every checkpoint
directory it saves; users run them to get the model's fp32 weights without DeepSpeed's engine,
and call ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(dir)`` in
Python. For a ragged checkpoint:

* ``zero_to_fp32.py`` is :mod:`.zero_to_fp32` (DeepSpeed's converter reading the ragged shards,
  the same command line and output files); ``zero_to_torch.py`` is DeepSpeed's own, which
  imports the ``zero_to_fp32.py`` beside it;
* ``import vescale_zero.integrations.deepspeed`` routes the reading step of the imported
  ``deepspeed.utils.zero_to_fp32`` (``host_patches.install("deepspeed.zero_to_fp32")``), so its
  functions read ragged checkpoints in this process.

[Note: ds_to_universal on a ragged checkpoint]
DeepSpeed's ``ds_to_universal`` (run as a script, so nothing of ours is loaded in its process)
turns a ZeRO checkpoint into one that loads at any world size. A ragged checkpoint needs no such
conversion -- it reshards itself -- and has none of the files the script reads. The first one it
reads is ``*_optim_states.pt`` (with ``torch.load(weights_only=False)``, to learn the ZeRO stage),
so each tag directory of a ragged engine holds :data:`NOTICE`, whose unpickling raises
``vescale_zero.checkpoint.CheckpointError`` with the explanation, one line: the script stops with
it instead of "can't find *_optim_states.pt files". Nothing else reads that file.
"""

from __future__ import annotations

import importlib
import os
import shutil
import stat

import torch

from vescale_zero.hosts import refuse

from . import zero_to_fp32

__all__ = ["write_recovery_scripts", "write_universal_notice", "NOTICE"]

NOTICE = "ragged_checkpoint_reshards_itself_not_zero_optim_states.pt"
"""The notice file of every ragged tag directory ([Note: ds_to_universal on a ragged checkpoint])."""


class _Notice:
    """Pickled as a call of ``vescale_zero.checkpoint.format.refuse(message)``."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self):
        return refuse, (self.message,)


def write_universal_notice(tag_dir: str) -> None:
    """Write :data:`NOTICE` into ``tag_dir`` (rank 0): see [Note: ds_to_universal on a ragged checkpoint]."""
    message = (f"{tag_dir} is a vescale-zero \"stage\": \"ragged\" checkpoint, which needs no universal conversion: "
               "it reshards itself (engine.load_checkpoint under stage 'ragged' loads it at any world size); for "
               "the full fp32 weights run the zero_to_fp32.py beside it, or `vescale-zero consolidate`")
    torch.save(_Notice(message), os.path.join(tag_dir, NOTICE))


def _executable(path: str) -> None:
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    except OSError:  # a file share that refuses the mode: the script still runs with ``python``
        pass


def write_recovery_scripts(save_dir: str) -> None:
    """Write ``zero_to_fp32.py`` (ours) and DeepSpeed's ``zero_to_torch.py`` into ``save_dir`` (rank 0)."""
    host = os.path.join(os.path.dirname(importlib.import_module("deepspeed").__file__), "utils", "zero_to_torch.py")
    copies = [(zero_to_fp32.__file__, "zero_to_fp32.py")] + ([(host, "zero_to_torch.py")] if os.path.isfile(host)
                                                              else [])
    for src, name in copies:
        dst = os.path.join(save_dir, name)
        shutil.copyfile(src, dst)
        _executable(dst)
