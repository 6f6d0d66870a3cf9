"""torchtitan 0.3 on ``vescale_zero.fully_shard`` (issue 47): its own code, beside FSDP2.

Needs torchtitan (its CI venv: ``.venv-titan``, ``pip install torchtitan==0.3.0 triton``); skipped
without it. ``vescale_zero.integrations.torchtitan.install()`` is the switch under test
(integrations/torchtitan [Note: the torchtitan switch]).

Each rank builds torchtitan's ``Trainer`` the way ``Trainer.__init__`` does (torchtitan/trainer.py of
0.3.0, lines 337-600: the calls are mirrored one by one in ``_trainer``, with a CPU device, no data
loader and a metrics stand-in that records what ``train_step`` logs), then runs torchtitan's own
``Trainer.train_step`` (the loss wrapper, global token count, ``clip_grad_norm_``, optimizer container
and LR schedulers of its debug config) and its ``CheckpointManager``:

  model        the model spec's ``debugmodel`` (Llama-3) and a small Qwen3 MoE built with torchtitan's
               own layer builders (two experts: ``apply_fsdp_to_decoder`` passes a
               ``shard_placement_fn`` of ``Shard(1)`` for them at 3 ranks, none at 2); attention is
               torchtitan's ``ScaledDotProductAttention`` (flex attention has no backward on CPU)
  parallelize  the spec's ``parallelize_fn`` (``spmd_backend="partial_dtensor"``): activation
               checkpointing of the debug config, then torchtitan's ``apply_fsdp_to_decoder``
               (``fully_shard([norm, lm_head])``, ``set_gradient_divide_factor(1.0)``)
  init         ``model.to_empty(device="cpu")`` then ``model.init_weights()`` under the same seed as
               an unsharded model of the same config: every rank's full tensors equal it bit for
               bit (ours). FSDP2's DTensor random ops on a CPU mesh draw each rank's shard from the
               local generator (other values), so FSDP2 starts from ours: torchtitan's seed
               checkpoint (``CheckpointManager.save(0, last_step=True)``, model only), loaded by its
               ``initial_load_path`` -- a checkpoint of ours read by FSDP2.
  train        ``STEPS`` steps each; FSDP2 with ``set_force_sum_reduction_for_comms(True)`` (gloo has
               no PREMUL_SUM, which FSDP2 uses for a divide factor of 1.0)
  resume       ``CheckpointManager.save(CHECKPOINT_AT)`` in the run; a new trainer ``load``s it and
               trains the remaining steps: the same losses and parameters as the run itself

Compute is fp32 (torchtitan's default ``mixed_precision_param`` is bf16, where a one-ulp difference
of an fp32 master weight can round to another bf16 value) and ``max_norm`` is large, so
``clip_grad_norm_`` runs with a coefficient of exactly 1 (the two FSDPs sum the same squares in
other groupings, so the norms, hence any coefficient below 1, differ in the last bits). Then:
at 2 ranks both reduce each gradient as ``a + b`` (exact in either order): losses and parameters
are bit-identical, and the reported gradient norms differ only by their summation
([Note: comparing runs that sum in another order]): a cascade sum of squares within each piece
(about log2(numel) levels), then across ranks and tensors, so relatively by at most
2 * gamma(log2(numel) + world + tensors). At 3 ranks gloo's reduce-scatter sums three terms in an
order that depends on where an element sits in the collective's buffer (the flat buffer here,
FSDP2's per-parameter layout there): the first step's loss is bit-identical, the parameters stay
within ``adam_divergence_bound``. Resuming from a checkpoint replays the same steps: exact.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_cases_on_ranks
from tests.numerics import adam_divergence_bound, gamma

pytest.importorskip("torchtitan")

SEED = 0
STEPS = 4
CHECKPOINT_AT = 2
SEQ = 32
LOCAL_BATCH = 2
LR, BETAS = 8e-4, (0.9, 0.95)  # torchtitan's debug config: default_adamw(lr=8e-4), betas (0.9, 0.95)


class _Metrics:
    """What ``Trainer.train_step`` logs each step (its metrics processor, recorded)."""

    def __init__(self) -> None:
        self.logged: List[tuple] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: Any = None) -> None:
        self.logged.append((step, global_avg_loss, grad_norm))


class _NoData:
    """The data loader's place in the checkpoint (batches come from the test)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _cpu() -> None:
    """torchtitan picks "cuda" when no accelerator is found; these ranks are CPU/gloo."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    parallel_dims.device_type = utils.device_type = "cpu"


def _model_spec(name: str):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if name == "llama3":
        from torchtitan.models.llama3 import model_registry

        spec = model_registry("debugmodel")
    else:  # Qwen3 MoE: the debugmodel_moe recipe, smaller (two experts), by torchtitan's own builders
        from torchtitan.models import qwen3
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear

        spec = qwen3.model_registry("debugmodel_moe")
        dim, head_dim, vocab = 48, 16, 512  # experts (2, 48, 48): Shard(1) divides at 3 ranks (FSDP2 needs it)
        spec.model = qwen3.Qwen3Model.Config(
            vocab_size=vocab, dim=dim, norm=qwen3._qwen3_norm(dim),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
            layers=qwen3._build_qwen3_moe_layers(
                fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=48,
                num_experts=2, top_k=1, attn_backend="flex", moe_comm_backend="standard",
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ * 4, theta=1000000.0)))
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return spec


def _config(name: str, folder: str, initial_load_path: Any = None):
    """torchtitan's debug trainer config, for these ranks: small batches, partial_dtensor, checkpoints."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec = _model_spec(name)
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ, LOCAL_BATCH, STEPS
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"  # bf16 compute turns an ulp into a bf16 step: see the docstring
    config.training.max_norm = 1e9  # clip_grad_norm_ runs; its coefficient is 1 (see the docstring)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable, config.checkpoint.folder, config.checkpoint.interval = True, "checkpoint", CHECKPOINT_AT
    config.checkpoint.last_save_model_only = True
    config.checkpoint.initial_load_path = initial_load_path
    config.dump_folder = folder
    return config


def _trainer(kind: str, name: str, world: int, folder: str, initial_load_path: Any = None):
    """A torchtitan ``Trainer`` built as ``Trainer.__init__`` builds it (trainer.py 337-600, on CPU),
    sharded by ours (``kind="ours"``: the switch installed) or FSDP2 (torch's ``fully_shard``)."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.tools import utils
    from torchtitan.trainer import Trainer

    import vescale_zero.integrations.torchtitan as vz_torchtitan

    (vz_torchtitan.install if kind == "ours" else vz_torchtitan.uninstall)()
    config = _config(name, folder, initial_load_path)
    spec = config.model_spec
    t = Trainer.__new__(Trainer)
    t.config, t.device = config, torch.device("cpu")
    t.parallel_dims = parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                                                   world_size=world, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    torch.manual_seed(SEED)  # set_determinism: the same seed on every rank
    model_config = spec.model
    model_config.update_from_config(config=config)
    t.model_config = model_config
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    t.loss_fn = config.loss.build(compile_config=config.compile)
    t.gradient_accumulation_steps, t.num_pipeline_parallel_microbatches = 1, 1
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    if kind == "fsdp2":
        for module in model.modules():  # gloo has no PREMUL_SUM (the divide factor 1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms") and hasattr(module, "_get_fsdp_state"):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED + 1)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    t.model_parts = [model]
    if isinstance(t.loss_fn, ChunkedLossWrapper):
        t.loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    t.metrics_processor = _Metrics()
    t.optimizers = config.optimizer.build(model_parts=t.model_parts)
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(t.optimizers, t.model_parts, parallel_dims)
    t.lr_schedulers = config.lr_scheduler.build(optimizers=t.optimizers, training_steps=config.training.steps)
    t.step, t.ntokens_seen = 0, 0
    t.checkpointer = config.checkpoint.build(dataloader=_NoData(), model_parts=t.model_parts, optimizers=t.optimizers,
                                             lr_schedulers=t.lr_schedulers, states={"train_state": t},
                                             sd_adapter=None, base_folder=config.dump_folder)
    t.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    t.fwd_bwd_fn = t._forward_backward_body
    return t


def _batch(step: int, rank: int, world: int, vocab: int):
    """This rank's slice of step ``step``'s global batch (the same on every rank and run)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (LOCAL_BATCH * world, SEQ + 1), generator=g)[rank * LOCAL_BATCH:][:LOCAL_BATCH]
    return {"input": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()


def _train(t, rank: int, world: int, until: int) -> None:
    vocab = t.model_config.vocab_size
    while t.step < until:
        t.step += 1
        t.train_step(iter([_batch(t.step, rank, world, vocab)]))
        t.checkpointer.save(t.step, last_step=t.step == STEPS)


def _full(model) -> Dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            .clone() for n, p in model.named_parameters()}  # names as without activation checkpointing


def _unsharded_init(name: str) -> Dict[str, torch.Tensor]:
    """The same config built unsharded on the CPU and initialised by ``init_weights`` under the same seed."""
    config = _config(name, "")
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    model = model_config.build()
    torch.manual_seed(SEED + 1)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def torchtitan_case(rank: int, world: int, name: str, folder: str) -> Dict[str, Any]:
    _cpu()
    out: Dict[str, Any] = {}
    ours = _trainer("ours", name, world, os.path.join(folder, "ours"))
    import vescale_zero as vz

    out["ours groups"] = sum(isinstance(m, vz.RaggedFSDPModule) for m in ours.model_parts[0].modules())
    initial = _full(ours.model_parts[0])
    reference = _unsharded_init(name)
    out["init vs unsharded"] = {n: (initial[n] - reference[n]).abs().max().item() for n in reference}
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: t.sum().item() for n, t in initial.items()})
    out["init equal across ranks"] = all(g == gathered[0] for g in gathered)
    ours.checkpointer.save(0, last_step=True)  # torchtitan's seed checkpoint: step-0, the model only
    seed = os.path.join(folder, "ours", "checkpoint", "step-0")
    fsdp2 = _trainer("fsdp2", name, world, os.path.join(folder, "fsdp2"), initial_load_path=seed)
    fsdp2.checkpointer.load(step=-1)  # initial_load_path: ours' seed checkpoint, model only
    start = _full(fsdp2.model_parts[0])
    out["fsdp2 start vs ours"] = max((a - initial[n]).abs().max().item() for n, a in start.items())
    for t in (ours, fsdp2):
        _train(t, rank, world, STEPS)
    out["losses"] = {kind: [(s, loss, norm) for s, loss, norm in t.metrics_processor.logged]
                     for kind, t in (("ours", ours), ("fsdp2", fsdp2))}
    final = {kind: _full(t.model_parts[0]) for kind, t in (("ours", ours), ("fsdp2", fsdp2))}
    out["params ours vs fsdp2"] = {n: (final["ours"][n] - final["fsdp2"][n]).abs().max().item() for n in final["ours"]}
    out["largest numel"] = max(t.numel() for t in final["ours"].values())
    out["tensors"] = len(final["ours"])
    # resume from the step-CHECKPOINT_AT checkpoint of each run (a fresh trainer in the same folder)
    for kind, run in (("ours", ours), ("fsdp2", fsdp2)):
        again = _trainer(kind, name, world, os.path.join(folder, kind))
        again.checkpointer.load(step=CHECKPOINT_AT)
        _train(again, rank, world, STEPS)
        resumed = _full(again.model_parts[0])
        out[f"resumed {kind}"] = (max((resumed[n] - final[kind][n]).abs().max().item() for n in resumed),
                                  [loss for _, loss, _ in again.metrics_processor.logged],
                                  [loss for _, loss, _ in run.metrics_processor.logged][CHECKPOINT_AT:])
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def world(request):
    return request.param


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 2-5 minutes each on 2 cores (three trainers and an unsharded model per rank)
@pytest.mark.parametrize("name", ["llama3", "qwen3_moe"])
def test_torchtitan_trains_on_our_fully_shard_as_on_fsdp2(name, world, tmp_path):
    """The issue's table: fully_shard([norm, lm_head]), init_weights after to_empty, training and
    DCP resume by torchtitan's own code -- ours equal to FSDP2 (and the init to the unsharded model)."""
    result = run_cases_on_ranks({"titan": (torchtitan_case, (name, os.fspath(tmp_path)))}, world, timeout=1500)
    for r in result["titan"]:
        assert r["ours groups"] >= 4, r["ours groups"]  # blocks, norm and lm_head (one group of two), the root
        assert max(r["init vs unsharded"].values()) == 0.0, r["init vs unsharded"]
        assert r["init equal across ranks"]
        assert r["fsdp2 start vs ours"] == 0.0
        ours, fsdp2 = r["losses"]["ours"], r["losses"]["fsdp2"]
        assert [s for s, _, _ in ours] == [s for s, _, _ in fsdp2] == list(range(1, STEPS + 1)), (ours, fsdp2)
        assert ours[0][1] == fsdp2[0][1], (ours, fsdp2)  # the same weights and data: the same first loss
        norm_bound = 2 * gamma(math.ceil(math.log2(r["largest numel"])) + world + r["tensors"])
        for (_, lo, no), (_, lf, nf) in zip(ours, fsdp2):
            assert math.isfinite(lo) and math.isfinite(no)
            if world == 2:
                assert lo == lf and abs(no - nf) <= norm_bound * nf, (ours, fsdp2, norm_bound)
        bound = 0.0 if world == 2 else adam_divergence_bound(LR, STEPS, BETAS)
        assert max(r["params ours vs fsdp2"].values()) <= bound, (bound, r["params ours vs fsdp2"])
        for kind in ("ours", "fsdp2"):
            diff, resumed, run = r[f"resumed {kind}"]
            assert diff == 0.0 and resumed == run, (kind, diff, resumed, run)
