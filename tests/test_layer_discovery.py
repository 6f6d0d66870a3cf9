"""Layers found wherever a model holds them (layer_discovery [Note: finding the layers]).

A GPT whose blocks sit in an ``nn.Sequential`` (or an ``nn.ModuleDict``) is sharded block by block
like the same GPT with an ``nn.ModuleList``, by ``fully_shard_layers`` and by DeepSpeed's
``"stage": "ragged"``: the same groups, the same all-gathers and bytes per step (the sharding
report), the same losses. Before, such a model was one group, gathered whole by every forward.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_cases_on_ranks
from vescale_zero.api.layer_discovery import find_layer_classes
from vescale_zero.testing.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2)


class SequentialGPT(GPT):
    """The same GPT, its blocks in an ``nn.Sequential`` (same place in the module order)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.Sequential(*self.blocks)


class DictGPT(GPT):
    """The same GPT, its blocks in an ``nn.ModuleDict``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleDict({f"layer{i}": b for i, b in enumerate(self.blocks)})

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # GPT.forward's math
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks.values():
            h = block(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def test_layer_classes_wherever_the_blocks_are_held():
    for model in (GPT(CFG), SequentialGPT(CFG), DictGPT(CFG)):
        assert find_layer_classes(model) == ["Block"], type(model).__name__
    # blocks as a Sequential's children beside other modules; each block's MLP repeats Linear inside it
    class MLPBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    flat = nn.Sequential(nn.Embedding(8, 4), MLPBlock(), MLPBlock(), nn.LayerNorm(4), nn.Linear(4, 8))
    assert find_layer_classes(flat) == ["MLPBlock"]


def test_a_model_that_repeats_nothing_is_warned_about():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

    with pytest.warns(UserWarning, match=r"repeats no module.*layer_classes=\['MyBlock'\].*sharded_modules"):
        assert find_layer_classes(Net()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_layer_classes(nn.Linear(4, 4)) == []  # one module: one group is all there is


def _batches(steps: int, rank: int, world: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2 * world, CFG.seq_len), generator=g)
        out.append((x[2 * rank:2 * rank + 2], torch.roll(x, -1, dims=1)[2 * rank:2 * rank + 2]))
    return out


def _report(model: nn.Module) -> tuple:
    import vescale_zero as vz

    r = vz.sharding_report(model)
    return r.num_groups, r.all_gathers, r.bytes_all_gathered, r.reduce_scatters, r.bytes_reduce_scattered


def _fully_shard_layers(rank: int, world: int, cls_name: str) -> dict:
    import vescale_zero as vz

    model = vz.fully_shard_layers({"GPT": GPT, "SequentialGPT": SequentialGPT, "DictGPT": DictGPT}[cls_name](CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(2, rank, world):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"report": _report(model), "losses": losses}


def _deepspeed_ragged(rank: int, world: int, cls_name: str) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 40 s JIT build on CPU
    import vescale_zero.integrations.deepspeed  # noqa: F401  (registers stage "ragged")

    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": "ragged"}}
    model = {"GPT": GPT, "SequentialGPT": SequentialGPT}[cls_name](CFG)
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    losses = []
    for x, y in _batches(2, rank, world):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"report": _report(engine.module), "losses": losses}


@pytest.mark.parametrize("world", [2, 3])
def test_blocks_outside_a_module_list_are_sharded_block_by_block(world):
    cases = {f"{fn.__name__}:{c}": (fn, (c,)) for fn, classes in
             ((_fully_shard_layers, ("GPT", "SequentialGPT", "DictGPT")), (_deepspeed_ragged, ("GPT", "SequentialGPT")))
             for c in classes}
    if world == 3:  # the DeepSpeed path once is enough
        cases = {k: v for k, v in cases.items() if k.startswith("_fully")}
    results = run_cases_on_ranks(cases, world)
    for runner in ("_fully_shard_layers", "_deepspeed_ragged"):
        if f"{runner}:GPT" not in results:
            continue
        for rank, ref in enumerate(results[f"{runner}:GPT"]):
            assert ref["report"][0] == CFG.n_layers + 1, ref["report"]  # a group per block, and the root
            for other in ("SequentialGPT", "DictGPT"):
                if f"{runner}:{other}" not in results:
                    continue
                got = results[f"{runner}:{other}"][rank]
                assert got["report"] == ref["report"], (runner, other, rank, got["report"], ref["report"])
                assert got["losses"] == ref["losses"], (runner, other, rank)  # the same groups: the same math
