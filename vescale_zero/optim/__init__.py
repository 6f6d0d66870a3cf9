"""Structure-aware optimizers: they need whole blocks on one rank, and declare the granularity."""

from .adamw8bit import AdamW8bit
from .muon import Muon
from .shampoo import Shampoo

__all__ = ["AdamW8bit", "Muon", "Shampoo"]
