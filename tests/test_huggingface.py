"""Hugging Face models and tools with ragged sharding (gloo, CPU; transformers + accelerate).

1. ``Trainer`` with DeepSpeed ``"stage": "ragged"`` and gradient accumulation trains and
   evaluates as with ZeRO-3, saves the whole model (``save_model`` and every
   ``checkpoint-N``) as ZeRO-3 does: ``from_pretrained`` loads it strictly and it equals
   ZeRO-3's saved weights; resuming from ``checkpoint-N`` continues bit for bit. The other
   save paths give the whole model or refuse.
2. Activation recompute (Hugging Face ``gradient_checkpointing_enable``, plain
   ``torch.utils.checkpoint`` around sharded layers, reentrant or not) gives the gradients
   and updates of the run without recompute and of an unsharded run.

3. A plain ``accelerate`` loop (``accelerator.accumulate``, gradient accumulation 2) with
   "ragged" equals the ZeRO-3 loop and the loop without accumulation on doubled batches.

How the Trainer runs on spawned ranks: ``run_on_ranks`` sets what torchrun sets (RANK,
WORLD_SIZE, MASTER_ADDR/PORT) and initialises the gloo group before the rank function; the
rank function adds LOCAL_RANK / LOCAL_WORLD_SIZE and OMP_NUM_THREADS=1 (torchrun's default,
else accelerate picks a thread count) before ``TrainingArguments`` exists. accelerate's
state then finds torch.distributed initialised (its DeepSpeed branch: one process per rank,
``num_processes == world_size``) and DeepSpeed's ``init_distributed`` reuses the group.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

pytest.importorskip("transformers")  # the [test] extra installs transformers, accelerate and deepspeed
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests.distributed import run_on_ranks  # noqa: E402
from tests.models import assemble, local_pieces  # noqa: E402
from tests.numerics import adam_divergence_bound  # noqa: E402

VOCAB, SEQ, LAYERS = 512, 16, 2
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def llama(seed=0, **overrides):
    """A tiny LlamaForCausalLM (fp32), the same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))


def token_batches(n, rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, SEQ), generator=g) for _ in range(n)]


def assert_close(got, want, what, **tolerance):
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}", **tolerance)


def _hf_rank_env(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a 40 s JIT build on CPU
    import vescale_zero.integrations.deepspeed  # noqa: F401  (registers stage "ragged")


# ---- 1. Trainer.save_model / checkpoint-N ---------------------------------------------------

STEPS, SAVE_EVERY, LR, ACCUMULATION = 4, 2, 1e-2, 2


def _trainer_job(stage, out, model, resume_from=None):
    """The Trainer job (ACCUMULATION micro-batches of 2 rows per rank and step, 16 rows:
    two steps per epoch), trained to STEPS, its model saved in ``out``."""
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": x, "labels": x} for x in token_batches(1, 16)[0]]
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        output_dir=out, deepspeed=ds_config, use_cpu=True, per_device_train_batch_size=2, max_steps=STEPS,
        gradient_accumulation_steps=ACCUMULATION, save_steps=SAVE_EVERY, learning_rate=LR, weight_decay=0.1, seed=0,
        report_to=[], disable_tqdm=True, logging_steps=1, per_device_eval_batch_size=2,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model(out)
    return trainer


def _trainer(rank, world_size, stage, out):
    _hf_rank_env(rank, world_size)
    trainer = _trainer_job(stage, out, llama(seed=0))
    assert trainer.accelerator.num_processes == world_size
    evaluation = [{"input_ids": x, "labels": x} for x in token_batches(1, 8, seed=4)[0]]
    result = {"engine": type(trainer.deepspeed).__name__, "eval_loss": trainer.evaluate(evaluation)["eval_loss"],
              "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}}
    if stage != "ragged":
        return result
    engine, accelerator = trainer.deepspeed, trainer.accelerator
    # the other ways out of a ragged engine, each called on every rank
    result["pieces"] = local_pieces(engine.module)
    result["module_state_dict"] = engine.module_state_dict()
    result["get_state_dict(model)"] = accelerator.get_state_dict(trainer.model)  # the bare module, not the engine
    engine.save_16bit_model(os.path.join(out, "save_16bit_model"))
    accelerator.save_model(engine, os.path.join(out, "accelerator.save_model"))
    try:
        trainer.model.save_pretrained(os.path.join(out, "save_pretrained"))  # state_dict() of one rank: refused
        result["save_pretrained"] = "wrote"
    except ValueError as e:
        result["save_pretrained"] = str(e)
    # from_pretrained under the ragged config: built partitioned (zero.Init), as under ZeRO-3
    model, result["from_pretrained"] = _partitioned_from_pretrained(out)
    # resume from checkpoint-SAVE_EVERY (its DeepSpeed checkpoint global_stepN) into that model (other weights)
    resumed = _trainer_job(stage, os.path.join(out, "resumed"), model,
                           resume_from=os.path.join(out, f"checkpoint-{SAVE_EVERY}"))
    result["resumed losses"] = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    result["resumed pieces"] = local_pieces(resumed.deepspeed.module)
    return result


def _partitioned_from_pretrained(directory):
    """``LlamaForCausalLM.from_pretrained`` while the Trainer's ragged config is alive: the
    model is built under ``deepspeed.zero.Init`` and loaded module by module (see
    integrations/deepspeed/accelerate_stage.py), so every parameter is a ZeRO-3 partition
    (converted to ragged shards by the engine). Returns the model and what was seen: the
    fraction of the model's elements this rank holds after the load, and whether the loaded
    (gathered) weights equal the saved ones."""
    import deepspeed
    from transformers import LlamaForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    model = LlamaForCausalLM.from_pretrained(directory)
    params = list(model.parameters())
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    with deepspeed.zero.GatheredParameters(params):
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved = _saved(directory)
    return model, {"zero3 enabled": is_deepspeed_zero3_enabled(),
                   "partitioned": all(hasattr(p, "ds_id") for p in params),
                   "local fraction": local / sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
                   "equal to the save": all(torch.equal(loaded[k], v) for k, v in saved.items())
                   and set(saved) <= set(loaded)}


def _saved(directory):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _strict_load(directory):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{directory}: {problems}"
    return model


@pytest.mark.slow
def test_trainer_saves_the_whole_model_like_zero3(tmp_path):
    """A ragged Trainer job with gradient accumulation 2 trains, evaluates, saves and resumes
    as the same ZeRO-3 job:

    * the first step's logged loss equals ZeRO-3's bit for bit (the same weights and data);
    * ``save_model`` and ``checkpoint-N`` load strictly with ``from_pretrained``, hold
      exactly the engine's trained shards, and are within what N AdamW steps can move two runs
      apart of ZeRO-3's saves (tests/numerics.py
      [Note: comparing runs that sum in another order]): the engines sum gradients in another
      order (ZeRO-3's buckets per micro-batch vs one reduce-scatter per group and step), and
      Adam moves each weight by about LR whatever its gradient's size, so a gradient at rounding
      level can move either way (seen: 1 of 2048 weights 1.88e-5 apart on one machine, 4 of
      32768 1.5e-6 on another). Later losses and the evaluation loss come from those weights and
      are not compared by value; the reduction itself is checked to fp32 rounding in
      test_deepspeed_zero_init (the same engine);
    * ``trainer.train(resume_from_checkpoint="checkpoint-2")`` on a model of other weights
      loads that checkpoint's DeepSpeed state (``global_step2``: our shards, optimizer,
      scheduler) and continues bit for bit: steps 3-4 log the same losses and end in the
      same weights as the uninterrupted run. The other save paths give the whole model or
      refuse."""
    zero3 = run_on_ranks(_trainer, 2, 3, str(tmp_path / "zero3"), timeout=400)
    ragged = run_on_ranks(_trainer, 2, "ragged", str(tmp_path / "ragged"), timeout=500)
    assert zero3[0]["engine"] == "DeepSpeedEngine" and ragged[0]["engine"] == "RaggedDeepSpeedEngine"
    for rank in range(2):
        ours, theirs = ragged[rank]["losses"], zero3[rank]["losses"]
        assert list(ours) == list(theirs) == list(range(1, STEPS + 1)), (ours, theirs)
        assert ours[1] == theirs[1], (ours, theirs)
        assert math.isfinite(ragged[rank]["eval_loss"]), ragged[rank]["eval_loss"]
    # from_pretrained under "ragged" built the model partitioned: each rank held about half of it
    # (without the ragged stage reading as ZeRO-3 there: not partitioned, local fraction 1.0)
    for rank, r in enumerate(ragged):
        seen = r["from_pretrained"]
        assert seen["zero3 enabled"] and seen["partitioned"] and seen["equal to the save"], (rank, seen)
        assert seen["local fraction"] <= 0.5 + 0.01, (rank, seen)
    # resumed from checkpoint-SAVE_EVERY (into the model from_pretrained built partitioned):
    # the same steps after it, the same final weights
    for r in ragged:
        resumed = {step: loss for step, loss in r["resumed losses"].items() if step > SAVE_EVERY}
        assert resumed == {step: loss for step, loss in r["losses"].items() if step > SAVE_EVERY}, resumed
    uninterrupted, continued = assemble([r["pieces"] for r in ragged]), assemble([r["resumed pieces"] for r in ragged])
    for key, value in uninterrupted.items():
        assert torch.equal(continued[key], value), f"resumed run's {key}"
    assert torch.equal(_saved(tmp_path / "ragged" / "resumed")["lm_head.weight"], uninterrupted["lm_head.weight"])
    reference = llama(seed=0).state_dict()  # keys and shapes of the unsharded model
    for where in [f"checkpoint-{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)] + ["."]:
        ours, theirs = _saved(tmp_path / "ragged" / where), _saved(tmp_path / "zero3" / where)
        assert set(ours) == set(theirs), where
        for key, value in ours.items():
            assert value.dtype == torch.float32 and value.shape == theirs[key].shape, (where, key, value.shape)
            steps = STEPS if where == "." else int(where.split("-")[1])
            assert_close(value, theirs[key], f"{where} {key}", rtol=0, atol=adam_divergence_bound(LR, steps))
        loaded = _strict_load(tmp_path / "ragged" / where).state_dict()
        assert {k: v.shape for k, v in loaded.items()} == {k: v.shape for k, v in reference.items()}
        for key, value in ours.items():
            assert torch.equal(loaded[key], value), (where, key)
    # the saved model is exactly the engine's trained shards
    final = _saved(tmp_path / "ragged")
    trained = assemble([r["pieces"] for r in ragged])
    assert set(trained) <= set(final)
    for key, value in trained.items():
        assert torch.equal(final[key], value), key
    # the other paths: the same full weights, or a refusal naming the way to gather
    bin_file = torch.load(tmp_path / "ragged" / "save_16bit_model" / "pytorch_model.bin", weights_only=True)
    via_accelerate = _saved(tmp_path / "ragged" / "accelerator.save_model")
    for rank, r in enumerate(ragged):
        assert set(r["module_state_dict"]) == set(reference), rank
        for key in reference:
            assert torch.equal(r["module_state_dict"][key], final[key]), (rank, key)
        got = r["get_state_dict(model)"]
        assert (got is None) == (rank != 0), rank  # rank 0 keeps it, as ZeRO-3's consolidated save
        assert "save_pretrained() without state_dict=" in r["save_pretrained"], r["save_pretrained"]
        assert "accelerator.get_state_dict(engine)" in r["save_pretrained"]
    for full in (ragged[0]["get_state_dict(model)"], bin_file, via_accelerate):
        assert set(full) == set(reference)
        for key, value in full.items():
            assert torch.equal(value, ragged[0]["module_state_dict"][key]), key
    assert not (tmp_path / "ragged" / "save_pretrained" / "model.safetensors").exists()


# ---- 3. a plain accelerate loop with gradient accumulation ---------------------------------------

ACC_STEPS, ACC_ROWS, ACC_LR = 3, 2, 0.5  # optimizer steps, rows per micro-batch and rank, SGD learning rate


def _accelerate_loop(stage, accumulation, rows):
    """ACC_STEPS SGD steps of ``with accelerator.accumulate(model)`` over micro-batches of
    ``rows`` rows per rank: ``{"losses": every micro-batch's loss on this rank, "weights":
    the full weights on rank 0 (None elsewhere), ...}``. SGD, not Adam: its update is linear
    in the gradient, so a gradient that is off by a factor (the 1 / accumulation scaling) or
    misses a micro-batch shows."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per loop, as in a fresh script
    zero = {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})}
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": 0.0, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    # [Note: accelerate on CPU] accelerate picks a process-group backend only for accelerators
    # (nccl, ...); on a CPU machine it would count one process. Naming gloo is the supported
    # switch (the default group that run_on_ranks set up is reused).
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    world_size = accelerator.num_processes
    model = llama(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=ACC_LR)
    data = token_batches(1, ACC_STEPS * accumulation * rows * world_size, seed=3)[0]
    loader = torch.utils.data.DataLoader(data, batch_size=rows)  # accelerate gives each rank its batches
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for ids in loader:
        with accelerator.accumulate(engine):
            loss = engine(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    steps = engine.global_steps
    assert len(losses) == ACC_STEPS * accumulation and steps == ACC_STEPS, (len(losses), steps)
    return {"engine": type(engine).__name__, "processes": world_size, "losses": losses,
            "weights": accelerator.get_state_dict(engine)}


def _accelerate_loops(rank, world_size):
    _hf_rank_env(rank, world_size)
    # ZeRO-3 last: its plugin may leave transformers' zero.Init switch (a weak reference) set
    return {"ragged": _accelerate_loop("ragged", 2, ACC_ROWS),
            "ragged, doubled batch": _accelerate_loop("ragged", 1, 2 * ACC_ROWS),
            "zero3": _accelerate_loop(3, 2, ACC_ROWS)}


@pytest.mark.slow
def test_accelerate_loop_with_accumulation_matches_zero3():
    """``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=2)``
    and ``accelerator.accumulate(model)`` on 2 ranks (crashed in ``Accelerator.no_sync`` before
    the plugin's ``zero_stage`` read 3, see integrations/deepspeed/accelerate_stage.py):

    * ragged = ZeRO-3 (accumulation 2): every micro-batch's loss on every rank (the first
      step's bit for bit: the same weights) to 5e-6, and the final weights to 1e-6;
    * ragged with accumulation 2 = ragged without accumulation on micro-batches twice as
      large (the same rows per step): each step's loss averaged over ranks and micro-batches
      to 5e-6, and the final weights to 1e-6.

    Not bit for bit (fp32): the runs sum the same gradients in other orders (ZeRO-3 reduces
    every micro-batch, ragged once per step; the doubled batch sums inside the matmuls).
    Measured: weights 6e-8 apart, losses (about 6.2) one ulp, 4.8e-7. A wrong accumulation
    (a micro-batch lost, or the gradient not divided by 2) moves weights by about
    ACC_LR * gradient: up to 1e-2 here (the weights move 4e-2 in all).
    """
    runs = run_on_ranks(_accelerate_loops, 2, timeout=400)
    for name, run in runs[0].items():
        assert run["processes"] == 2, (name, run["processes"])
        assert run["engine"] == ("DeepSpeedEngine" if name == "zero3" else "RaggedDeepSpeedEngine"), name
    ragged, zero3, doubled = (runs[0][k]["weights"] for k in ("ragged", "zero3", "ragged, doubled batch"))
    assert set(ragged) == set(zero3) == set(doubled) == set(llama(seed=0).state_dict())
    initial = llama(seed=0).state_dict()
    moved = max((ragged[k] - initial[k]).abs().max().item() for k in ragged)
    assert moved > 1e-2, f"the weights hardly moved ({moved:.3g}): the comparisons would not see a wrong update"
    for key in ragged:
        assert_close(ragged[key], zero3[key], f"weights vs ZeRO-3: {key}", rtol=0, atol=1e-6)
        assert_close(ragged[key], doubled[key], f"weights vs the doubled batch: {key}", rtol=0, atol=1e-6)
    for rank, run in enumerate(runs):
        ours, theirs = run["ragged"]["losses"], run["zero3"]["losses"]
        assert ours[:2] == theirs[:2], (rank, ours[:2], theirs[:2])  # step 1: the initial weights
        assert_close(torch.tensor(ours), torch.tensor(theirs), f"rank {rank} losses vs ZeRO-3", rtol=0, atol=5e-6)
    per_step = torch.tensor([r["ragged"]["losses"] for r in runs]).view(len(runs), ACC_STEPS, 2).mean((0, 2))
    doubled_per_step = torch.tensor([r["ragged, doubled batch"]["losses"] for r in runs]).mean(0)
    assert_close(per_step, doubled_per_step, "per-step loss vs the doubled batch", rtol=0, atol=5e-6)


# ---- 2. activation recompute ----------------------------------------------------------------

RC_STEPS, RC_ROWS, RC_LR = 2, 6, 1e-2  # 6 rows: an even split over 2 and 3 ranks
FAMILIES = {"hf": "model.gradient_checkpointing_enable(use_reentrant=R)",
            "around": "torch.utils.checkpoint.checkpoint(layer, hidden, use_reentrant=R) in a loop over the layers"}


class LayerLoop(nn.Module):
    """The Llama model run as a plain loop over its decoder layers; ``reentrant`` not None:
    each layer's call (its hooks included) under ``torch.utils.checkpoint``."""

    def __init__(self, lm: nn.Module, reentrant: Optional[bool]) -> None:
        super().__init__()
        self.lm, self.reentrant = lm, reentrant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inner = self.lm.model
        hidden = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        rope = inner.rotary_emb(hidden, positions)
        for layer in inner.layers:
            call = functools.partial(layer, position_embeddings=rope, position_ids=positions)
            hidden = call(hidden) if self.reentrant is None else checkpoint(call, hidden, use_reentrant=self.reentrant)
        logits = self.lm.lm_head(inner.norm(hidden))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _train_variant(family: str, reentrant: Optional[bool], tie: bool, world: Optional[Tuple[int, int]],
                   forced_grads: Optional[list] = None):
    """RC_STEPS AdamW steps: ``{"steps": per step the gradients (before the step) and the
    parameters (after) as {name: (start, end, shape, local tensor)}, "mlp_calls": how often the
    layers' MLPs ran their last projection (twice per step and layer when recompute runs)}``. ``world`` None:
    unsharded, the whole global batch; then ``forced_grads`` (per step, full gradients by
    name), if given, replace the model's own before each step (its own are still reported)."""
    import vescale_zero as vz

    lm = llama(seed=0, tie_word_embeddings=tie)
    if family == "hf":
        if reentrant is not None:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        net, loss_of = lm, lambda ids: lm(input_ids=ids, labels=ids).loss
    else:
        net = LayerLoop(lm, reentrant)
        loss_of = net
    net.train()
    if world is not None:
        for layer in lm.model.layers:
            vz.fully_shard(layer)
        vz.fully_shard(net)  # embeddings (tied or not), final norm, head: the root group
    opt = torch.optim.AdamW(net.parameters(), lr=RC_LR, weight_decay=0.1)
    mlp_calls = []  # a pre-hook: non-reentrant recompute stops after the last saved activation (down_proj's input)
    for layer in lm.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(lambda *_: mlp_calls.append(1))

    def pieces(tensors):
        out = {}
        for name, p in net.named_parameters():
            t = tensors(p)
            r = getattr(p, "sharded_range", None)  # (start, end, shape, granularity) of the full flat tensor
            start, end, shape = (r.start, r.end, r.shape) if r is not None else (0, p.numel(), p.shape)
            local = None if t is None else (t.to_local() if r is not None else t)  # a DTensor's piece
            out[name] = (start, end, tuple(shape), None if local is None else local.detach().clone())
        return out

    steps = []
    for step, batch in enumerate(token_batches(RC_STEPS, RC_ROWS, seed=2)):
        ids = batch if world is None else batch.chunk(world[1])[world[0]]
        loss_of(ids).backward()
        grads = pieces(lambda p: p.grad)
        if forced_grads is not None:
            for name, p in net.named_parameters():
                p.grad = forced_grads[step][name].clone()
        opt.step()
        opt.zero_grad()
        steps.append({"grads": grads, "params": pieces(lambda p: p)})
    return {"steps": steps, "mlp_calls": len(mlp_calls)}


def _recompute_variants(rank, world_size, families, tie):
    """Every family's run without recompute, then with it (reentrant and not), in one launch.
    A failing variant is reported, not raised, while every rank failed alike (the others
    still run); a failure on some ranks only ends the launch (collectives would pair wrongly)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    out = {}
    for family in families:
        for reentrant in (None, True, False):
            try:
                out[(family, reentrant)] = _train_variant(family, reentrant, tie, (rank, world_size))
                failed = 0
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[(family, reentrant)] = f"{type(e).__name__}: {e}"
                failed = 1
            flag = torch.tensor([failed])
            dist.all_reduce(flag)
            if flag.item() not in (0, world_size):
                raise RuntimeError(f"{family} reentrant={reentrant} failed on {flag.item()} of {world_size} ranks: "
                                   f"{out[(family, reentrant)] if failed else 'not this one'}")
    return out


RC_WORLDS = {2: False, 3: True}  # world size -> tied embeddings: both layouts of the root group
_launches = {}


def recompute_runs(world_size):
    """Every rank's pieces per family and variant: one launch per world size, shared by the
    tests below (a launch that failed fails them all, without launching again)."""
    if world_size not in _launches:
        try:
            _launches[world_size] = run_on_ranks(_recompute_variants, world_size, tuple(FAMILIES),
                                                 RC_WORLDS[world_size], timeout=400)
        except (AssertionError, TimeoutError) as e:
            _launches[world_size] = e
    if isinstance(_launches[world_size], Exception):
        raise AssertionError(f"the {world_size}-rank launch failed") from _launches[world_size]
    return _launches[world_size]


def unsharded_reference(family, tie, sharded_steps):
    """One process, the whole global batch, no recompute, one intra-op thread like the ranks;
    at each step its own gradients, then an AdamW step on the sharded run's gradients
    (teacher forcing: see assert_matches_unsharded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = _train_variant(family, None, tie, None, forced_grads=[s["grads"] for s in sharded_steps])["steps"]
    finally:
        torch.set_num_threads(threads)
    return [{kind: {n: t for n, (_, _, _, t) in step[kind].items()} for kind in step} for step in steps]


def reassembled(results, family, reentrant):
    """Per step, the full gradients and parameters put together from every rank's pieces."""
    runs = [r[(family, reentrant)] for r in results]
    failed = [f"rank {k}: {run}" for k, run in enumerate(runs) if isinstance(run, str)]
    assert not failed, f"{FAMILIES[family]}, R={reentrant}: " + "; ".join(failed)
    calls = (1 if reentrant is None else 2) * LAYERS * RC_STEPS
    ran = [run["mlp_calls"] for run in runs]
    assert all(n == calls for n in ran), f"{FAMILIES[family]}, R={reentrant}: down_proj ran {ran} times, not {calls}"
    runs = [run["steps"] for run in runs]
    steps = []
    for step in range(RC_STEPS):
        full = {}
        for kind in ("grads", "params"):
            full[kind] = {}
            for name, (_, _, shape, _) in runs[0][step][kind].items():
                flat = torch.full((torch.Size(shape).numel(),), float("nan"))
                for run in runs:
                    start, end, _, local = run[step][kind][name]
                    assert local is not None or end == start, f"{name}: no {kind} on a rank holding elements"
                    if end > start:
                        flat[start:end] = local.reshape(-1)
                assert not flat.isnan().any(), f"{name}: the ranks' pieces do not cover the tensor"
                full[kind][name] = flat.view(shape)
        steps.append(full)
    return steps


def assert_matches_unsharded(steps, family, tie, what):
    """At every step the sharded run's gradients are within 1e-6 (absolute) of the unsharded
    model's at the same weights, and its parameters after AdamW within 1e-6 of the unsharded
    AdamW step taken on the same gradients. The reference is teacher-forced (it steps on the
    sharded gradients) because a free-running one drifts by far more than 1e-6 for a reason
    that is not ours: Adam's first steps divide each gradient by about its own size (+ eps
    1e-8), so a gradient near 1e-8 that two summation orders round 3% apart moves its weight
    up to 1.6e-4 apart at LR 1e-2 (measured for the sharded run without recompute), and the
    next step's gradients then differ by 2e-6."""
    reference = unsharded_reference(family, tie, steps)
    for step, (got, want) in enumerate(zip(steps, reference)):
        assert set(got["grads"]) == set(want["grads"]), what
        for name in want["grads"]:
            assert_close(got["grads"][name], want["grads"][name], f"{what} step {step} grad {name}", rtol=0, atol=1e-6)
            assert_close(got["params"][name], want["params"][name], f"{what} step {step} param {name}", rtol=0,
                         atol=1e-6)


def assert_bit_exact(steps, baseline, what):
    """Recompute replays the same deterministic ops on the same weights: the same bits."""
    for step, (got, want) in enumerate(zip(steps, baseline)):
        for kind in ("grads", "params"):
            for name, value in want[kind].items():
                diff = (got[kind][name] - value).abs().max().item()
                assert torch.equal(got[kind][name], value), f"{what} step {step} {kind} {name}: max |diff| {diff:.3g}"


@pytest.mark.parametrize("world_size", sorted(RC_WORLDS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_llama_without_recompute_matches_unsharded(family, world_size):
    steps = reassembled(recompute_runs(world_size), family, None)
    assert_matches_unsharded(steps, family, RC_WORLDS[world_size], f"{family}, no recompute, {world_size} ranks")


@pytest.mark.parametrize("world_size", sorted(RC_WORLDS))
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recompute_matches_no_recompute_and_unsharded(family, reentrant, world_size):
    """``hf``: ``gradient_checkpointing_enable`` on the sharded Llama (Hugging Face
    checkpoints each layer's ``forward``, inside the layer's hooks); ``around``:
    ``torch.utils.checkpoint`` around each sharded layer's call (hooks inside the recompute).
    Gradients and updated parameters equal the sharded run without recompute bit for bit
    and the unsharded run as in the test above; the recompute did run (down_proj twice).
    Pending the core's recompute support (issue 13): ``hf`` crashes in backward (the
    recompute reads the 1-D shards), ``around`` with R=True leaves every layer parameter
    without a gradient."""
    results = recompute_runs(world_size)
    what = f"{FAMILIES[family]}, R={reentrant}, {world_size} ranks"
    steps = reassembled(results, family, reentrant)
    assert_bit_exact(steps, reassembled(results, family, None), what)
    assert_matches_unsharded(steps, family, RC_WORLDS[world_size], what)


# ---- 1b. evaluate before any training ---------------------------------------------------------


def _evaluate_untrained(rank, world_size, stage, out):
    """``trainer.evaluate()`` on a Trainer that never trained (transformers' inference branch of
    ``deepspeed_init``: the config's optimizer and scheduler dropped): (engine class, eval loss)."""
    from transformers import Trainer, TrainingArguments

    _hf_rank_env(rank, world_size)
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
                 "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    args = TrainingArguments(output_dir=out, deepspeed=ds_config, use_cpu=True, per_device_eval_batch_size=2,
                             report_to=[], disable_tqdm=True)
    trainer = Trainer(model=llama(seed=0), args=args)
    evaluation = [{"input_ids": x, "labels": x} for x in token_batches(1, 8, seed=4)[0]]
    loss = trainer.evaluate(evaluation)["eval_loss"]
    return type(trainer.model_wrapped).__name__, loss


@pytest.mark.slow
def test_evaluate_before_training_like_zero3(tmp_path):
    """``trainer.evaluate()`` before any ``train()`` runs with "ragged" (transformers takes its
    ZeRO-3 inference path, as ``is_zero3()`` reads True) and gives ZeRO-3's evaluation loss bit
    for bit: the same untrained weights, the same batches, each rank's forward on full weights.
    (Without ragged reading as ZeRO-3 there, transformers refuses: "ZeRO inference only makes
    sense with ZeRO Stage 3".) About 50 s on 2 cores: two Trainer jobs."""
    ragged = run_on_ranks(_evaluate_untrained, 2, "ragged", str(tmp_path / "ragged"), timeout=300)
    zero3 = run_on_ranks(_evaluate_untrained, 2, 3, str(tmp_path / "zero3"), timeout=300)
    assert [r[0] for r in ragged] == ["RaggedDeepSpeedEngine"] * 2 and [r[0] for r in zero3] == ["DeepSpeedEngine"] * 2
    assert [r[1] for r in ragged] == [r[1] for r in zero3], (ragged, zero3)
