"""Test models with awkward shapes, and the unsharded reference training loop."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vescale_zero as vz

__all__ = ["AwkwardLM", "make_batches", "rank_slice", "train_reference", "local_pieces", "assemble", "VOCAB", "SEQ",
           "train_steps", "record_reduce_scatters"]

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 5  # primes: no shape divides evenly by 2, 3 or 4


class AwkwardBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.gate = nn.Parameter(torch.randn(DIM) * 0.1 + 1.0, requires_grad=False)  # frozen
        self.register_buffer("scale", torch.tensor(0.5))  # a buffer: left alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.gate * self.fc2(F.gelu(self.fc1(self.norm(x))))


class AwkwardLM(nn.Module):
    """Embedding (tied with the head), positions, two blocks, final norm."""

    def __init__(self, seed: int = 0, n_blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(AwkwardBlock() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def make_batches(steps: int, global_batch: int, seed: int = 1) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def rank_slice(batch: tuple, rank: int, world_size: int) -> tuple:
    n = batch[0].shape[0] // world_size
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def train_reference(
    model: nn.Module, batches: List[tuple], *, lr: float = 1e-2, clip: Optional[float] = None,
    accum: int = 1,
) -> Dict[str, object]:
    """Single process, whole global batch: the numbers every sharded run must reproduce.

    Runs on one intra-op thread, like the test ranks: the thread count changes the order
    of CPU reductions (e.g. a bias gradient's sum over the batch), hence the last bits.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(copy.deepcopy(model), batches, lr, clip, accum)
    finally:
        torch.set_num_threads(threads)


def _train_reference(model, batches, lr, clip, accum):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    losses = []
    for batch in batches:
        micro = [tuple(t.chunk(accum)[i] for t in batch) for i in range(accum)]
        total = 0.0
        for x, y in micro:
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def local_pieces(model) -> Dict[str, tuple]:
    """{full name: (shape, start, end, local values)} for every managed parameter."""
    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, vz.RaggedFSDPModule) or module.vescale_group is None:
            continue
        group = module.vescale_group
        for i, m in enumerate(group.managed):
            start, end = group.master.local_range(i)
            name = f"{prefix}.{m.fqn}" if prefix else m.fqn
            out[name] = (tuple(m.shape), start, end, group.sharded_params[i].to_local().detach().clone())
    return out


def assemble(per_rank: List[Dict[str, tuple]]) -> Dict[str, torch.Tensor]:
    full = {}
    for name, (shape, *_rest) in per_rank[0].items():
        numel = int(torch.Size(shape).numel())
        flat = torch.zeros(numel, dtype=per_rank[0][name][3].dtype)
        hits = torch.zeros(numel, dtype=torch.int32)
        for pieces in per_rank:
            _, start, end, values = pieces[name]
            flat[start:end] = values
            hits[start:end] += 1
        assert torch.all(hits == 1), f"{name}: ranks do not cover every element exactly once: {hits.tolist()}"
        full[name] = flat.view(shape)
    return full


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batches, after_backward: Optional[Callable] = None):
    """One step per local ``(x, y)`` batch: forward, backward, ``after_backward()``, optimizer
    step; returns the losses averaged over the ranks."""
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
    return losses


@contextlib.contextmanager
def record_reduce_scatters(groups) -> Iterator[List[int]]:
    """Within: every reduce-scatter a DBuffer runs is recorded as the index (in ``groups``) of
    the group whose full gradients it reduces (-1 for none of them)."""
    import vescale_zero.primitives.dbuffer as dbuffer_module

    real, sequence = dbuffer_module.reduce_scatter, []

    def spy(shard, full, *args, **kwargs):
        storage = full.untyped_storage()._cdata
        owners = [i for i, g in enumerate(groups) if storage == g.grads.full.full.untyped_storage()._cdata]
        sequence.append(owners[0] if owners else -1)
        return real(shard, full, *args, **kwargs)

    dbuffer_module.reduce_scatter = spy
    try:
        yield sequence
    finally:
        dbuffer_module.reduce_scatter = real
