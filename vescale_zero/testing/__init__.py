"""A small GPT and a deterministic corpus: what the quick start imports (also used by the examples,
benchmarks, tests and the GPU check). Test machinery lives outside the package, in ``tests/``."""

from .corpus import SyntheticCorpus
from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "SyntheticCorpus"]
