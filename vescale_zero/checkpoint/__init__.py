r"""Sharded checkpoints of ``fully_shard`` models: each rank writes only its own pieces.

Who imports whom (arrows point at what a module imports; sources.py also imports format.py;
the middle row imports only format.py and core modules, never each other)::

                  sources.py        load (ours, or a DCP checkpoint converted on the fly)
                 /     |
                v      v
    sharded.py   convert.py      consolidate.py
    save/load    FSDP2 -> ours   ours -> one
    live models                  full state dict
           \          |             /
            '---------+------------'
                      v
                  format.py         the on-disk format: layout, files, checksums,
                                    pieces, errors, latest pointers

DeepSpeed's and Megatron's checkpoints are converted by their adapters
(``vescale_zero.integrations.deepspeed.from_deepspeed``,
``vescale_zero.integrations.megatron.from_megatron``; ``vescale-zero convert`` calls them). The
names ``vescale_zero.checkpoint.from_deepspeed`` / ``from_megatron`` stay for users' code: they
are looked up in the adapter when first used (:func:`__getattr__`), so importing this package
imports no host.
"""

import importlib
from typing import Any

from .consolidate import consolidate
from .convert import from_fsdp2
from .format import CheckpointError, read_latest, write_latest
from .sharded import managed_pieces, save
from .sources import load

__all__ = [
    "save", "load", "consolidate", "from_fsdp2", "from_deepspeed", "from_megatron", "managed_pieces",
    "CheckpointError", "read_latest", "write_latest",
]

_IN_ADAPTERS = {"from_deepspeed": "vescale_zero.integrations.deepspeed.checkpoint_conversion",
                "from_megatron": "vescale_zero.integrations.megatron.checkpoint_conversion"}


def __getattr__(name: str) -> Any:
    """``from_deepspeed`` / ``from_megatron``: the adapter's converter, imported on first use."""
    if name in _IN_ADAPTERS:
        return getattr(importlib.import_module(_IN_ADAPTERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
