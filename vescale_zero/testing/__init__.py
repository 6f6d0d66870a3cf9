"""A small GPT and a deterministic corpus, shared by the examples, benchmarks, tests and the GPU check
(which also share ``llama``, ``sharding``, ``copy_overhead`` and ``live_bytes`` with the benchmarks)."""

from .corpus import SyntheticCorpus
from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "SyntheticCorpus"]
