"""Tensor parallelism composed with ``fully_shard`` as torchtitan composes it (issue 39, item 9).

One spawn of 4 gloo ranks runs every case. The world mesh is ``("dp", "tp")`` = (2, 2) (3-D
``("replicate", "shard", "tp")`` = (2, 1, 2) for HSDP x TP); ``parallelize_module`` on the tp
dimension, then ``fully_shard(block, mesh=world["dp"])`` and ``fully_shard(model, ...)``, beside
PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same mesh and the unsharded model
trained on the whole batch (each dp index trains on its half; tp peers on the same half).
Vocabulary 38, hidden 22 (TP-local 19 and 11 rows: the dp split is uneven), width 13:

  mlp        ColwiseParallel / RowwiseParallel on each block's MLP (the rest plain), element
             granularity, 3 steps of foreach AdamW: equal to FSDP2 bit for bit and to the
             unsharded model within 1e-6; vz.clip_grad_norm_'s total norm (over dp and tp) equals
             the unsharded one each step; full_tensor(), redistribute(Replicate), vz.full_state_dict
             are the whole tensors, and vz.load_full_state_dict loads them back exactly; a DCP
             checkpoint (model + AdamW state) is written, then a 4th step taken (the
             uninterrupted run).
  sp         every parameter a DTensor (RowwiseParallel embedding, SequenceParallel norms, sequence-
             sharded MLP, ColwiseParallel head), granularity "row" (rows of the TP-local tensor:
             every rank's piece holds whole ones), torch's clip_grad_norm_ clipping (0.5), fused
             AdamW: equal to FSDP2 and to the unsharded model within 1e-6, and the norms too.
  hsdp_tp    HSDP x TP: the mlp model on (replicate 2, shard 1, tp 2): equal to FSDP2's HSDP on the
             same mesh and to the unsharded model within 1e-6; then a fresh one loads the mlp
             checkpoint (written at shard size 2) exactly and its 4th step equals the uninterrupted
             run's within 1e-6.
  fsdp2_load the same checkpoint loaded into FSDP2's 2x2 model: its weights and AdamW moments
             are exactly the saved ones.
  refusals   what is not supported says so on every rank: no data-parallel mesh, an FP8 gather,
             Muon, vescale_zero.checkpoint, gathered_parameters, a mesh from another world mesh.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.test_hsdp import _expect_error
from vescale_zero.api.clip_grad import sharded_grad_norm
from vescale_zero.optim import Muon
from vescale_zero.primitives.granularity import row_numel

VOCAB, DIM, HIDDEN, SEQ = 38, 13, 22, 6  # tp = 2 splits VOCAB, HIDDEN and SEQ; dp = 2 splits TP-local pieces unevenly
BATCH, STEPS, LR, CLIP = 8, 3, 1e-2, 0.5
TOL = 1e-6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class LM(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).reshape(-1, VOCAB).float(), targets.reshape(-1))


def _parallelize(model: LM, tp_mesh, sequence_parallel: bool) -> None:
    if sequence_parallel:  # torchtitan's plan: activations sharded on the sequence between the blocks
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.blocks:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        if sequence_parallel:
            plan = {"norm": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
                    "fc2": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(block, tp_mesh, plan)


def _build(shard, world_mesh, dp_mesh, sequence_parallel=False, seed=0, cls=None, **kwargs) -> LM:
    """An LM (``cls``, a subclass of it) parallelized over ``world_mesh["tp"]`` and sharded by ``shard``
    (ours or FSDP2's) over ``dp_mesh``."""
    model = (cls or LM)(seed)
    _parallelize(model, world_mesh["tp"], sequence_parallel)
    for block in model.blocks:
        shard(block, mesh=dp_mesh, **kwargs)
    return shard(model, mesh=dp_mesh, **kwargs)


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def _whole(model: nn.Module) -> dict:
    """Every parameter's whole tensor (collective: the same order on every rank)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _value(norm) -> float:
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _train(model, opt, batches, index, clip=None, norms=None):
    """Steps on this data-parallel ``index``'s half of each batch; ``clip(model)`` after backward
    returns the gradient norm (recorded in ``norms``)."""
    for tokens, targets in batches:
        model(tokens.chunk(2)[index], targets.chunk(2)[index]).backward()
        if clip is not None:
            norms.append(_value(clip(model)))
        opt.step()
        opt.zero_grad()


def _reference(batches, clip=None, fused=False):
    """The unsharded LM trained on the whole batches: ``(whole weights, norms)``."""
    ref = LM()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=fused)
    norms: list = []
    for tokens, targets in batches:
        ref(tokens, targets).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return _whole(ref), norms


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _moments(opt) -> list:
    return [opt.state[p][k].full_tensor() for g in opt.param_groups for p in g["params"]
            for k in ("exp_avg", "exp_avg_sq")]


def _world():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _mlp_case(rank, world_size, path):
    mesh = _world()
    dp = mesh["dp"].get_local_rank()
    batches = _batches(STEPS + 1)
    out = {}
    ours = _build(vz.fully_shard, mesh, mesh["dp"])
    opt = torch.optim.AdamW(ours.parameters(), lr=LR, foreach=True)
    norms: list = []
    _train(ours, opt, batches[:STEPS], dp, lambda m: vz.clip_grad_norm_(m, 1e9), norms)
    fsdp2 = _build(fsdp2_fully_shard, mesh, mesh["dp"])
    fsdp2_opt = torch.optim.AdamW(fsdp2.parameters(), lr=LR, foreach=True)
    _train(fsdp2, fsdp2_opt, batches[:STEPS], dp)
    out["ours"], out["fsdp2"] = _whole(ours), _whole(fsdp2)
    out["ref"], out["ref_norms"] = _reference(batches[:STEPS], clip=1e9)
    out["norms"] = norms
    out["placements"] = {n: (tuple(map(repr, p.placements)), tuple(p.shape)) for n, p in ours.named_parameters()}
    weight = ours.blocks[0].fc2.weight  # RowwiseParallel: Shard(1) on tp
    out["redistribute"] = torch.equal(weight.redistribute(weight.device_mesh, [Replicate(), Replicate()]).to_local(),
                                      out["ours"]["blocks.0.fc2.weight"])
    full = vz.full_state_dict(ours)
    out["full_state_dict"] = _diff({k: full[k] for k in out["ours"]}, out["ours"])
    fresh = _build(vz.fully_shard, mesh, mesh["dp"], seed=5)
    vz.load_full_state_dict(fresh, full)
    out["load_full_state_dict"] = _diff(_whole(fresh), out["ours"])
    model_sd, optim_sd = get_state_dict(ours, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    out["saved_moments"] = _moments(opt)
    _train(ours, opt, batches[STEPS:], dp)  # the uninterrupted run's next step
    out["step4"] = _whole(ours)
    return out


def _sp_case(rank, world_size):
    mesh = _world()
    dp = mesh["dp"].get_local_rank()
    batches = _batches(STEPS)
    out = {}
    ours = _build(vz.fully_shard, mesh, mesh["dp"], sequence_parallel=True, granularity="row")
    opt = torch.optim.AdamW(ours.parameters(), lr=LR, fused=True)
    out["norms"], out["vz_norms"] = [], []

    def clip(model):
        out["vz_norms"].append(float(sharded_grad_norm(model)))
        return torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)

    _train(ours, opt, batches, dp, clip, out["norms"])
    # [Note: ragged inside the tensor-parallel piece]: each piece is whole rows of the TP-local tensor
    unsharded = LM()
    _parallelize(unsharded, mesh["tp"], sequence_parallel=True)
    rows = {n: row_numel(p.to_local().shape) for n, p in unsharded.named_parameters()}
    out["rows"] = {n: (p.ragged_placement.granularity, *p.local_range, rows[n]) for n, p in ours.named_parameters()}
    fsdp2 = _build(fsdp2_fully_shard, mesh, mesh["dp"], sequence_parallel=True)
    fsdp2_opt = torch.optim.AdamW(fsdp2.parameters(), lr=LR, fused=True)
    out["fsdp2_norms"] = []
    _train(fsdp2, fsdp2_opt, batches, dp, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP),
           out["fsdp2_norms"])
    out["ours"], out["fsdp2"] = _whole(ours), _whole(fsdp2)
    out["ref"], out["ref_norms"] = _reference(batches, clip=CLIP, fused=True)
    return out


def _hsdp_tp_case(rank, world_size, path):
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    replica = mesh["replicate"].get_local_rank()
    dp_mesh = mesh["replicate", "shard"]
    batches = _batches(STEPS + 1)
    out = {}
    ours = _build(vz.fully_shard, mesh, dp_mesh)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    _train(ours, opt, batches[:STEPS], replica)
    fsdp2 = _build(fsdp2_fully_shard, mesh, dp_mesh)
    fsdp2_opt = torch.optim.AdamW(fsdp2.parameters(), lr=LR)
    _train(fsdp2, fsdp2_opt, batches[:STEPS], replica)
    out["ours"], out["fsdp2"] = _whole(ours), _whole(fsdp2)
    out["ref"], _ = _reference(batches[:STEPS])
    # resume the 2x2 checkpoint at shard size 1 (tp kept), and take its 4th step
    resumed = _build(vz.fully_shard, mesh, dp_mesh, seed=9)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR, foreach=True)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["loaded"], out["loaded_moments"] = _whole(resumed), _moments(resumed_opt)
    _train(resumed, resumed_opt, batches[STEPS:], replica)
    out["step4"] = _whole(resumed)
    return out


def _fsdp2_load_case(rank, world_size, path):
    mesh = _world()
    model = _build(fsdp2_fully_shard, mesh, mesh["dp"], seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"loaded": _whole(model), "loaded_moments": _moments(opt)}


def _refusals_case(rank, world_size, path):
    """Each refusal raises on this rank, naming the way out (every rank runs the same checks)."""
    mesh = _world()

    def tp_block():
        block = Block()
        parallelize_module(block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        return block

    _expect_error(lambda: vz.fully_shard(tp_block()), "mesh=world['dp']")
    _expect_error(lambda: vz.fully_shard(tp_block(), mesh=mesh["dp"], fp8_all_gather_tile=4), "fp8_all_gather_tile",
                  "tensor-parallel")
    other = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    _expect_error(lambda: vz.fully_shard(tp_block(), mesh=other), "same world mesh")
    model = _build(vz.fully_shard, mesh, mesh["dp"])
    tokens, targets = _batches(1)[0]
    model(tokens, targets).backward()
    _expect_error(lambda: Muon(model.parameters(), lr=LR).step(), "tensor-parallel", "torch.optim")
    _expect_error(lambda: vz.checkpoint.save(os.path.join(path, "ours"), model), "torch.distributed.checkpoint")
    _expect_error(lambda: vz.gathered_parameters(model.blocks[0].fc1.weight).__enter__(), "full_tensor()")


@pytest.mark.slow
def test_tensor_parallel_with_fully_shard(tmp_path):
    path = str(tmp_path / "dcp")
    cases = {"mlp": (_mlp_case, (path,)), "sp": (_sp_case, ()), "hsdp_tp": (_hsdp_tp_case, (path,)),
             "fsdp2_load": (_fsdp2_load_case, (path,)), "refusals": (_refusals_case, (str(tmp_path),))}
    results = run_cases_on_ranks(cases, 4, timeout=400)

    for r in results["mlp"]:
        assert r["placements"]["blocks.0.fc1.weight"] == (("RaggedShard(g=1, blocks=[136, 7])", "Shard(dim=0)"),
                                                           (HIDDEN, DIM)), r["placements"]
        assert r["placements"]["blocks.0.fc2.weight"][0][1] == "Shard(dim=1)"
        assert r["placements"]["embed.weight"][0][0].startswith("RaggedShard")  # plain: 1-D, as FSDP2 keeps it
        assert _diff(r["ours"], r["fsdp2"]) == 0.0, "the MLP-parallel run differs from FSDP2's"
        assert _diff(r["ours"], r["ref"]) <= TOL
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]), rtol=TOL, atol=0)
        assert r["redistribute"]
        assert r["full_state_dict"] == 0.0 and r["load_full_state_dict"] == 0.0

    for r in results["sp"]:
        assert all(n > CLIP for n in r["ref_norms"]), r["ref_norms"]  # clipping is active
        for name in ("norms", "vz_norms", "fsdp2_norms"):
            torch.testing.assert_close(torch.tensor(r[name]), torch.tensor(r["ref_norms"]), rtol=TOL, atol=0)
        for name, (granularity, start, end, row) in r["rows"].items():
            assert granularity == row and start % row == 0 == end % row, (name, granularity, start, end, row)
        assert _diff(r["ours"], r["fsdp2"]) <= TOL
        assert _diff(r["ours"], r["ref"]) <= TOL

    mlp = results["mlp"]
    for rank, r in enumerate(results["hsdp_tp"]):
        assert _diff(r["ours"], r["fsdp2"]) <= TOL
        assert _diff(r["ours"], r["ref"]) <= TOL
        assert _diff(r["loaded"], mlp[rank]["ours"]) == 0.0, "the checkpoint did not load exactly at shard size 1"
        assert all(torch.equal(a, b) for a, b in zip(r["loaded_moments"], mlp[rank]["saved_moments"]))
        assert _diff(r["step4"], mlp[rank]["step4"]) <= TOL

    for rank, r in enumerate(results["fsdp2_load"]):
        assert _diff(r["loaded"], mlp[rank]["ours"]) == 0.0, "FSDP2 did not load our checkpoint exactly"
        assert all(torch.equal(a, b) for a, b in zip(r["loaded_moments"], mlp[rank]["saved_moments"]))
