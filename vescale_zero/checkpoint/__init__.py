r"""Sharded checkpoints of ``fully_shard`` models: each rank writes only its own pieces.

Who imports whom (arrows point at what a module imports; sources.py also imports format.py;
the middle row imports only format.py and core modules, never each other)::

                  sources.py        load (ours, or a DCP checkpoint converted on the fly),
                 /     |     \      convert (vescale-zero convert --from ...)
                v      v      v
    sharded.py   convert.py   convert_megatron.py   consolidate.py
    save/load    FSDP2, DS    Megatron torch_dist   ours -> one
    live models  -> ours      -> ours               full state dict
           \          |            |                  /
            '---------+------------+-----------------'
                                   v
                  format.py         the on-disk format: layout, files, checksums,
                                    pieces, errors, latest pointers
"""

from .consolidate import consolidate
from .convert import from_deepspeed, from_fsdp2
from .convert_megatron import from_megatron
from .format import CheckpointError, read_latest, write_latest
from .sharded import managed_pieces, save
from .sources import load

__all__ = [
    "save", "load", "consolidate", "from_fsdp2", "from_deepspeed", "from_megatron", "managed_pieces",
    "CheckpointError", "read_latest", "write_latest",
]
