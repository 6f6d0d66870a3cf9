"""Layer 3, what users call on a sharded model: ``fully_shard``, the module's FSDP2 methods, full
parameters for a while, state dicts, clipping, materialisation, reports. Re-exported by
``vescale_zero/__init__.py``; imports the runtime and the primitives below it."""
