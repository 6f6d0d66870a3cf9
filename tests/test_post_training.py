"""Post-training jobs (TRL's trainers, PEFT through the Hugging Face Trainer) on "ragged" as on stage 3 (issue 38).

Each job is run as a new user runs it -- a model saved to a directory and loaded by path, so the
trainer builds it under ``deepspeed.zero.Init`` (the Hugging Face docs' order for ZeRO-3) -- at
stage 3 and at "ragged", with the same seeds, in fp32 (``bf16=False``: TRL's default bf16 would
compute in bf16 under "ragged" but in fp32 under stage 3, whose ``zero.Init`` partitions stay fp32
when accelerate adds the bf16 section after the model was built; see docs/post_training.md).

1. TRL's SFT, GRPO without a KL term: they read ZeRO-3's ``ds_status`` of the LM head (crashed:
   "'Parameter' object has no attribute 'ds_status'").
2. TRL's DPO, GRPO with ``beta`` > 0, RLOO and KTO: their reference model goes through TRL's
   ``prepare_deepspeed``, which made it a stage-0 engine over a model built partitioned
   ("'weight' must be 2-D").
3. PEFT LoRA with ``TrainingArguments(deepspeed=...)`` before ``from_pretrained`` and
   ``get_peft_model`` after it (refused: "all parameters of one fully_shard group must share a
   dtype and a device ... base_layer.weight on meta, lora_A.default.weight on cpu"), and the other
   order (model loaded first).

Compared with stage 3 in the same spawn: the first step's loss (and GRPO's / RLOO's rewards)
bit for bit (the same weights and data, the forward does not depend on the sharding), and the
saved weights within what the job's AdamW steps can move two runs apart (tests/numerics.py
[Note: comparing runs that sum in another order]).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")  # the [test] extra installs trl, peft, transformers, accelerate and deepspeed
pytest.importorskip("peft")

from tests.distributed import run_cases_on_ranks  # noqa: E402
from tests.numerics import adam_divergence_bound  # noqa: E402
from tests.test_huggingface import VOCAB, _hf_rank_env, llama  # noqa: E402

STEPS, LR, ROWS = 2, 1e-2, 8
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def _tokenizer():
    """A word-level tokenizer over the tiny Llama's vocabulary ("w4" ... "w511"), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def save_tiny_llama(directory):
    """The tiny Llama of test_huggingface (seed 0) and its tokenizer, saved as a model directory."""
    llama(seed=0, pad_token_id=0, eos_token_id=1, bos_token_id=2).save_pretrained(directory)
    _tokenizer().save_pretrained(directory)


def _words(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(len(SPECIALS), VOCAB, (n,), generator=g))


def _reward(completions, **_):
    """A deterministic reward: how many of the completion's words are in the lower half of the vocabulary."""
    return [float(sum(int(w[1:]) < VOCAB // 2 for w in c.split() if w[1:].isdigit())) for c in completions]


def _ds_config(stage):
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}


def _common_args(stage, out):
    return dict(output_dir=out, deepspeed=_ds_config(stage), use_cpu=True, bf16=False, per_device_train_batch_size=2,
                max_steps=STEPS, learning_rate=LR, report_to=[], disable_tqdm=True, logging_steps=1, seed=0,
                save_strategy="no")


def _trl_trainer(kind, stage, model_dir, out):
    """The TRL trainer of ``kind`` on the saved model (loaded by path: built under zero.Init)."""
    import trl
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    prompts = [_words(g, 5) for _ in range(ROWS)]
    common = dict(model=model_dir, processing_class=_tokenizer())
    args = _common_args(stage, out)
    if kind == "sft":
        data = Dataset.from_dict({"text": [_words(g, 12) for _ in range(ROWS)]})
        return trl.SFTTrainer(args=trl.SFTConfig(max_length=16, **args), train_dataset=data, **common)
    if kind.startswith("grpo"):
        beta = 0.0 if kind == "grpo" else 0.04
        return trl.GRPOTrainer(reward_funcs=_reward, train_dataset=Dataset.from_dict({"prompt": prompts}), **common,
                               args=trl.GRPOConfig(num_generations=2, max_completion_length=4, beta=beta, **args))
    if kind == "rloo":  # its default beta (0.05): a reference model
        return trl.RLOOTrainer(reward_funcs=_reward, train_dataset=Dataset.from_dict({"prompt": prompts}), **common,
                               args=trl.RLOOConfig(num_generations=2, max_completion_length=4, **args))
    if kind == "dpo":
        data = Dataset.from_dict({"prompt": prompts, "chosen": [_words(g, 4) for _ in range(ROWS)],
                                  "rejected": [_words(g, 4) for _ in range(ROWS)]})
        return trl.DPOTrainer(args=trl.DPOConfig(max_length=16, **args), train_dataset=data, **common)
    if kind == "kto":
        data = Dataset.from_dict({"prompt": prompts, "completion": [_words(g, 4) for _ in range(ROWS)],
                                  "label": [True, False] * (ROWS // 2)})
        return trl.KTOTrainer(args=trl.KTOConfig(max_length=16, **args), train_dataset=data, **common)
    raise ValueError(kind)


def _saved(directory, name="model.safetensors"):
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, name))


def _trl_job(rank, world_size, kind, stage, model_dir, out):
    """One TRL job: the per-step logs and the engine's class; the model saved in ``out``."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one job per "script"
    trainer = _trl_trainer(kind, stage, model_dir, out)
    trainer.train()
    trainer.save_model(out)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"engine": type(trainer.model_wrapped).__name__, "logs": logs,
            "ref engine": type(getattr(trainer, "ref_model", None)).__name__}


def _peft_job(rank, world_size, order, stage, model_dir, out):
    """LoRA through the Hugging Face Trainer. ``"hf docs"``: ``TrainingArguments(deepspeed=...)``
    first, then ``from_pretrained`` (built under zero.Init) and ``get_peft_model``; ``"loaded
    first"``: the model is loaded before the arguments exist (not partitioned)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)
    if order == "loaded first":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(**_common_args(stage, out))
    if order == "hf docs":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    torch.manual_seed(0)  # the adapters' initial values
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0))
    tok = _tokenizer()
    g = torch.Generator().manual_seed(0)
    data = Dataset.from_dict(dict(tok([_words(g, 12) for _ in range(ROWS)])))
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    trainer.save_model(out)
    return {"engine": type(trainer.model_wrapped).__name__, "partitioned": partitioned,
            "logs": [h for h in trainer.state.log_history if "loss" in h]}


def _job(rank, world_size, what, *args):
    _hf_rank_env(rank, world_size)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # what accelerate does first on a GPU machine
    return (_peft_job if what == "peft" else _trl_job)(rank, world_size, *args)


TRL_KINDS = ("sft", "grpo", "grpo_kl", "dpo", "rloo", "kto")
PEFT_ORDERS = ("hf docs", "loaded first")
_runs = {}


def post_training_runs(tmp_path_factory):
    """Every job at stage 3 and at "ragged", in one spawn of 2 ranks (shared by the tests below)."""
    if "runs" not in _runs:
        root = tmp_path_factory.mktemp("post_training")
        model_dir = str(root / "tiny-llama")
        save_tiny_llama(model_dir)
        cases = {}
        for stage in ("ragged", 3):
            for kind in TRL_KINDS:
                cases[kind, stage] = (_job, ("trl", kind, stage, model_dir, str(root / f"{kind}-{stage}")))
            for order in PEFT_ORDERS if stage == "ragged" else PEFT_ORDERS[:1]:
                cases[order, stage] = (_job, ("peft", order, stage, model_dir, str(root / f"{order}-{stage}")))
        try:
            _runs["runs"] = (run_cases_on_ranks(cases, 2, timeout=1500), root)
        except (AssertionError, TimeoutError) as e:
            _runs["runs"] = e
    if isinstance(_runs["runs"], Exception):
        raise AssertionError("the post-training spawn failed") from _runs["runs"]
    return _runs["runs"]


def _assert_like_stage3(runs, root, name, engine="RaggedDeepSpeedEngine", weights="model.safetensors"):
    ragged, zero3 = runs[name, "ragged"], runs[name, 3]
    assert ragged[0]["engine"] == engine and zero3[0]["engine"] == "DeepSpeedEngine", (ragged[0], zero3[0])
    ours, theirs = ragged[0]["logs"], zero3[0]["logs"]
    assert [h["step"] for h in ours] == [h["step"] for h in theirs] == list(range(1, STEPS + 1)), (ours, theirs)
    assert ours[0]["loss"] == theirs[0]["loss"], (name, ours[0], theirs[0])  # the same weights and data
    for key in ("reward", "rewards/_reward/mean", "kl"):  # GRPO / RLOO: the first step's generations and scores
        assert ours[0].get(key) == theirs[0].get(key), (name, key, ours[0].get(key), theirs[0].get(key))
    mine, stage3 = _saved(root / f"{name}-ragged", weights), _saved(root / f"{name}-3", weights)
    assert set(mine) == set(stage3) and mine, (name, sorted(set(mine) ^ set(stage3)))
    bound = adam_divergence_bound(LR, STEPS)
    for key, value in mine.items():
        torch.testing.assert_close(value, stage3[key], rtol=0, atol=bound, msg=lambda m, key=key: f"{name} {key}: {m}")
    gap = max((value - stage3[key]).abs().max().item() for key, value in mine.items())
    print(f"{name}: saved weights at most {gap:.2g} from stage 3's (bound {bound:.2g})")  # docs/post_training.md
    return mine


@pytest.mark.slow
@pytest.mark.parametrize("kind", TRL_KINDS)
def test_trl_trainer_runs_as_on_stage3(kind, tmp_path_factory):
    """Cases 1 and 2: each TRL trainer trains on "ragged" (its reference model, where it has one,
    on a ragged engine too), its first loss and rewards equal stage 3's bit for bit, its saved
    model stage 3's within the AdamW bound. One spawn runs every job (about 4 min on 2 cores)."""
    runs, root = post_training_runs(tmp_path_factory)
    _assert_like_stage3(runs, root, kind)
    if kind in ("grpo_kl", "dpo", "rloo", "kto"):
        assert runs[kind, "ragged"][0]["ref engine"] == "RaggedDeepSpeedEngine", runs[kind, "ragged"][0]
        assert runs[kind, 3][0]["ref engine"] == "DeepSpeedEngine", runs[kind, 3][0]


@pytest.mark.slow
def test_peft_in_both_orders_trains_as_on_stage3(tmp_path_factory):
    """Case 3: LoRA on a model built under zero.Init (the Hugging Face docs' order) trains on
    "ragged" as on stage 3 (first loss bit for bit, the saved adapter within the AdamW bound), and
    the same job with the model loaded before the arguments (not partitioned) gives the same
    losses and adapter bit for bit."""
    runs, root = post_training_runs(tmp_path_factory)
    docs, first = runs["hf docs", "ragged"], runs["loaded first", "ragged"]
    assert docs[0]["partitioned"] and not first[0]["partitioned"], (docs[0], first[0])
    adapter = _assert_like_stage3(runs, root, "hf docs", weights="adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)
    assert [h["loss"] for h in docs[0]["logs"]] == [h["loss"] for h in first[0]["logs"]]
    other = _saved(root / "loaded first-ragged", "adapter_model.safetensors")
    assert set(other) == set(adapter) and all(torch.equal(other[k], v) for k, v in adapter.items())
