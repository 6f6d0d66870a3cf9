"""Sharded checkpoints of ``fully_shard`` models: each rank writes only its own pieces."""

from .consolidate import consolidate
from .convert import from_deepspeed, from_fsdp2
from .convert_megatron import from_megatron
from .sharded import CheckpointError, load, managed_pieces, read_latest, save, write_latest

__all__ = ["save", "load", "consolidate", "from_fsdp2", "from_deepspeed", "from_megatron", "managed_pieces", "CheckpointError", "read_latest", "write_latest"]
