"""Adapters that plug vescale-zero into host frameworks (DeepSpeed, Megatron-Core)."""
