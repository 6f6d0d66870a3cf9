"""Megatron meta-device initialisation (``--init-model-with-meta-device``) under ``RaggedFSDP``.

Megatron-LM builds the model under ``torch.device("meta")`` with that flag; ``RaggedFSDP``
shards the meta model as planned and materialises it with the core
:func:`vescale_zero.materialize` (group by group: the peak is all shards plus one group's
full buffer). :func:`megatron_init_fn` is the per-module initialiser it uses.

[Note: Megatron initialisers] megatron-core's local layers (``ColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``) have no ``reset_parameters()``: they
initialise in their constructors with the ``init_method`` their parent passed, which they do
not keep. The parents pick it by role, the same in every megatron-core model
(attention.py, mlp.py, moe/experts.py, gpt_model.py, language_model_embedding.py):

* ``linear_proj`` and ``linear_fc2`` (the layer's output projections): ``config.output_layer_init_method``;
* ``word_embeddings``: ``config.embedding_init_method``;
* every other parallel linear (``linear_qkv``, ``linear_fc1``, ``output_layer``, ...): ``config.init_method``;
* biases: zero. ``position_embeddings`` / ``tokentype_embeddings`` (``nn.Embedding``):
  their own ``reset_parameters()`` then ``config.embedding_init_method``, as the
  constructor does.

The weight is written as the constructor writes it: with ``use_cpu_initialization``, the
whole tensor-parallel master weight is drawn from the default generator and this TP rank's
slice kept (``_initialize_affine_weight_cpu``); else this TP rank's slice is drawn under
Megatron's CUDA RNG tracker (``_initialize_affine_weight_gpu``). Modules are visited in
registration order, which is their construction order in megatron-core, so with the same
seeds the values equal an eager build's bit for bit. Any other module with tensors to
initialise uses its ``reset_parameters()`` (Transformer Engine modules, norms, the MoE
router); one without it is refused by name.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

__all__ = ["megatron_init_fn", "has_meta_tensors", "materialize_megatron", "check_all_or_nothing_on_meta"]

_OUTPUT_PROJECTIONS = ("linear_proj", "linear_fc2")
_EXTRA_EMBEDDINGS = ("position_embeddings", "tokentype_embeddings")


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device."""
    return any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))


def check_all_or_nothing_on_meta(module: nn.Module) -> None:
    """A model partly on meta cannot be sharded (a group's tensors share one device): name the cause."""
    params = dict(module.named_parameters())
    on_meta = [n for n, p in params.items() if p.device.type == "meta"]
    if on_meta and len(on_meta) != len(params):
        real = [f"{n} ({p.device})" for n, p in params.items() if p.device.type != "meta"]
        raise ValueError(
            f"--init-model-with-meta-device: {len(on_meta)} parameters are on the meta device but {real[:4]} are not. "
            "megatron-core's local layers allocate on the GPU themselves unless --use-cpu-initialization is set "
            "(Transformer Engine layers honour the meta device): pass --use-cpu-initialization (its values are drawn "
            "per module while materialising, never for the whole model), or build every parameter on meta"
        )


def _tp_rank_size(module: nn.Module) -> tuple:
    group = getattr(module, "tp_group", None)
    return (group.rank(), group.size()) if group is not None else (0, 1)


def _parallel_weight(module: nn.Module, config: TransformerConfig, init_method: Callable) -> None:
    """The constructor's weight initialisation of a megatron-core parallel linear / embedding."""
    # host patch megatron.core.tensor_parallel.layers._initialize_affine_weight_cpu: checked against megatron-core 0.15.3-0.19.2  # noqa: E501
    from megatron.core.tensor_parallel.layers import (
        RowParallelLinear,
        VocabParallelEmbedding,
        _initialize_affine_weight_cpu,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

    weight = module.weight
    dim = getattr(weight, "partition_dim", 1 if isinstance(module, RowParallelLinear) else 0)
    stride = getattr(weight, "partition_stride", 1)
    if config.use_cpu_initialization:
        rank, size = _tp_rank_size(module)
        if isinstance(module, VocabParallelEmbedding):
            full_rows, full_cols, per_partition = module.num_embeddings, module.embedding_dim, weight.shape[0]
        elif dim == 1:
            full_rows, full_cols, per_partition = weight.shape[0], module.input_size, weight.shape[1]
        else:
            full_rows, full_cols, per_partition = module.output_size, weight.shape[1], weight.shape[0]
        _initialize_affine_weight_cpu(weight, full_rows, full_cols, per_partition, dim, init_method, stride=stride,
                                      params_dtype=weight.dtype, rank=rank, world_size=size,
                                      skip_set_tensor_parallel_attributes=True)
    else:  # _initialize_affine_weight_gpu's draw (the attributes are set already)
        expert = bool(getattr(module, "is_expert", False)) and not isinstance(module, VocabParallelEmbedding)
        with get_cuda_rng_tracker().fork(*([get_expert_parallel_rng_tracker_name()] if expert else [])):
            init_method(weight)


def megatron_init_fn(model: nn.Module, config: TransformerConfig) -> Callable[[nn.Module], None]:
    """An ``init_fn`` for :func:`vescale_zero.materialize` that initialises each module of a
    megatron-core ``model`` built on the meta device as its constructor would have (see
    [Note: Megatron initialisers]). Raises ``ValueError`` naming a module it cannot initialise."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    names: Dict[int, str] = {id(m): n for n, m in model.named_modules()}
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)

    def init_method_for(name: str) -> Optional[Callable]:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _OUTPUT_PROJECTIONS:
            return config.output_layer_init_method
        if leaf == "word_embeddings":
            return config.embedding_init_method or config.init_method
        return config.init_method

    def init(module: nn.Module) -> None:
        name = names.get(id(module), "<unknown>")
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, parallel):
            if config.perform_initialization:
                if module.weight is not None:
                    _parallel_weight(module, config, init_method_for(name))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            return
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"--init-model-with-meta-device: module {name!r} ({type(module).__name__}) holds tensors on the meta "
                "device but has no reset_parameters() and is not a megatron-core parallel layer, so RaggedFSDP "
                "cannot initialise it; give it a reset_parameters(), build it off the meta device, or drop "
                "--init-model-with-meta-device"
            )
        reset()
        if isinstance(module, nn.Embedding) and leaf in _EXTRA_EMBEDDINGS and config.perform_initialization:
            (config.embedding_init_method or config.init_method)(module.weight)

    return init


def materialize_megatron(module: nn.Module, config: TransformerConfig) -> None:
    """Materialise a sharded megatron-core model built on meta (group by group), in place."""
    import vescale_zero as vz

    init = megatron_init_fn(module, config)
    unknown = [f"{n!r} ({type(m).__name__})" for n, m in module.named_modules()
               if _holds_meta(m) and not _knows(m)]
    if unknown:
        raise ValueError(
            f"--init-model-with-meta-device: module(s) {', '.join(unknown[:6])} hold tensors on the meta device but "
            "have no reset_parameters() and are not megatron-core parallel layers, so RaggedFSDP cannot initialise "
            "them; give them a reset_parameters(), build them off the meta device, or drop "
            "--init-model-with-meta-device"
        )
    vz.materialize(module, init_fn=init)


def _holds_meta(module: nn.Module) -> bool:
    return any(t is not None and t.device.type == "meta"
               for t in list(module._parameters.values()) + list(module._buffers.values()))


def _knows(module: nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) or callable(
        getattr(module, "reset_parameters", None))
