"""Megatron-Core adapter: a `VeScaleFSDP` data-parallel wrapper (in progress, see issue 4)."""
