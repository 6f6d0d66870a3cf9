"""The switch that makes Megatron-LM's builders use ``RaggedFSDP`` under ``--use-vescale-fsdp``.

Megatron-LM (not on the package index) picks the data-parallel class in
``megatron.training.training.get_model`` through the module-level name ``DDP`` (replaced by a
class that builds ``RaggedFSDP`` or Megatron's DDP, and that ``train()``'s ``isinstance``
checks accept: :func:`data_parallel_switch`) and the optimizer through
``get_megatron_optimizer`` (``get_megatron_muon_optimizer`` for ``--optimizer muon``: our
Muon). ``get_model`` first checks our flags (``--use-megatron-fsdp`` / ``--use-torch-fsdp2``
beside ``--use-vescale-fsdp`` would otherwise pick those wrappers silently);
``to_empty_if_meta_device`` leaves a meta model (``--init-model-with-meta-device``) on meta for
``RaggedFSDP`` to initialise; ``calc_params_l2_norm`` (``--log-params-norm``) sums our shards over their own groups
(:func:`params_l2_norm`); ``check_param_hashes_across_dp_replicas``
(``--check-weight-hash-across-dp-replicas-interval``) hashes the full parameters;
``megatron.core.utils.unwrap_model`` peels known wrappers;
``save_checkpoint`` / ``load_checkpoint`` are wrapped so both checkpoint formats see what
they expect (see :func:`checkpoint_saver`). In a
Megatron-LM pretraining script::

    from vescale_zero.integrations.megatron import add_vescale_fsdp_args, use_vescale_fsdp_in_megatron_lm

    use_vescale_fsdp_in_megatron_lm()
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, extra_args_provider=add_vescale_fsdp_args)

Without ``--use-vescale-fsdp`` every call goes to Megatron's own classes unchanged.
"""

from __future__ import annotations

import inspect
import os
import sys
from contextlib import ExitStack
from typing import Any, Callable, List, Optional, Tuple

from vescale_zero import host_patches

from .arguments import (
    check_megatron_optimizer,
    validate_vescale_args,
    vescale_optimizer_block,
    vescale_optimizer_name,
    vescale_options_from_args,
    warn_flags_without_effect,
)
from .data_parallel import RaggedFSDP, params_l2_norm
from .dist_checkpoint import checkpoint_parameters
from .optimizer import RaggedOptimizer, check_dist_checkpoint_optimizer, get_vescale_optimizer

__all__ = ["use_vescale_fsdp_in_megatron_lm", "unwrap_vescale", "data_parallel_switch"]

_GET_ARGS: List[Callable[[], Any]] = []
"""The parsed arguments' getter of the last :func:`use_vescale_fsdp_in_megatron_lm` (what the switches read)."""


def _args() -> Any:
    return _GET_ARGS[-1]()


def _on(args: Any) -> bool:
    return bool(getattr(args, "use_vescale_fsdp", False))


def use_vescale_fsdp_in_megatron_lm(get_args: Optional[Callable[[], Any]] = None) -> None:
    """Route Megatron-LM's model wrapper and optimizer builder through vescale-zero
    whenever the parsed arguments have ``--use-vescale-fsdp`` (``vescale_zero.host_patches``:
    ``install("megatron")``; the replacements below). Idempotent.

    Args:
        get_args: returns the parsed arguments (default: ``megatron.training.get_args``).
    """
    try:
        import megatron.training.training  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "use_vescale_fsdp_in_megatron_lm needs Megatron-LM (megatron.training), which is not on the package "
            "index: install it from a clone (pip install -e Megatron-LM). With megatron-core alone, build "
            "RaggedFSDP and get_vescale_optimizer directly (see examples/megatron/pretrain_gpt.py)"
        ) from e
    if get_args is None:
        from megatron.training import get_args
    _GET_ARGS.append(get_args)
    host_patches.install("megatron")


# ---- the replacements (each given Megatron's own): [Note: host patches] -------------------------------------------


# host patch megatron.core.utils.unwrap_model: checked against megatron-core 0.15.3-0.19.2
def unwrap_vescale(unwrap_model: Callable) -> Callable:
    """``unwrap_model`` that also peels ``RaggedFSDP`` (Megatron's checks name its classes); it is
    imported by name into many modules: replaced in every one (kind ``everywhere``)."""

    def unwrap(model: Any, module_instances: Optional[tuple] = None) -> Any:
        def peel(m: Any) -> Any:
            while isinstance(m, RaggedFSDP):
                m = m.module
            return m

        peeled = [peel(m) for m in model] if isinstance(model, list) else peel(model)
        return unwrap_model(peeled, module_instances) if module_instances is not None else unwrap_model(peeled)

    return unwrap


# host patch megatron.training.training.DDP: checked against megatron-core 0.15.3-0.19.2
def data_parallel_switch(megatron_ddp: type) -> type:
    """What Megatron-LM's module-level ``DDP`` becomes: a class (Megatron-LM tests
    ``isinstance(model[0], (megatron_FSDP, DDP))`` and asserts ``isinstance(chunk, DDP)``) whose
    construction builds ``RaggedFSDP`` under ``--use-vescale-fsdp`` and ``megatron_ddp`` with the
    very same arguments otherwise. Its instances are ``megatron_ddp``'s and ``RaggedFSDP``'s;
    any other attribute is ``megatron_ddp``'s."""

    class _Switch(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            parsed = _args()
            if not _on(parsed):
                return megatron_ddp(*args, **kwargs)
            return _vescale_fsdp(parsed, *args, **kwargs)

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, (megatron_ddp, RaggedFSDP))

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, (megatron_ddp, RaggedFSDP))

        def __getattr__(cls, name: str) -> Any:
            return getattr(megatron_ddp, name)

    return _Switch("DDP", (), {"__module__": __name__, "__doc__": megatron_ddp.__doc__})


def _vescale_fsdp(args: Any, config: Any, ddp_config: Any, module: Any, disable_bucketing: bool = False,
                  **kwargs: Any) -> RaggedFSDP:
    validate_vescale_args(args)
    kwargs.pop("full_param_layout", None)  # distributed-optimizer layouts: not ours
    return RaggedFSDP(config, ddp_config, module, disable_bucketing, options=vescale_options_from_args(args), **kwargs)


_GROUP_ARGUMENTS = ("config_overrides", "no_weight_decay_cond", "scale_lr_cond", "lr_mult",
                    "default_skip_embedding_weight_decay")


# host patch megatron.training.training.get_megatron_optimizer: checked against megatron-core 0.15.3-0.19.2
def optimizer_switch(megatron_optimizer: Callable) -> Callable:
    """``get_megatron_optimizer`` that builds ours under ``--use-vescale-fsdp``."""

    def optimizer(config: Any, model_chunks: Any, *rest: Any, **kwargs: Any):
        args = _args()
        if not _on(args):
            return megatron_optimizer(config, model_chunks, *rest, **kwargs)
        name = vescale_optimizer_name(args)
        # the parameter-group arguments by name, whichever release's order they came in: 0.15's conditions
        # or config_overrides ([Note: one door to Megatron's releases])
        given = inspect.signature(megatron_optimizer).bind(config, model_chunks, *rest, **kwargs).arguments
        groups = {k: given[k] for k in _GROUP_ARGUMENTS if k in given}
        return get_vescale_optimizer(config, model_chunks, groups.pop("config_overrides", None), optimizer=name,
                                     block=vescale_optimizer_block(args) if name else None, **groups)

    return optimizer


# host patch megatron.training.training.get_megatron_muon_optimizer: checked against Megatron-LM 0.15.3-0.19.2
def muon_optimizer_switch(megatron_muon: Callable) -> Callable:
    """``get_megatron_muon_optimizer`` (``--optimizer muon``) that builds our Muon under ``--use-vescale-fsdp``."""

    def muon_optimizer(config: Any, model_chunks: Any, *rest: Any, **kwargs: Any):
        args = _args()
        if not _on(args):
            return megatron_muon(config, model_chunks, *rest, **kwargs)
        check_megatron_optimizer(args)
        return get_vescale_optimizer(config, model_chunks, kwargs.pop("config_overrides", None), optimizer="muon")

    return muon_optimizer


# host patch megatron.training.training.get_model: checked against Megatron-LM 0.15.3-0.19.2
def checked_get_model(megatron_get_model: Callable) -> Callable:
    """``get_model`` that checks our flags first (``--use-megatron-fsdp`` / ``--use-torch-fsdp2``
    beside ``--use-vescale-fsdp`` would otherwise pick those wrappers silently)."""

    def get_model(*args: Any, **kwargs: Any):
        parsed = _args()
        if _on(parsed):
            validate_vescale_args(parsed)  # before Megatron-LM picks Megatron-FSDP / FSDP2 by their flags
            warn_flags_without_effect(parsed)
        return megatron_get_model(*args, **kwargs)

    return get_model


# host patch megatron.training.training.to_empty_if_meta_device: checked against Megatron-LM 0.15.3-0.19.2
def kept_on_meta(megatron_to_empty: Callable) -> Callable:
    """``to_empty_if_meta_device`` (``--init-model-with-meta-device``) that leaves the model on meta
    under ``--use-vescale-fsdp``."""

    def to_empty_if_meta_device(module: Any, *rest: Any, **kwargs: Any) -> Any:
        # [Note: meta models reach RaggedFSDP] get_model empties a meta model before wrapping it
        # unless FSDP2 / Megatron-FSDP is chosen: under --use-vescale-fsdp it stays on meta, so
        # RaggedFSDP shards it and initialises each module as its constructor would (meta_init.py).
        if _on(_args()):
            return module
        return megatron_to_empty(module, *rest, **kwargs)

    return to_empty_if_meta_device


# host patch megatron.training.training.calc_params_l2_norm: checked against Megatron-LM 0.15.3-0.19.2
def params_norm_of_shards(megatron_params_norm: Callable) -> Callable:
    """``calc_params_l2_norm`` (``--log-params-norm``) that sums our shards over their own groups."""

    def calc_params_l2_norm(model: Any, *rest: Any, **kwargs: Any) -> float:
        chunks = _chunks_of(model)
        return params_l2_norm(chunks) if chunks else megatron_params_norm(model, *rest, **kwargs)

    return calc_params_l2_norm


# host patch megatron.training.training.check_param_hashes_across_dp_replicas: checked against Megatron-LM 0.15.3-0.19.2  # noqa: E501
def hashes_of_full_parameters(megatron_hashes: Callable) -> Callable:
    """``check_param_hashes_across_dp_replicas`` that hashes the full parameters."""

    def check_param_hashes_across_dp_replicas(model: Any, *rest: Any, **kwargs: Any) -> bool:
        # [Note: hashes of what is replicated] Megatron-LM asserts that every data-parallel rank
        # holds the same parameters (--check-weight-hash-across-dp-replicas-interval); the shards
        # differ by design, the full parameters do not: hashed with each chunk's full parameters
        # installed (RaggedFSDP.full_parameters: the whole model for the call, as DDP holds it),
        # so every rank's gathered copy is compared, and under HSDP a replica whose shard
        # diverged differs from the others. Without HSDP no data-parallel rank holds a copy of
        # another's shard: nothing more can be compared.
        chunks = _chunks_of(model)
        with ExitStack() as stack:
            for chunk in chunks:
                stack.enter_context(chunk.full_parameters())
            return megatron_hashes(model, *rest, **kwargs)

    return check_param_hashes_across_dp_replicas


def _chunks_of(model: Any) -> List[RaggedFSDP]:
    return [m for m in (model if isinstance(model, list) else [model]) if isinstance(m, RaggedFSDP)]


# host patch megatron.training.checkpointing.save_checkpoint: checked against Megatron-LM 0.15.3-0.19.2
# host patch megatron.training.training.save_checkpoint: checked against Megatron-LM 0.15.3-0.19.2
def checkpoint_saver(megatron_save: Callable) -> Callable:
    """Megatron-LM's ``save_checkpoint`` with ``RaggedFSDP`` chunks.

    ``torch_dist``: the save runs under ``dist_checkpoint.checkpoint_parameters``, so
    Megatron's ``sharded_state_dict`` of the unwrapped model gives each rank's own boxes of its
    shards (no gather; dist_checkpoint.py [Note: streamed dist-checkpoint save]), and Adam's
    state is written in model space on the same boxes by ``RaggedOptimizer.sharded_state_dict``,
    per-block optimizer state beside it.
    ``torch``: data-parallel rank 0 alone asks the *unwrapped* model for its state dict, so it is
    gathered on every rank beforehand and the inner model answers with it
    (``RaggedFSDP.torch_format_save``; this format still holds the full model during the save); rank 0's
    file cannot hold every rank's optimizer shards, so they go beside it (see optimizer.py
    [Note: optimizer checkpoints]).
    """

    def save_checkpoint(iteration: Any, model: Any, *rest: Any, **kwargs: Any):
        chunks = _chunks_of(model)
        if not chunks:
            return megatron_save(iteration, model, *rest, **kwargs)
        optimizer = rest[0] if rest else kwargs.get("optimizer")
        args = _args()
        fmt = getattr(args, "ckpt_format", "torch")
        if fmt not in ("torch", "torch_dist"):
            raise ValueError(f"--use-vescale-fsdp saves --ckpt-format torch_dist or torch, not {fmt!r}")
        beside = fmt == "torch" or (isinstance(optimizer, RaggedOptimizer) and optimizer.model_space_keys() is None)
        if isinstance(optimizer, RaggedOptimizer) and beside and getattr(args, "save", None) and not getattr(
                args, "no_save_optim", False):
            optimizer.save_sharded(os.path.join(args.save, f"iter_{int(iteration):07d}", "vescale_zero_optim"))
        with ExitStack() as stack:
            for chunk in chunks:
                if fmt == "torch_dist":
                    stack.enter_context(checkpoint_parameters(chunk))
                else:  # data_parallel.py [Note: torch-format saves see the inner model]
                    stack.enter_context(chunk.torch_format_save())
            return megatron_save(iteration, model, *rest, **kwargs)

    return save_checkpoint


# host patch megatron.training.checkpointing.load_checkpoint: checked against Megatron-LM 0.15.3-0.19.2
# host patch megatron.training.training.load_checkpoint: checked against Megatron-LM 0.15.3-0.19.2
def checkpoint_loader(megatron_load: Callable) -> Callable:
    """Megatron-LM's ``load_checkpoint`` with ``RaggedFSDP`` chunks: the load runs with full
    parameters installed (``RaggedFSDP.full_parameters``), into which Megatron's loader reshards
    across TP/PP/DP; our optimizer's state files are checked and loaded beside it."""

    def load_checkpoint(model: Any, *rest: Any, **kwargs: Any):
        chunks = _chunks_of(model)
        args = _args()
        if chunks and not getattr(args, "no_load_optim", False) and not getattr(args, "finetune", False):
            path = _checkpoint_dir(getattr(args, kwargs.get("load_arg", "load"), None),
                                   getattr(args, "ckpt_step", None))
            if path is not None:
                check_dist_checkpoint_optimizer(path)
        with ExitStack() as stack:
            for chunk in chunks:
                stack.enter_context(chunk.full_parameters())
            loaded = megatron_load(model, *rest, **kwargs)
        optimizer = rest[0] if rest else kwargs.get("optimizer")
        if isinstance(optimizer, RaggedOptimizer) and optimizer.parameter_state_pending():
            # optimizer.py [Note: distributed-optimizer torch checkpoints]: Megatron-LM loads
            # distrib_optim.pt only under --use-distributed-optimizer; without it, load it here
            name = _distrib_optim_file(getattr(args, kwargs.get("load_arg", "load"), None),
                                       getattr(args, "ckpt_step", None))
            if name is not None:
                optimizer.load_parameter_state(name)
            optimizer.check_parameter_state_loaded()
        return loaded

    return load_checkpoint


def _checkpoint_iteration(load: Optional[str], step: Optional[int]) -> Optional[Tuple[int, bool]]:
    """``(iteration, release)`` that Megatron-LM's ``load_checkpoint`` will read, if it can be
    told from ``--load`` (its tracker file) or ``--ckpt-step``; else ``None``."""
    if not load or not os.path.isdir(load):
        return None
    if step is not None:
        return int(step), False
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    return (int(text), False) if text.isdigit() else None


def _checkpoint_dir(load: Optional[str], step: Optional[int]) -> Optional[str]:
    """The iteration directory Megatron-LM's ``load_checkpoint`` will read, or ``None``."""
    found = _checkpoint_iteration(load, step)
    if found is None:
        return None
    return os.path.join(load, "release" if found[1] else f"iter_{found[0]:07d}")


def _distrib_optim_file(load: Optional[str], step: Optional[int]) -> Optional[str]:
    """This rank's ``distrib_optim.pt`` of that checkpoint, named by Megatron-LM's own
    ``get_checkpoint_name`` / ``get_distributed_optimizer_checkpoint_name`` (as its loader
    names it under --use-distributed-optimizer; checked against core_v0.16.1), or ``None``."""
    checkpointing = sys.modules.get("megatron.training.checkpointing")
    found = _checkpoint_iteration(load, step)
    model_name = getattr(checkpointing, "get_checkpoint_name", None)
    optim_name = getattr(checkpointing, "get_distributed_optimizer_checkpoint_name", None)
    if found is None or model_name is None or optim_name is None:
        return None
    name = optim_name(model_name(load, found[0], found[1]))
    return name if os.path.isfile(name) else None
