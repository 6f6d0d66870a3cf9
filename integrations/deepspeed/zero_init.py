"""``deepspeed.zero.Init`` and ``GatheredParameters`` with ``"stage": "ragged"``.

[Note: zero.Init under ragged]
Under a ragged config ``deepspeed.zero.Init`` partitions parameters exactly as for ZeRO-3
(DeepSpeed's own code: construction, initialisation code in constructors, rank 0's values
broadcast, Hugging Face's ``GatheredParameters``-based loading), except that parameters stay
in the model's dtype (fp32: our shards are the master weights; bf16 / fp16 are compute
dtypes the engine applies). ``deepspeed.initialize`` then converts, without ever holding
the whole model on a rank:

  1. :func:`zero3_to_meta`: each ZeRO-3 parameter in the module is replaced by a meta
     parameter of its full shape (tied ones stay tied), remembering its source; so is every
     parameter added after ``zero.Init`` built the model (PEFT's adapters, in the order the
     Hugging Face docs give for ZeRO-3: ``get_peft_model`` on a model ``from_pretrained`` built
     partitioned), which DeepSpeed's engine has already broadcast from rank 0, as ZeRO-3
     partitions such parameters from rank 0's values;
  2. the engine applies ``fully_shard`` to the meta model (planned, no storage);
  3. :func:`fill_from_zero3` fills our shards group by group (``vescale_zero.api.full_parameters``): one
     group's ZeRO-3 parameters are gathered by DeepSpeed's own all-gather, this rank's
     ranges copied, then their ZeRO-3 shards are released and their ``ds_*`` attributes
     and methods removed, so nothing of ZeRO-3 remains (a ZeRO-3 parameter the caller
     still holds, e.g. in ``model_parameters``, maps to our sharded one).

Peak on a rank during the conversion: our shards + the ZeRO-3 shards not yet converted +
one group's full tensors.

Options of ``zero.Init`` that contradict that design are refused (see
:func:`check_zero_init_options`). ``GatheredParameters`` over our sharded parameters
follows ``vescale_zero.api.full_parameters``; over ZeRO-3 parameters it is DeepSpeed's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from deepspeed.runtime.zero import partition_parameters
from torch import nn

from vescale_zero import fill_group_by_group, gathered_parameters, sharded_counterpart
from vescale_zero.hosts import Owner, copy_parameter_attributes

__all__ = ["check_zero_init_options", "zero3_to_meta", "fill_from_zero3", "GatheredParameters", "Zero3Sources",
           "RAGGED_PARTITION", "mark_ragged_partitions", "partitioned_for_ragged"]

Zero3Sources = Dict[Tuple[int, str], nn.Parameter]
"""(id(module), attribute) -> the ZeRO-3 parameter that module attribute held."""

_FIX = "use zero.Init with the defaults (or build the model without it), or use stage 3 for that feature"


def check_zero_init_options(given: Mapping[str, Any]) -> None:
    """Refuse ``zero.Init`` keyword values that contradict ragged sharding, naming each and the fix."""
    remote = given.get("remote_device")
    if remote not in (None, "none"):
        raise ValueError(
            f"deepspeed.zero.Init(remote_device={remote!r}) with \"stage\": \"ragged\": zero.Init's partitions stay on "
            "the accelerator until deepspeed.initialize shards them; remove remote_device (to keep the shards in host "
            "memory, set zero_optimization.offload_optimizer {\"device\": \"cpu\"}), or use stage 3")
    if given.get("pin_memory"):
        raise ValueError(
            "deepspeed.zero.Init(pin_memory=True) with \"stage\": \"ragged\": zero.Init's partitions are not offloaded "
            "(the engine's offload is zero_optimization.offload_optimizer, pinned by its pin_memory); "
            "remove pin_memory")
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if given.get(key):
            raise ValueError(
                f"deepspeed.zero.Init({key}=True) with \"stage\": \"ragged\": the weights would be quantized before "
                f"ragged sharding copies them (lossy); remove {key} ({_FIX})")
    if given.get("zero_param_parallel_group") is not None:
        raise ValueError(
            "deepspeed.zero.Init(zero_param_parallel_group=...) with \"stage\": \"ragged\": hierarchical partitioning "
            "(ZeRO++ hpZ) has no meaning for ragged sharding, which shards over DeepSpeed's data-parallel group; "
            f"remove zero_param_parallel_group ({_FIX})")
    if given.get("param_swapper") is not None:
        raise ValueError("deepspeed.zero.Init(param_swapper=...) with \"stage\": \"ragged\": NVMe swapping is "
                         "parameter offload, which ragged sharding does not do; remove param_swapper")


def _is_zero3(param: object) -> bool:
    return isinstance(param, torch.Tensor) and hasattr(param, "ds_id")


RAGGED_PARTITION = "_ds_partitioned_for_ragged"
"""Set on each parameter a ``zero.Init`` under a ragged config partitions (a ZeRO-3 attribute by
its prefix: dropped with the others when the parameter is converted)."""


def mark_ragged_partitions(init: partition_parameters.Init) -> None:
    """Make ``init`` (a ``zero.Init`` under a ragged config, before its ``__init__`` runs, which may
    already convert a ``module=``) mark every parameter it partitions with :data:`RAGGED_PARTITION`."""
    convert = init._convert_to_deepspeed_param

    def convert_and_mark(param: nn.Parameter) -> None:
        convert(param)
        setattr(param, RAGGED_PARTITION, True)

    # host patch deepspeed.runtime.zero.partition_parameters.Init._convert_to_deepspeed_param: checked against deepspeed 0.16.9-0.19.8  # noqa: E501
    init._convert_to_deepspeed_param = convert_and_mark  # on this instance only


def partitioned_for_ragged(model: Any) -> bool:
    """Whether ``model`` holds parameters a ``zero.Init`` under a ragged config partitioned."""
    return isinstance(model, nn.Module) and any(hasattr(p, RAGGED_PARTITION) for p in model.parameters())


def zero3_to_meta(module: nn.Module, master_dtype: Optional[torch.dtype] = None) -> Zero3Sources:
    """Step 1 of [Note: zero.Init under ragged]; ``{}`` (nothing changed) if no ZeRO-3 parameter.
    Parameters that are not ZeRO-3's (added after ``zero.Init``) go to meta too, their source
    being the parameter itself: one group may hold both (a LoRA adapter beside its base layer).
    ``master_dtype``: the meta parameters of 16-bit ones take it (a stage-3 ``zero.Init`` under
    bf16 / fp16 partitions in 16 bits; the masters made from them are fp32, as ZeRO-3 keeps fp32
    partitions beside its 16-bit ones)."""
    if not any(_is_zero3(p) for p in module.parameters()):
        return {}
    sources: Zero3Sources = {}
    metas: Dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is None or p.device.type == "meta":
                continue
            if id(p) not in metas:
                metas[id(p)] = _meta_like(p, master_dtype)
            mod._parameters[attr] = metas[id(p)]
            sources[id(mod), attr] = p
        for name in ("_external_params", "ds_external_parameters", "all_parameters"):
            mod.__dict__.pop(name, None)  # ZeRO-3's per-module bookkeeping (register_external_parameter)
    return sources


def _meta_like(param: nn.Parameter, master_dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """A meta parameter of ``param``'s full shape, with its attributes except ZeRO-3's."""
    shape = param.ds_shape if _is_zero3(param) else param.shape
    dtype = master_dtype if master_dtype is not None and param.dtype in (torch.bfloat16, torch.float16) else param.dtype
    meta = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=param.requires_grad)
    return copy_parameter_attributes(param, meta, skip=set(_zero3_attributes(param)))


def _zero3_attributes(param: nn.Parameter) -> List[str]:
    """What ``zero.Init`` attached to ``param``: ``ds_*`` and the methods it binds (all_gather, partition, ...)."""
    return [k for k, v in vars(param).items()
            if k.startswith(("ds_", "_ds_")) or k in _ZERO3_NAMES or (callable(v) and getattr(v, "__module__", "") ==
                                                              partition_parameters.__name__)]


_ZERO3_NAMES = frozenset({"is_external_param", "nvme_swapper", "ds_summary", "item", "padding_size",
                          "partition_numel", "aligned_size", "convert_to_zero_parameters"})


def _release(param: nn.Parameter, sharded: nn.Parameter) -> None:
    """Drop ``param``'s ZeRO-3 shard (or its whole tensor) and ZeRO-3 attributes; it now stands
    for ``sharded`` (optimizer remap)."""
    for name in _zero3_attributes(param):
        delattr(param, name)
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    param._vescale_sharded_as = sharded  # read by vescale_zero.sharded_counterpart


def fill_from_zero3(module: nn.Module, sources: Zero3Sources, device: torch.device) -> None:
    """Step 3 of [Note: zero.Init under ragged]: ``module`` was sharded on meta after
    :func:`zero3_to_meta` returned ``sources``; the shards go to ``device`` (the engine's: a
    stage-3 ``zero.Init(remote_device="cpu")`` keeps its partitions in host memory). Collective
    over the ZeRO-3 partition group."""
    released = set()

    @contextlib.contextmanager
    def open_group(owners: List[Owner]) -> Iterator[Sequence[torch.Tensor]]:
        params = [sources[id(mod), attr] for mod, attr in owners]
        with partition_parameters.GatheredParameters([p for p in params if _is_zero3(p)]):
            yield [p.data for p in params]
        for (mod, attr), p in zip(owners, params):
            if id(p) not in released:  # a tied parameter is released once
                released.add(id(p))
                _release(p, sharded_counterpart(mod._parameters[attr]))

    fill_group_by_group(module, open_group, device)


# host patch deepspeed.runtime.zero.partition_parameters.GatheredParameters: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.zero.GatheredParameters: checked against deepspeed 0.16.9-0.19.8
class GatheredParameters(partition_parameters.GatheredParameters):
    """``deepspeed.zero.GatheredParameters`` that also gathers our sharded parameters (see
    ``vescale_zero.api.full_parameters``); ZeRO-3 parameters go to DeepSpeed's own, others are ignored."""

    def __init__(self, params: Any, modifier_rank: Any = None, fwd_module: Any = None, enabled: bool = True) -> None:
        listed = [params] if isinstance(params, torch.Tensor) else list(params) if params is not None else []
        self._ragged = gathered_parameters(listed, modifier_rank) if enabled else contextlib.nullcontext()
        super().__init__([p for p in listed if _is_zero3(p)], modifier_rank, fwd_module, enabled)

    def __enter__(self) -> None:
        super().__enter__()
        self._ragged.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            self._ragged.__exit__(*exc)
        except BaseException:
            super().__exit__(*exc)
            raise
        return super().__exit__(*exc)
