"""A deterministic synthetic corpus with structure a small model learns in a few dozen steps.

Each sequence interleaves a few fixed "phrases" (random token strings drawn once per
corpus) with noise tokens, so the next token is predictable inside a phrase and not
between them: the loss falls quickly from ln(vocab) and then levels off. Nothing is
downloaded; the same (seed, step) gives the same global batch everywhere.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["SyntheticCorpus"]


class SyntheticCorpus:
    def __init__(self, vocab_size: int, seq_len: int, n_phrases: int = 16, phrase_len: int = 8,
                 seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.phrases = torch.randint(0, vocab_size, (n_phrases, phrase_len), generator=g)

    def global_batch(self, step: int, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``[batch_size, seq_len]`` for ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n_phr, plen = self.phrases.shape
        reps = -(-(self.seq_len + 1) // (plen + 1))
        picks = torch.randint(0, n_phr, (batch_size, reps), generator=g)
        noise = torch.randint(0, self.vocab_size, (batch_size, reps, 1), generator=g)
        seq = torch.cat([self.phrases[picks], noise], dim=2).view(batch_size, -1)[:, : self.seq_len + 1]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def batch(self, step: int, batch_size: int, rank: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's equal share of the global batch of ``step``."""
        if batch_size % world_size:
            raise ValueError(f"global batch {batch_size} does not split evenly over {world_size} ranks")
        x, y = self.global_batch(step, batch_size)
        n = batch_size // world_size
        return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
