"""Megatron ``--init-model-with-meta-device`` under ``RaggedFSDP``.

A megatron-core GPTModel (``examples/megatron/pretrain_gpt.py``, local spec,
``use_cpu_initialization``) built on the meta device and materialised by ``RaggedFSDP``
(integrations/megatron/meta_init.py) against the same model built eagerly under
``RaggedFSDP`` with the same seeds:

1. the initial full parameters are bit-identical (each module is initialised in
   construction order, drawing the same random numbers), and so are the losses, gradient
   norms and parameters after 3 AdamW steps (fp32; same plan, same arithmetic);
2. while materialising, the live bytes (LiveBytes) beyond the persistent shards stay within
   one group's full buffer plus one TP-global master weight (``_initialize_affine_weight_cpu``
   draws it whole, as the eager constructor does), well under the whole model;
3. a module on meta with no way to initialise it, or a model partly on meta, gets a
   ValueError naming it.

At 2 and 3 ranks (TP=1) and 4 ranks (TP=2 x DP=2), one spawn per world size.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.sweeps import sweep
from tests.test_megatron import _megatron_job, _relative_error  # noqa: E402

ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-2",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--disable-bias-linear", "--use-vescale-fsdp"]


def _full(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _meta_equals_eager(rank: int, world_size: int, argv: List[str]) -> Dict:
    with _megatron_job(argv) as (pg, args):
        args.init_model_with_meta_device = False
        model, optimizer, config = pg.build(args)
        eager_init = _full(model)
        eager = pg.train_loop(args, model, optimizer, config)
        eager_end = _full(model)
        del model, optimizer

        args.init_model_with_meta_device = True
        model, optimizer, config = pg.build(args)
        assert config.init_model_with_meta_device and config.use_cpu_initialization
        meta_init = _full(model)
        meta = pg.train_loop(args, model, optimizer, config)
        meta_end = _full(model)
        return {
            "keys": (sorted(eager_init), sorted(meta_init)),
            "init_differ": sorted(k for k in eager_init if not torch.equal(eager_init[k], meta_init[k])),
            "end_differ": sorted(k for k in eager_end if not torch.equal(eager_end[k], meta_end[k])),
            "end_error": max(_relative_error(meta_end[k], eager_end[k]) for k in eager_end),
            "losses": (eager["losses"], meta["losses"]),
            "norms": (eager["grad_norms"], meta["grad_norms"]),
        }


def _materialise_peak(rank: int, world_size: int, argv: List[str]) -> Dict:
    """Live bytes while ``RaggedFSDP`` shards and materialises a meta GPTModel."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from tests.live_bytes import LiveBytes
    from vescale_zero.integrations.megatron import RaggedFSDP, data_parallel

    with _megatron_job(argv) as (pg, args):
        args.init_model_with_meta_device = True
        pg.seed(args)
        config = pg.transformer_config(args)
        unwrapped = pg.build_model_unwrapped(args, config)
        whole = sum(p.numel() * p.element_size() for p in unwrapped.parameters())  # TP-local, fp32
        largest = max(p.numel() * p.element_size() for p in unwrapped.parameters())
        materialised = {}

        def materialise_and_measure(*a, **k):
            # The peak while materialising, and what stays: measured before Megatron's main_grad
            # views give the gradient shards storage (the last thing the constructor does).
            materialize(*a, **k)
            materialised.update(peak=live.peak, live=live.live)

        materialize = data_parallel.materialize_megatron
        data_parallel.materialize_megatron = materialise_and_measure
        try:
            with LiveBytes() as live:
                before = live.live
                model = RaggedFSDP(config, DistributedDataParallelConfig(), unwrapped)
                after = live.live
        finally:
            data_parallel.materialize_megatron = materialize
        groups = model.vescale_groups
        masters = sum(g.master.local.nbytes for g in groups)
        grads = sum(g.sharded_grad.live.nbytes for g in groups if g.sharded_grad.live is not None)
        one_group = max(sum(m.shape.numel() for m in g.managed) * g.master.local.element_size() for g in groups)
        tp = args.tensor_model_parallel_size
        # each shard group's DeviceMesh (the sharded parameters are DTensors on it) holds its ranks as a tensor
        meshes = sum(m.mesh.untyped_storage().nbytes() for m in {id(g.mesh): g.mesh for g in groups}.values())
        return {"persistent": after - before - meshes, "shards": masters + grads, "masters": masters,
                "materialised": materialised["live"] - before - meshes,
                "transient": materialised["peak"] - materialised["live"],
                "one_group": one_group, "master_weight": largest * tp, "whole": whole, "groups": len(groups)}


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def _refused(rank: int, world_size: int, argv: List[str]) -> Dict[str, str]:
    from megatron.core.distributed import DistributedDataParallelConfig

    from vescale_zero.integrations.megatron import RaggedFSDP

    out = {}
    with _megatron_job(argv) as (pg, args):
        args.init_model_with_meta_device = True
        config = pg.transformer_config(args)
        model = pg.build_model_unwrapped(args, config)
        with torch.device("meta"):
            model.decoder.layers[1].odd = _NoInit()
        try:
            RaggedFSDP(config, DistributedDataParallelConfig(), model)
            out["no_init"] = "accepted"
        except ValueError as e:
            out["no_init"] = str(e)
        model = pg.build_model_unwrapped(args, config)
        model.decoder.final_layernorm.to_empty(device="cpu")
        try:
            RaggedFSDP(config, DistributedDataParallelConfig(), model)
            out["partly"] = "accepted"
        except ValueError as e:
            out["partly"] = str(e)
    return out


def _cases(argv: List[str], with_errors: bool) -> Dict:
    cases = {"equal": (_meta_equals_eager, (argv,)), "peak": (_materialise_peak, (argv,))}
    if with_errors:
        cases["refused"] = (_refused, (argv,))
    return cases


@pytest.mark.parametrize("world_size,extra", sweep([(2, []), (3, ["--global-batch-size", "6"]),
                                                    (4, ["--tensor-model-parallel-size", "2"])],
                                                   quick=(4, ["--tensor-model-parallel-size", "2"])),
                         ids=["dp2", "dp3", "tp2dp2"])
def test_meta_device_init_trains_like_eager(world_size, extra):
    results = run_cases_on_ranks(_cases(ARGV + extra, with_errors=world_size == 2), world_size)
    for r in results["equal"]:
        assert r["keys"][0] == r["keys"][1]
        assert r["init_differ"] == [], f"meta-initialised values differ from the eager build: {r['init_differ']}"
        assert r["losses"][0] == r["losses"][1] and r["norms"][0] == r["norms"][1], r
        assert r["end_differ"] == [], f"trained differ (max relative {r['end_error']:.2e}): {r['end_differ']}"
    for r in results["peak"]:
        assert r["groups"] >= 5
        # The shards (parameters and gradients) stay; everything else is gone after.
        assert r["persistent"] == r["shards"] and r["materialised"] == r["masters"], r
        # Beside them: one group's full buffer and one module's TP-global master weight at a time.
        assert 0 < r["transient"] <= r["one_group"] + r["master_weight"], r
        assert r["transient"] < r["whole"] / 2, r
    if world_size == 2:
        for r in results["refused"]:
            assert "'decoder.layers.1.odd' (_NoInit)" in r["no_init"] and "reset_parameters" in r["no_init"], r
            assert "decoder.final_layernorm.weight" in r["partly"] and "--use-cpu-initialization" in r["partly"], r
