"""A small GPT and a deterministic corpus, shared by the examples, benchmarks and tests."""

from .corpus import SyntheticCorpus
from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "SyntheticCorpus"]
