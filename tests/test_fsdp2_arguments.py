"""Every argument of FSDP2's ``fully_shard``, on ours and on FSDP2 with the same model (issue 47).

One spawn per world size (2 and 3 gloo ranks) runs every case; each builds the same ``Net`` (an
embedding, a Linear block, a norm and a head; tied or not) sharded by ours and by
``torch.distributed.fsdp.fully_shard`` with the argument under test, trains both 3 SGD steps
(momentum 0.9) on this rank's slice of the same global batches, and compares the losses and
every parameter's whole value; the unsharded model on the whole batch is the third run.

  module list       ``fully_shard([norm, head])`` (one group of two modules), and
                    ``[embedding, norm, head]`` with the head tied to the embedding (torchtitan's
                    weight tying): fsdp2_arguments [Note: several modules as one group]
  shard_placement   ``shard_placement_fn`` returning None / Shard(0) / Shard(1) / an FSDP2
                    ``ShardPlacementResult`` on the same mesh: fsdp2_arguments
                    [Note: shard placements as blocks]; another placement or mesh is refused
  ignored_params    the norm's parameters left out: plain tensors, gradients not reduced (each
                    rank keeps its own), as FSDP2
  dp_mesh_dims      full-DTensor parameters (``distribute_module``) on a named mesh, DTensor inputs:
                    fsdp2_arguments [Note: full-DTensor parameters]
  mesh, mp_policy, reshard_after_forward, offload_policy   FSDP2's values of each, accepted with
                    its meaning (the mesh as a DeviceMesh, an fp32 policy, False, CPUOffloadPolicy)
  refusals          an unknown keyword names itself; a ModuleList / ModuleDict is refused with
                    FSDP2's message
  cast              ``model.to(torch.float64)`` after ``fully_shard``, the optimizer built before the
                    cast: recast [Note: a group cast after fully_shard]
  registration      between a forward and its backward the root's and ``reshard_after_forward=False``
                    modules' parameters are plain tensors, the others' DTensors; after backward or
                    ``reshard()`` all are DTensors again (FSDP2's registration)

Tolerances (as tests/test_torch_utilities.py): both FSDPs reduce the same per-rank gradients; at 2
ranks ``a + b`` is exact in any order, at 3 the reduce-scatter's order depends on the buffer's
layout (one rounding, 2**-24 of the sum of |terms|), and SGD is linear in the gradients: 1e-6
(atol and rtol) covers 3 steps of lr 0.1 with momentum 0.9 on |g| < 1 (at most 7.7e-7). The
unsharded model sums the batch in another order than the mean over ranks: the same bound.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

try:  # FSDP2's full-DTensor mode, from torch 2.12
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    DataParallelMeshDims = None
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

import vescale_zero as vz
from tests.distributed import run_cases_on_ranks
from tests.numerics import adam_divergence_bound
from tests.sweeps import sweep

# FSDP2's shard_placement_fn may name a mesh of its own from torch 2.12
HAS_SHARD_PLACEMENT_RESULT = hasattr(_fsdp_common, "ShardPlacementResult")
RTOL, ATOL = 1e-6, 1e-6
GLOBAL_BATCH, SEQ, VOCAB, DIM = 6, 5, 18, 12
STEPS = 3


class Net(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.block(h)
        return self.head(self.norm(h))


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


def _train(model: nn.Module, rank: int, world: int, sharded: bool, inputs: Callable = None) -> Dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in _batches():
        if sharded:
            batch = batch.chunk(world)[rank]
        tokens, labels = batch[:, :-1], batch[:, 1:]
        out = model(inputs(tokens) if inputs is not None else tokens)
        if isinstance(out, DTensor):  # full-DTensor mode: the batch is Shard(0) over the mesh
            out = out.to_local()
        loss = _loss(out, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if sharded:
        losses = [t.clone() for t in losses]
        for t in losses:
            dist.all_reduce(t)
            t /= world
    values = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "values": values}


def _three(rank: int, world: int, shard: Callable[[nn.Module, Callable], None], tie: bool = False,
           inputs: Callable = None) -> Dict[str, Dict[str, Any]]:
    """Ours and FSDP2 (``shard(model, fully_shard)``) and the unsharded model, trained alike."""
    out = {}
    for kind, fully_shard in (("ours", vz.fully_shard), ("fsdp2", fsdp2_fully_shard)):
        model = Net(tie)
        shard(model, fully_shard)
        out[kind] = _train(model, rank, world, True, inputs)
    out["ref"] = _train(Net(tie), rank, world, False)
    return out


def _outcome(fn: Callable) -> tuple:
    try:
        fn()
        return ("ok",)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return ("error", type(e).__name__, str(e))


# ---- the cases ---------------------------------------------------------------------------------
def module_list_case(rank, world):
    def grouped(model, fully_shard):
        fully_shard([model.norm, model.head])
        fully_shard(model.block)
        fully_shard(model)

    def tied(model, fully_shard):
        fully_shard(model.block)
        fully_shard([model.embed, model.norm, model.head])
        fully_shard(model)

    out = {"list": _three(rank, world, grouped), "tied": _three(rank, world, tied, tie=True)}
    model = Net()
    returned = vz.fully_shard([model.norm, model.head])
    vz.fully_shard(model)
    out["returned"] = returned == [model.norm, model.head] and model.norm.vescale_group is model.head.vescale_group
    root = Net()
    vz.fully_shard([root.norm, root.head])
    out["as root"] = _outcome(lambda: root.head(torch.zeros(2, DIM)))
    return out


def shard_placement_case(rank, world):
    mesh = init_device_mesh("cpu", (world,))

    def by(fn):
        def shard(model, fully_shard):
            fully_shard(model.block, mesh=mesh, shard_placement_fn=fn)
            fully_shard(model, mesh=mesh, shard_placement_fn=fn)
        return shard

    out = {
        "None": _three(rank, world, by(lambda p: None)),
        "Shard(0)": _three(rank, world, by(lambda p: Shard(0))),
        # FSDP2 needs dim 1 divisible by the world size: the 2-D parameters' dims are 12, 24, 18
        "Shard(1)": _three(rank, world, by(lambda p: Shard(1) if p.dim() == 2 else Shard(0))),
    }
    if HAS_SHARD_PLACEMENT_RESULT:
        info = _fsdp_common.FSDPMeshInfo(mesh, shard_mesh_dim=0)
        out["result"] = _three(rank, world, by(
            lambda p: _fsdp_common.ShardPlacementResult(placement=Shard(0), mesh_info=info)))
    model = Net()
    vz.fully_shard(model.block, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    out["Shard(1) blocks"] = [p.placements[-1].granularity for p in model.block.parameters()]
    out["refused placement"] = _outcome(lambda: vz.fully_shard(Net(), shard_placement_fn=lambda p: Replicate()))
    single = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "single"))["single"]  # this rank alone
    if HAS_SHARD_PLACEMENT_RESULT:
        out["refused mesh"] = _outcome(lambda: vz.fully_shard(Net(), shard_placement_fn=lambda p: (
            _fsdp_common.ShardPlacementResult(placement=Shard(0), mesh_info=_fsdp_common.FSDPMeshInfo(
                single, shard_mesh_dim=0)))))
    return out


def ignored_params_case(rank, world):
    def shard(model, fully_shard):
        ignored = set(model.norm.parameters())
        fully_shard(model.block, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)

    out = {"trained": None}
    grads = {}
    for kind, fully_shard in (("ours", vz.fully_shard), ("fsdp2", fsdp2_fully_shard)):
        model = Net()
        shard(model, fully_shard)
        batch = _batches()[0].chunk(world)[rank]
        _loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads[kind] = {"type": [type(p).__name__ for p in model.norm.parameters()],
                       "grad": [p.grad.clone() for p in model.norm.parameters()],
                       "others sharded": all(isinstance(p, DTensor) for n, p in model.named_parameters()
                                             if not n.startswith("norm."))}
    out["grads"] = grads
    return out


def dp_mesh_dims_case(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    dims = DataParallelMeshDims(shard="dp")

    def shard(model, fully_shard):
        distribute_module(model, mesh)  # every parameter a DTensor, Replicate() on "dp"
        fully_shard(model.block, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)

    out = _three(rank, world, shard, inputs=lambda t: DTensor.from_local(t, mesh, [Shard(0)]))
    model = Net()
    shard(model, vz.fully_shard)
    out["placements"] = [tuple(type(p).__name__ for p in q.placements) for q in model.parameters()]
    out["meshes"] = all(q.device_mesh is mesh for q in model.parameters())
    return out


def other_arguments_case(rank, world):
    mesh = init_device_mesh("cpu", (world,))

    def shard(model, fully_shard):
        kwargs = dict(mesh=mesh, reshard_after_forward=False, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32),
                      offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model.block, **kwargs)
        fully_shard(model, **kwargs)

    out = {"trained": _three(rank, world, shard)}
    out["unknown"] = _outcome(lambda: vz.fully_shard(Net(), shard_placment_fn=None))
    out["containers"] = [(_outcome(lambda c=c: vz.fully_shard(c)), _outcome(lambda c=c: fsdp2_fully_shard(c)))
                         for c in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)}))]
    return out


def cast_case(rank, world):
    def shard(model, fully_shard):
        fully_shard(model.block)
        fully_shard(model)

    out = {}
    for kind, fully_shard in (("ours", vz.fully_shard), ("fsdp2", fsdp2_fully_shard)):
        model = Net()
        shard(model, fully_shard)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before the cast: it must step the cast model
        model.to(torch.float64)
        dtypes = {(p.dtype, p.to_local().dtype) for p in model.parameters()}
        losses = []
        for batch in _batches():
            batch = batch.chunk(world)[rank]
            loss = _loss(model(batch[:, :-1]).double(), batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[kind] = {"dtypes": dtypes, "losses": losses,
                     "values": {n: p.full_tensor() for n, p in model.named_parameters()}}
    return out


def registration_case(rank, world):
    out = {}
    for kind, fully_shard in (("ours", vz.fully_shard), ("fsdp2", fsdp2_fully_shard)):
        for raf in (True, False, None):
            model = Net()
            fully_shard(model.block, reshard_after_forward=raf)
            fully_shard(model, reshard_after_forward=raf)
            batch = _batches()[0].chunk(world)[rank]
            loss = _loss(model(batch[:, :-1]), batch[:, 1:])
            shown = "".join("D" if isinstance(p, DTensor) else "T" for p in model.parameters())
            loss.backward()
            after = "".join("D" if isinstance(p, DTensor) else "T" for p in model.parameters())
            model(batch[:, :-1])
            for module in (model, model.block):
                module.reshard()
            resharded = "".join("D" if isinstance(p, DTensor) else "T" for p in model.parameters())
            out[kind, raf] = (shown, after, resharded)
    return out


CASES = {"module list": (module_list_case, ()), "shard_placement_fn": (shard_placement_case, ()),
         "ignored_params": (ignored_params_case, ()),
         "other arguments": (other_arguments_case, ()), "cast": (cast_case, ()),
         "registration": (registration_case, ())}
if DataParallelMeshDims is not None:
    CASES["dp_mesh_dims"] = (dp_mesh_dims_case, ())


@pytest.fixture(scope="module", params=sweep([2, 3], quick=3), ids=lambda n: f"{n}ranks")
def results(request):
    out = run_cases_on_ranks(CASES, request.param, timeout=600)
    out["world"] = request.param
    return out


def _same(r: Dict[str, Dict[str, Any]], what: str, against_ref: bool = True) -> None:
    for other in ("fsdp2",) + (("ref",) if against_ref else ()):
        torch.testing.assert_close(r["ours"]["losses"], r[other]["losses"], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, o=other: f"{what}: losses, ours vs {o}: {m}")
        for name, value in r["ours"]["values"].items():
            torch.testing.assert_close(value, r[other]["values"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, o=other: f"{what}: {n}, ours vs {o}: {m}")


def test_a_list_of_modules_is_one_group_as_in_fsdp2(results):
    for r in results["module list"]:
        _same(r["list"], "fully_shard([norm, head])")
        _same(r["tied"], "fully_shard([embed, norm, head]) with tied weights")
        assert r["returned"]
        assert r["as root"][0] == "error" and "single root module" in r["as root"][2], r["as root"]


def test_shard_placement_fn_as_blocks(results):
    for r in results["shard_placement_fn"]:
        for what in ("None", "Shard(0)", "Shard(1)") + (("result",) if HAS_SHARD_PLACEMENT_RESULT else ()):
            _same(r[what], f"shard_placement_fn -> {what}")
        # Shard(1) of (24, 12) and (12, 24): whole slices of dim 1, one element each; the biases: element
        assert r["Shard(1) blocks"] == [1, 1, 1, 1], r["Shard(1) blocks"]
        assert r["refused placement"][:2] == ("error", "NotImplementedError"), r["refused placement"]
        assert "Shard(dim)" in r["refused placement"][2]
        if HAS_SHARD_PLACEMENT_RESULT:
            refused = r["refused mesh"]
            assert refused[:2] == ("error", "NotImplementedError") and "mesh=edp_mesh" in refused[2], refused


def test_ignored_params_are_left_alone_as_in_fsdp2(results):
    world = results["world"]
    for r in results["ignored_params"]:
        ours, fsdp2 = r["grads"]["ours"], r["grads"]["fsdp2"]
        assert ours["type"] == fsdp2["type"] == ["Parameter", "Parameter"], (ours["type"], fsdp2["type"])
        assert ours["others sharded"] and fsdp2["others sharded"]
        for a, b in zip(ours["grad"], fsdp2["grad"]):
            assert torch.equal(a, b), "the ignored parameters' gradients (this rank's own, not reduced)"
    grads = [r["grads"]["ours"]["grad"][0] for r in results["ignored_params"]]
    assert any(not torch.equal(grads[0], g) for g in grads[1:]), f"not reduced: ranks differ ({world} ranks)"


@pytest.mark.skipif(DataParallelMeshDims is None, reason="this torch's FSDP2 has no DataParallelMeshDims")
def test_dp_mesh_dims_full_dtensor_parameters_as_in_fsdp2(results):
    for r in results["dp_mesh_dims"]:
        _same(r, "dp_mesh_dims", against_ref=False)  # FSDP2's full-DTensor mode: its own mean of means
        assert r["meshes"] and all(p == ("RaggedShard",) for p in r["placements"]), r["placements"]


def test_mesh_mp_policy_reshard_and_offload_arguments(results):
    for r in results["other arguments"]:
        _same(r["trained"], "mesh, mp_policy, reshard_after_forward=False, CPUOffloadPolicy")
        assert r["unknown"][:2] == ("error", "TypeError") and "'shard_placment_fn'" in r["unknown"][2], r["unknown"]
        for ours, fsdp2 in r["containers"]:
            assert ours[:2] == fsdp2[:2] == ("error", "ValueError"), (ours, fsdp2)
            assert "does not support containers that do not implement forward" in ours[2], ours


def test_a_cast_after_fully_shard_replans_as_fsdp2_casts(results):
    world = results["world"]
    # fp64 Adam (lr 1e-2, 3 steps) on the same gradients: at 2 ranks a + b in either order, bit-identical;
    # at 3 ranks reduced in another order ([Note: comparing runs that sum in another order]): the first
    # loss is identical, the parameters within adam_divergence_bound
    bound = 0.0 if world == 2 else adam_divergence_bound(1e-2, STEPS)
    for r in results["cast"]:
        assert r["ours"]["dtypes"] == r["fsdp2"]["dtypes"] == {(torch.float64, torch.float64)}, r["ours"]["dtypes"]
        assert r["ours"]["losses"][0] == r["fsdp2"]["losses"][0], (r["ours"]["losses"], r["fsdp2"]["losses"])
        if world == 2:
            assert r["ours"]["losses"] == r["fsdp2"]["losses"], (r["ours"]["losses"], r["fsdp2"]["losses"])
        for name, value in r["ours"]["values"].items():
            assert (value - r["fsdp2"]["values"][name]).abs().max().item() <= bound, name


def test_parameters_registered_between_forward_and_backward_as_in_fsdp2(results):
    for r in results["registration"]:
        for raf in (True, False, None):
            assert r["ours", raf] == r["fsdp2", raf], (raf, r["ours", raf], r["fsdp2", raf])
        # the default: the root (embed, norm, head) shows plain tensors, the block (two Linears) DTensors
        assert r["ours", None][0] == "T" + "DDDD" + "TTT", r["ours", None]
