"""Megatron-LM's own loop, from megatron-core's wheel, under ``--use-vescale-fsdp`` (issue 45).

megatron-core's wheels carry Megatron-LM (``megatron.training``) from 0.17 on. Here its own
``initialize_megatron``, ``setup_model_and_optimizer`` and ``train`` -- the loop, its ``no_sync``
wiring, the distributed optimizer, a job stopped by ``--exit-interval`` after its save and resumed
by ``--load`` (its default ``torch_dist`` format) -- train a tiny GPTModel on 2 CPU ranks (gloo;
the test-only CUDA shim), with ``--use-vescale-fsdp`` and with megatron-core's DDP, the same
flags otherwise; and a DDP job's own checkpoint resumes under ``--use-vescale-fsdp``. Nothing of
Megatron-LM is mirrored: the test plays only what a pretraining script gives ``pretrain``'s
pieces (the model provider, the forward step, a data iterator). Where the installed
megatron-core has no ``megatron.training`` (0.15, 0.16) the module skips;
tests/test_megatron_lm_train.py's stand-in of core_v0.16.1 covers those. One spawn of 2 ranks
runs every case.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import sys
import typing
import warnings
from typing import Any, Dict, List

import pytest
import torch

if not hasattr(typing, "override"):  # Python 3.11: megatron-core 0.18+'s megatron.training imports 3.12's name
    import typing_extensions

    typing.override = typing_extensions.override

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")
if importlib.util.find_spec("megatron.training") is None:  # a wheel that has it and fails to import: an error
    pytest.skip("megatron-core's wheel carries Megatron-LM (megatron.training) from 0.17 on", allow_module_level=True)

from tests.distributed import run_cases_on_ranks  # noqa: E402

# one spawn of 2 ranks, 12 Megatron-LM jobs (each initialised anew), two torch_dist saves: ~65 s on 2 cores
pytestmark = pytest.mark.slow

SEQ, VOCAB = 16, 64
# 2 data-parallel ranks x 2 micro-batches of 2: every reduced gradient sums two micro-batches on a
# rank, then two ranks. No dropout, no fused kernels, no clipping (its norm sums in another order).
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB), "--micro-batch-size", "2",
        "--global-batch-size", "8", "--lr", "1e-2", "--weight-decay", "0.1", "--clip-grad", "0",
        "--disable-bias-linear", "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo",
        "--no-gradient-accumulation-fusion", "--transformer-impl", "local", "--use-cpu-initialization",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--lr-decay-style", "constant", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"]
ITERS, SAVED_AT = 4, 2
VARIANTS = {
    "ddp_config": [],
    # Megatron-LM's train() then sets no_sync (by isinstance on the chunks) and the param-sync hooks
    "distributed_optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
}


def _megatron_lm_on_cpu() -> None:
    """Test-only, on top of tests/megatron_shim.py's CUDA shim: Megatron-LM's initialisation asks
    for a device count and compiles its dataset helpers (C++), neither needed here."""
    from tests.megatron_shim import install_cuda_shim

    install_cuda_shim()
    torch.cuda.device_count = lambda: 1
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def _reset_megatron() -> None:
    """Megatron-LM's process-wide state, as a fresh process has it: the next case initialises again."""
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    destroy_rerun_state_machine()
    parallel_state.destroy_model_parallel()


def _initialize(argv: List[str]) -> Any:
    """Megatron-LM's argument parsing (with our flags) and ``initialize_megatron``, as ``pretrain``
    does them: 0.17 parses inside ``initialize_megatron``, 0.18 on before it."""
    from megatron.training import arguments, get_args
    from megatron.training.initialize import initialize_megatron

    from vescale_zero.integrations.megatron import add_vescale_fsdp_args, use_vescale_fsdp_in_megatron_lm

    sys.argv = ["pretrain_gpt.py"] + argv
    if "extra_args_provider" in inspect.signature(initialize_megatron).parameters:
        initialize_megatron(extra_args_provider=add_vescale_fsdp_args, allow_no_cuda=True)
    else:
        arguments.parse_and_validate_args(extra_args_provider=add_vescale_fsdp_args)
        initialize_megatron(allow_no_cuda=True)
    use_vescale_fsdp_in_megatron_lm()
    return get_args()


def _batches(args: Any):
    """Each iteration's global batch (the same on every rank, drawn from the iteration's number:
    a resumed run sees what the uninterrupted one saw), this rank's micro-batches of it."""
    from megatron.core import parallel_state

    dp, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(args.micro_batch_size, SEQ).contiguous()
    iteration = args.iteration
    while True:
        tokens = torch.randint(0, VOCAB, (args.global_batch_size, SEQ + 1),
                               generator=torch.Generator().manual_seed(1000 + iteration))[dp::size]
        for i in range(0, tokens.shape[0], args.micro_batch_size):
            t = tokens[i:i + args.micro_batch_size]
            yield {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "position_ids": position_ids}
        iteration += 1


def _train(rank: int, world_size: int, argv: List[str]) -> Dict[str, Any]:
    """One Megatron-LM job: initialise, ``setup_model_and_optimizer`` (which loads ``--load``),
    ``train`` (which saves at ``--save-interval``); each micro-batch's loss, the full weights at
    the end, and what the loop wired."""
    _megatron_lm_on_cpu()
    _reset_megatron()
    args = _initialize(argv)
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_model_config
    from megatron.training import training
    from megatron.training.arguments import core_transformer_config_from_args

    def model_provider(pre_process=True, post_process=True, config=None, **unused):
        return GPTModel(config=config or core_transformer_config_from_args(args),
                        transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=True)

    losses: List[float] = []

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        losses.append(loss.item())
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func

    from tests.megatron_shim import megatron_optimizer_on_cpu

    setup = training.setup_model_and_optimizer
    params = list(inspect.signature(setup).parameters)
    kwargs: Dict[str, Any] = {}
    if "cfg_container" in params:  # 0.19
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        kwargs["cfg_container"] = pretrain_cfg_container_from_args(args)
    # megatron-core's own distributed optimizer accepts only CUDA tensor types: the DDP side's shim
    ours = args.use_vescale_fsdp
    with contextlib.nullcontext() if ours else megatron_optimizer_on_cpu(), \
            warnings.catch_warnings(record=True) as caught:  # the shim: also for its checkpoints
        warnings.simplefilter("always")
        if params[0] == "model_provider_func":  # 0.17, 0.18
            model, optimizer, scheduler = setup(model_provider, ModelType.encoder_or_decoder, **kwargs)
        else:
            model, optimizer, scheduler = setup(ModelType.encoder_or_decoder, model_provider_func=model_provider,
                                                **kwargs)
    first = args.iteration
    config = get_model_config(model[0])
    try:
        iteration, _ = training.train(forward_step, model, optimizer, scheduler, RerunDataIterator(_batches(args)),
                                      None, None, config, {}, None)
        exited = None
    except SystemExit as e:  # --exit-interval: Megatron-LM saves, then exits the process
        iteration, exited = None, e.code
    no_sync = config.no_sync_func
    weights = {k: v.detach().clone() for k, v in model[0].state_dict().items()
               if torch.is_tensor(v) and not k.endswith("_extra_state")}
    return {"losses": losses, "first": first, "iteration": iteration, "exited": exited, "weights": weights,
            "wrapper": type(model[0]).__name__, "optimizer": type(optimizer).__name__,
            "said": [str(w.message) for w in caught if "has no effect under --use-vescale-fsdp" in str(w.message)],
            "no_sync": None if no_sync is None else getattr(no_sync, "__self__", no_sync) is model[0]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Dict[Any, List[Dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("megatron_lm_wheel"))
    cases = {}
    for variant, flags in VARIANTS.items():
        argv = ARGV + flags + ["--train-iters", str(ITERS)]
        saved = os.path.join(root, variant)
        cases[(variant, "ddp")] = (_train, (argv,))
        cases[(variant, "ours")] = (_train, (argv + ["--use-vescale-fsdp"],))
        # a job stopped by --exit-interval (Megatron-LM saves, then exits), resumed by --load
        cases[(variant, "ours saved")] = (_train, (argv + [
            "--use-vescale-fsdp", "--exit-interval", str(SAVED_AT), "--save", saved, "--save-interval", str(ITERS)],))
        cases[(variant, "ours resumed")] = (_train, (argv + ["--use-vescale-fsdp", "--load", saved],))
        # a running DDP job migrates: its own checkpoint resumed under --use-vescale-fsdp (the distributed
        # optimizer's state as Megatron saves it to reshard: integrations/megatron/optimizer.py refuses the
        # bucket-laid 'dp_reshardable' default in one line naming this flag)
        reshardable = ["--dist-ckpt-optim-fully-reshardable"] if "--use-distributed-optimizer" in flags else []
        cases[(variant, "ddp saved")] = (_train, (argv + reshardable + [
            "--exit-interval", str(SAVED_AT), "--save", saved + "_ddp", "--save-interval", str(ITERS)],))
        cases[(variant, "ours from ddp")] = (_train, (argv + ["--use-vescale-fsdp", "--load", saved + "_ddp"],))
    return run_cases_on_ranks(cases, 2, timeout=600)


def _differ(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_lm_train_equals_megatron_core_ddp(results, variant):
    """Megatron-LM's train() from the wheel under --use-vescale-fsdp (RaggedFSDP, our optimizer)
    trains as under megatron-core's DDP, bit for bit: every micro-batch's loss over 4 iterations and
    every weight after them (fp32; dp 2: each reduced gradient is a sum of two ranks' terms, which
    is the same in either order, and each rank's micro-batch sum is local to it in both; AdamW on
    the same elements). With --overlap-grad-reduce Megatron-LM wires our chunks' no_sync. No flag is
    named as without effect: none is given that is (Megatron-LM's defaults included)."""
    for ddp, ours in zip(results[(variant, "ddp")], results[(variant, "ours")]):
        assert (ddp["wrapper"], ours["wrapper"], ours["optimizer"]) == (
            "DistributedDataParallel", "RaggedFSDP", "RaggedOptimizer"), (ddp, ours)
        assert ours["iteration"] == ddp["iteration"] == ITERS
        assert len(ours["losses"]) == 2 * ITERS and ours["losses"] == ddp["losses"], (ours["losses"], ddp["losses"])
        assert _differ(ddp["weights"], ours["weights"]) == []
        assert ours["said"] == [], ours["said"]  # every flag given means something here (nothing to say)
        assert ours["no_sync"] == ddp["no_sync"] == (True if "--overlap-grad-reduce" in VARIANTS[variant] else None)


def _resumes_as_uninterrupted(results, variant: str, saved_job: str, resumed_job: str) -> None:
    """``saved_job`` stopped at iteration SAVED_AT after its save, ``resumed_job`` loaded it and
    trained to ITERS: each equals its part of the uninterrupted DDP run, bit for bit."""
    for ddp, saved, resumed in zip(results[(variant, "ddp")], results[(variant, saved_job)],
                                   results[(variant, resumed_job)]):
        assert (saved["exited"], resumed["first"], resumed["iteration"]) == (0, SAVED_AT, ITERS), (saved, resumed)
        assert saved["losses"] == ddp["losses"][:2 * SAVED_AT]
        assert resumed["losses"] == ddp["losses"][2 * SAVED_AT:], (resumed["losses"], ddp["losses"])
        assert _differ(ddp["weights"], resumed["weights"]) == []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_lm_resumes_its_own_checkpoint(results, variant):
    """Saved by Megatron-LM's train() at iteration 2 (--save-interval, its default torch_dist
    format) under --use-vescale-fsdp and resumed with --load in a fresh job: the resumed iterations'
    losses and the final weights equal the uninterrupted run's bit for bit (the fp32 masters,
    Adam's moments and step, and the iteration all come back)."""
    _resumes_as_uninterrupted(results, variant, "ours saved", "ours resumed")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_lm_resumes_megatron_core_ddp_checkpoint(results, variant):
    """A running megatron-core DDP job migrates: its own checkpoint (torch_dist, saved by
    Megatron-LM's train() at --exit-interval 2) resumed with --load under --use-vescale-fsdp
    trains on as the uninterrupted DDP run, bit for bit (losses of iterations 3-4, final weights)."""
    _resumes_as_uninterrupted(results, variant, "ddp saved", "ours from ddp")
