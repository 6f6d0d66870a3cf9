"""Structure-aware optimizers (they need whole blocks on one rank, and declare the granularity), and
optimizer state kept in files, stepped group by group (:mod:`.state_files`)."""

from .adamw8bit import AdamW8bit
from .muon import Muon
from .shampoo import Shampoo
from .state_files import StateFileError, StateFiles, offload_state_to_files

__all__ = ["AdamW8bit", "Muon", "Shampoo", "StateFiles", "StateFileError", "offload_state_to_files"]
