#!/usr/bin/env python
"""zero_to_fp32.py of a "stage": "ragged" DeepSpeed checkpoint: DeepSpeed's converter, reading ragged shards.

DeepSpeed's engine writes its ``zero_to_fp32.py`` into every checkpoint directory; the ragged
engine writes this file there instead (and DeepSpeed's ``zero_to_torch.py``, which imports this
one). Run it as DeepSpeed's, with the same command line and the same output files::

    python CHECKPOINT_DIR/zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                                          [--max_shard_size 5GB] [--exclude_frozen_parameters]

It runs DeepSpeed's own converter (``deepspeed.utils.zero_to_fp32``) with its one reading step,
``_get_fp32_state_dict_from_zero_checkpoint(tag_dir, exclude_frozen_parameters)``, answered by
:func:`vescale_zero.checkpoint.consolidate` for a ragged checkpoint (what
``vescale-zero consolidate CHECKPOINT_DIR/TAG model.safetensors`` writes). In a training process,
``import vescale_zero.integrations.deepspeed`` routes ``deepspeed.utils.zero_to_fp32``'s reading
step the same way (``get_fp32_state_dict_from_zero_checkpoint``, ``load_state_dict_from_zero_checkpoint``).
Checked against DeepSpeed 0.19.8.

This file runs as a script: it imports only ``vescale_zero`` modules (no relative imports).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import types
from typing import Any, Callable, Dict, List, Optional

from vescale_zero import host_patches
from vescale_zero.checkpoint import consolidate
from vescale_zero.hosts import METADATA_FILE

__all__ = ["is_ragged_checkpoint", "ragged_reader", "host_converter", "main"]

def is_ragged_checkpoint(tag_dir: str) -> bool:
    """Whether ``tag_dir`` is a checkpoint of ``vescale_zero.checkpoint.save`` (a ragged engine's tag)."""
    return os.path.isfile(os.path.join(tag_dir, METADATA_FILE))


# host patch deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
def ragged_reader(original: Callable[..., Dict[str, Any]]) -> Callable[..., Dict[str, Any]]:
    """DeepSpeed's reading step ``original``, answering ragged checkpoints with the consolidator
    (fp32 master weights and buffers, tied parameters under every name)."""

    @functools.wraps(original)
    def read(ds_checkpoint_dir: str, exclude_frozen_parameters: bool) -> Dict[str, Any]:
        if not is_ragged_checkpoint(ds_checkpoint_dir):
            return original(ds_checkpoint_dir, exclude_frozen_parameters)
        return consolidate(ds_checkpoint_dir, exclude_frozen=exclude_frozen_parameters)

    return read


def host_converter() -> types.ModuleType:
    """DeepSpeed's ``deepspeed.utils.zero_to_fp32``, its reading step routed to :func:`ragged_reader`
    (``vescale_zero.host_patches.install("deepspeed.zero_to_fp32")``)."""
    try:
        module = importlib.import_module("deepspeed.utils.zero_to_fp32")
    except ImportError as e:
        raise ImportError("zero_to_fp32.py of a ragged checkpoint runs DeepSpeed's converter: install deepspeed, "
                          "or join the checkpoint without it: "
                          "vescale-zero consolidate CHECKPOINT_DIR/TAG model.safetensors") from e
    host_patches.install("deepspeed.zero_to_fp32")
    return module


def __getattr__(name: str) -> Any:
    """DeepSpeed's names (``OUTPUT_DTYPE_NAMES``, ``convert_zero_checkpoint_to_state_dict``, ...): its
    ``zero_to_torch.py`` beside this file imports this file as ``zero_to_fp32``."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(host_converter(), name)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description="Join a \"stage\": \"ragged\" DeepSpeed checkpoint into fp32 PyTorch weights (DeepSpeed's "
                    "converter and output files; `vescale-zero consolidate CHECKPOINT_DIR/TAG OUT` does the same "
                    "without DeepSpeed)")
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (it holds the tag directories)")
    parser.add_argument("output_dir", help="where the weights files go")
    parser.add_argument("--max_shard_size", default="5GB", help="the largest weights file before it is split")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the 'latest' file's)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's debug prints")
    args = parser.parse_args(argv)
    host = host_converter()
    # host patch deepspeed.utils.zero_to_fp32.debug: checked against deepspeed 0.16.9-0.19.8
    host_patches.assign("deepspeed.utils.zero_to_fp32.debug", args.debug)  # what DeepSpeed's own -d sets
    host.convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
