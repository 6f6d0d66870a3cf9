"""A stack of Llama-3-shaped decoder layers (no embedding or head), for memory measurements.

Used by ``benchmarks/memory.py`` and the GPU check (``python -m vescale_zero.gpu_check``): the
parameter shapes of Llama-3-8B's layers by default (hidden 4096, SwiGLU ffn 14336, 32 heads,
8 KV heads), so that a few layers stand for the sharding work of the whole model.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaShapedLayer", "LlamaShapedStack", "stack_layers"]


class LlamaShapedLayer(nn.Module):
    """A Llama-3 decoder layer's shapes: RMSNorm, grouped-query attention (no rotary: it holds
    no parameters), RMSNorm, SwiGLU MLP."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaShapedStack(nn.Module):
    """``n`` Llama-shaped layers; the loss is the mean square of the output (no embedding or head)."""

    def __init__(self, n: int, hidden: int = 4096, ffn: int = 14336, heads: int = 32, kv_heads: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaShapedLayer(hidden, ffn, heads, kv_heads) for _ in range(n))
        self.norm = nn.RMSNorm(hidden)

    def forward(self, x: torch.Tensor, _targets: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).float().pow(2).mean()


def stack_layers(model: LlamaShapedStack) -> List[nn.Module]:
    """The layers of ``model``: one sharding unit each."""
    return list(model.layers)
