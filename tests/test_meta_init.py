"""Meta-device (deferred) initialisation: build on ``meta``, ``fully_shard``, materialise.

1. ``vz.materialize`` gives, bit for bit, the values of the eager model, and the same training
   (losses and parameters after AdamW steps, fp32, bit-exact): a model initialised in its
   leaf constructors against its eager construction; the test GPT, the awkward model and a
   tiny Hugging Face ``LlamaForCausalLM`` (rotary buffers included) against the eager model
   initialised by the same per-module function in module order. Tied weights stay tied.
2. FSDP2's recipe: ``to_empty`` allocates the shards only, then ``load_full_state_dict`` (and
   ``materialize`` for the non-persistent buffers) or ``materialize`` alone.
3. Peak memory while materialising (MemTracker): all shards + one group's full buffer.
4. Bad input: a module with no initialiser, materialising twice, loading into meta shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vescale_zero as vz
from tests.distributed import run_on_ranks
from tests.models import SEQ, VOCAB, AwkwardBlock, AwkwardLM
from tests.sweeps import sweep
from vescale_zero.api.fully_shard import groups_of
from vescale_zero.testing.gpt import GPT, GPTConfig

GPT_CFG = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2)
INIT_SEED, STEPS, ROWS = 7, 3, 6
LLAMA = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)  # tiny: rotary tables of head_dim 4


class LeafBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LeafLM(nn.Module):
    """Every parameter initialised by its own leaf module's constructor, in registration order."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(LeafBlock(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, VOCAB), targets.reshape(-1))


def gpt_init(m: nn.Module) -> None:
    """GPT's own scheme, module by module: zero positions, leaf defaults, N(0, 0.02) matrices."""
    if isinstance(m, GPT):
        nn.init.zeros_(m.pos)
        return
    m.reset_parameters()
    for p in m.parameters(recurse=False):
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)


def awkward_init(m: nn.Module) -> None:
    """AwkwardLM's scheme, module by module (its own parameters and its buffer included)."""
    if isinstance(m, AwkwardLM):
        m.pos.normal_(std=0.02)
    elif isinstance(m, AwkwardBlock):
        m.gate.normal_(1.0, 0.1)
        m.scale.fill_(0.5)
    else:
        m.reset_parameters()


def _llama_cls():
    from transformers import LlamaConfig, LlamaForCausalLM

    return lambda: LlamaForCausalLM(LlamaConfig(**LLAMA))


def _eager_reference(kind: str) -> nn.Module:
    """The unsharded eager model with the values materialize must give under INIT_SEED."""
    if kind == "leaf":  # plain eager construction
        torch.manual_seed(INIT_SEED)
        return LeafLM()
    model = _llama_cls()() if kind == "llama" else {"gpt": lambda: GPT(GPT_CFG), "awkward": AwkwardLM}[kind]()
    init = {"gpt": gpt_init, "awkward": awkward_init}.get(kind) or model._init_weights
    tied = kind in ("gpt", "awkward")
    if tied:  # initialise as built, then tie: head.weight = embed.weight (the constructors' order)
        model.head.weight = nn.Parameter(torch.empty_like(model.embed.weight))
    torch.manual_seed(INIT_SEED)
    with torch.no_grad():
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                init(m)
    if tied:
        model.head.weight = model.embed.weight
    return model


def _meta_model(kind: str) -> nn.Module:
    with torch.device("meta"):
        if kind == "llama":
            return _llama_cls()()
        return {"leaf": LeafLM, "gpt": lambda: GPT(GPT_CFG), "awkward": AwkwardLM}[kind]()


def _init_fn(kind: str, model: nn.Module):
    return {"leaf": None, "gpt": gpt_init, "awkward": awkward_init}.get(kind, getattr(model, "_init_weights", None))


def _loss(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss if kind == "llama" else model(x, y)


def _train(kind: str, model: nn.Module, rank: int, world_size: int):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        n = ROWS // world_size
        xs = x[rank * n:(rank + 1) * n]
        loss = _loss(kind, model, xs, torch.roll(xs, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}: {key!r} differs"


def _meta_equals_eager(rank: int, world_size: int, kinds) -> None:
    for kind in kinds:
        eager = _eager_reference(kind)
        meta = _meta_model(kind)
        vz.fully_shard_layers(meta)
        torch.manual_seed(INIT_SEED)
        vz.materialize(meta, init_fn=_init_fn(kind, meta), device="cpu")
        # every value, buffers (non-persistent rotary tables too) included, equals the eager model's
        _assert_same_state(vz.full_state_dict(meta), eager.state_dict(), f"{kind}: materialized vs eager")
        for (name, got), want in zip(meta.named_buffers(), eager.buffers()):
            assert torch.equal(got, want), f"{kind}: buffer {name}"
        if kind in ("gpt", "awkward"):  # tied: one parameter object in both owners
            assert meta.head.weight is meta.embed.weight
        # and trains exactly as the eager model sharded the same way
        vz.fully_shard_layers(eager)
        want_losses = _train(kind, eager, rank, world_size)
        got_losses = _train(kind, meta, rank, world_size)
        assert got_losses == want_losses, f"{kind}: losses {got_losses} vs {want_losses}"
        _assert_same_state(vz.full_state_dict(meta), vz.full_state_dict(eager), f"{kind}: after training")




def _llama(rank: int, world_size: int) -> None:
    _meta_equals_eager(rank, world_size, ("llama",))
    # FSDP2's recipe: to_empty, load_full_state_dict (no non-persistent rotary tables in it), then
    # materialize initialises exactly what is left: the rotary modules' buffers
    eager = _eager_reference("llama")
    meta = _meta_model("llama")
    vz.fully_shard_layers(meta)
    meta.to_empty(device="cpu")
    vz.load_full_state_dict(meta, eager.state_dict())
    called = []
    vz.materialize(meta, init_fn=lambda m: (called.append(type(m).__name__), meta._init_weights(m)))
    assert set(called) == {"LlamaRotaryEmbedding"}, called
    _assert_same_state(vz.full_state_dict(meta), eager.state_dict(), "llama: to_empty + load")
    for (name, got), want in zip(meta.named_buffers(), eager.buffers()):
        assert torch.equal(got, want), f"llama: buffer {name} after to_empty + load + materialize"


def _largest_group_bytes(model: nn.Module) -> int:
    return max(g.plan.global_size * g.master.local.element_size() for g in groups_of(model))


def _cpu_bytes(tracker, which: str) -> int:
    return tracker.get_tracker_snapshot(which).get(torch.device("cpu"), {}).get("Total", 0)


def _fsdp2_recipe(rank: int, world_size: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    # to_empty allocates only the shards (the parameters the modules hold are views into them)
    eager = _eager_reference("awkward")
    meta = _meta_model("awkward")
    vz.fully_shard_layers(meta)
    tracker = MemTracker()
    with tracker:
        meta.to_empty(device="cpu")
    shards, peak = _cpu_bytes(tracker, "current"), _cpu_bytes(tracker, "peak")
    full_model = sum(p.numel() * p.element_size() for p in eager.parameters())
    group_bytes = _largest_group_bytes(meta)
    # what to_empty made transiently (one group's full buffer, the shard-sized tensors it replaces) stays below
    # a group's full buffer plus its shard; never the whole model
    assert peak - shards <= group_bytes + group_bytes // world_size + 64, (peak, shards, group_bytes)
    assert group_bytes < full_model
    for group in groups_of(meta):
        local = group.master.local
        for p in group.sharded_params:
            storage = p.to_local().untyped_storage()
            assert p.device.type == "cpu" and storage.data_ptr() == local.untyped_storage().data_ptr()
    assert meta.head.weight is meta.embed.weight
    # ... then load a full state dict: the eager values, and the same training
    vz.load_full_state_dict(meta, eager.state_dict())
    _assert_same_state(vz.full_state_dict(meta), eager.state_dict(), "to_empty + load_full_state_dict")
    with pytest.raises(RuntimeError, match="nothing to initialise"):
        vz.materialize(meta, init_fn=awkward_init)  # everything loaded, the buffer included
    vz.fully_shard_layers(eager)
    assert _train("awkward", meta, rank, world_size) == _train("awkward", eager, rank, world_size)
    _assert_same_state(vz.full_state_dict(meta), vz.full_state_dict(eager), "to_empty + load, trained")

    # ... or initialise: to_empty then materialize equals the eager initialisation (buffers too)
    eager = _eager_reference("gpt")
    meta = _meta_model("gpt")
    vz.fully_shard_layers(meta)
    meta.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    vz.materialize(meta, init_fn=gpt_init)
    _assert_same_state(vz.full_state_dict(meta), eager.state_dict(), "to_empty + materialize")


def _peak_memory(rank: int, world_size: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=6, n_heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    vz.fully_shard_layers(model)
    tracker = MemTracker()
    with tracker:
        torch.manual_seed(INIT_SEED)
        vz.materialize(model, init_fn=gpt_init, device="cpu")
    shards, peak = _cpu_bytes(tracker, "current"), _cpu_bytes(tracker, "peak")
    full_model = sum(p.numel() * p.element_size() for p in GPT(cfg).parameters())
    persistent = sum(g.master.local.nbytes for g in groups_of(model))
    assert shards == persistent, (shards, persistent)  # what stays: the master shards
    assert all(g.grads.sharded.live is None for g in groups_of(model)), "no gradient shard before the first backward"
    group_bytes = _largest_group_bytes(model)
    assert group_bytes < full_model / 2
    assert peak <= shards + group_bytes, f"peak {peak} B > shards {shards} B + one group's full buffer {group_bytes} B"
    assert peak - shards < full_model


def _bad_input(rank: int, world_size: int) -> None:
    meta = _meta_model("awkward")
    vz.fully_shard_layers(meta)
    with pytest.raises(ValueError, match=r"'<root>' \(AwkwardLM: \['pos'\]\).*'blocks.0' \(AwkwardBlock: "
                                         r"\['gate', 'scale'\]\).*init_fn"):
        vz.materialize(meta, device="cpu")
    with pytest.raises(RuntimeError, match=r"to_empty\(device=...\)"):
        vz.load_full_state_dict(meta, _eager_reference("awkward").state_dict())
    with pytest.raises(ValueError, match="real device"):
        vz.materialize(meta, init_fn=awkward_init, device="meta")
    # the refusals changed nothing: materializing now still gives the eager values
    torch.manual_seed(INIT_SEED)
    vz.materialize(meta, init_fn=awkward_init, device="cpu")
    _assert_same_state(vz.full_state_dict(meta), _eager_reference("awkward").state_dict(), "after refusals")
    with pytest.raises(RuntimeError, match="nothing to initialise.*materialised or loaded before"):
        vz.materialize(meta, init_fn=awkward_init)
    eager = LeafLM()
    vz.fully_shard_layers(eager)
    with pytest.raises(RuntimeError, match="nothing to initialise"):
        vz.materialize(eager)


def _rank(rank: int, world_size: int) -> None:
    _meta_equals_eager(rank, world_size, ("leaf", "gpt", "awkward"))
    {1: _bad_input, 2: _peak_memory, 3: _fsdp2_recipe}[world_size](rank, world_size)


@pytest.mark.parametrize("world_size", sweep([1, 2, 3], quick=3))
def test_meta_init(world_size):
    """Every world size: materialize equals the eager values and training (1.). One spawn per
    world size also runs: 1 rank the bad input (4.), 2 ranks the peak memory (3.), 3 ranks
    FSDP2's recipe (2.)."""
    run_on_ranks(_rank, world_size)


@pytest.mark.slow
def test_meta_init_llama():
    """A tiny LlamaForCausalLM: materialize with its _init_weights (1.), and to_empty + load (2.)."""
    pytest.importorskip("transformers")
    run_on_ranks(_llama, 2)
