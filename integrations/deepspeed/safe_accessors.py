"""``deepspeed.utils.safe_get_*`` / ``safe_set_*`` on ragged-sharded parameters, as at ZeRO-3.

Training scripts read and edit the model through DeepSpeed's accessors (log a gradient
norm, clamp a weight, reset a moment). At stage 3 they give::

    safe_get_full_grad(p)                   the reduced gradient, p's full shape (None: frozen)
    safe_get_full_fp32_param(p)             the fp32 master weight, full shape
    safe_get_full_optimizer_state(p, key)   the optimizer state ``key`` (e.g. "exp_avg"), full shape
    safe_set_full_*(p, value[, key])        write ``value`` (full shape); each rank keeps its range
    safe_get_local_*(p[, key])              this rank's partition, 1-D (writes land in it)
    safe_set_local_*(p, value[, key])       write this rank's partition (``value`` of its numel)
    safe_update_full_grad_vectorized(ps, f) each gradient set to f(full gradient, p)

Under "ragged" the same calls gather with ``RaggedDTensor.full_tensor()`` (collective: every
rank of the parameter's shard group calls it, as at stage 3) and write this rank's flat range
of the master shard, the sharded gradient or the optimizer state; the local pieces are the
ragged ones (1-D, this rank's ``local_range``, possibly empty). A frozen parameter gets
``None`` from the getters and the setters skip it, as at stage 3.

[Note: routing the host's accessors]
DeepSpeed's accessors choose by attributes of the parameter (``ds_id`` for ZeRO-3, then
``_hp_mapping`` for ZeRO-1/2; ``safe_get_full_grad`` returns ``p.grad`` first), and a ragged
parameter cannot carry ``ds_id``: DeepSpeed's engine and ``GatheredParameters`` would take it
for a ZeRO-3 parameter. So each accessor's code is replaced in place (the function object
stays, so ``from deepspeed.utils import safe_get_full_grad`` bound before this import is routed
too) by a forwarder (``vescale_zero/host_patches.py``, kind ``route``) to :func:`routed_accessor`:
a ragged parameter goes to the function here, anything else to the original body, unchanged.
Checked against DeepSpeed 0.19.8 (``deepspeed/utils/tensor_fragment.py``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from vescale_zero import local_piece
from vescale_zero.hosts import GroupState, is_ragged, like_param, slot_of

__all__ = ["attach_optimizer", "routed_accessor"]

_OPTIMIZERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
"""Sharded parameter -> weakref to its optimizer (ZeRO-3 keeps ``param._z3_optimizer``; we attach
nothing to the parameter, as ``param_group._register_slot``)."""


def attach_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Let the accessors find ``optimizer``'s state of each of its ragged parameters."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if is_ragged(param):
                _OPTIMIZERS[param] = weakref.ref(optimizer)


# ---- what the accessors do for a ragged parameter ------------------------------------------


def _range(param: torch.Tensor) -> slice:
    start, end = param.local_range
    return slice(start, end)


def _check_full(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if value.numel() != param.numel():
        raise ValueError(f"{what}: the value has {value.numel()} elements and the parameter {tuple(param.shape)} "
                         f"{param.numel()}; pass the whole tensor (its own range is taken on each rank)")


def _check_local(local: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if value.numel() != local.numel():
        raise ValueError(f"{what}: the value has {value.numel()} elements and this rank's piece {local.numel()}; "
                         "pass this rank's piece (what the matching safe_get_local_* returns)")


def _sharded_for_write(param: torch.Tensor) -> None:
    """A group still gathered (kept after forward) would compute with its old full copy: reshard
    it, so the next gather reads the written shard (as a checkpoint load does)."""
    slot = slot_of(param)
    if slot is not None and slot[0].state is not GroupState.SHARDED:
        slot[0].reshard()


def _state(param: torch.Tensor, key: str) -> torch.Tensor:
    return _state_entry(param, key)[2]


def _write_state(param: torch.Tensor, key: str, write: Callable[[torch.Tensor], None]) -> None:
    """``write`` into this parameter's state ``key``, then hand the state back to the optimizer:
    with its state in files (vescale_zero.optim.state_files) a read outside a step is a copy,
    and only an assignment reaches the file."""
    optimizer, state, value = _state_entry(param, key)
    with torch.no_grad():
        write(value)
    optimizer.state[param] = state


def _per_element(param: torch.Tensor, value: Any) -> Optional[torch.Tensor]:
    """[Note: per-element optimizer state of a ragged parameter]
    ``value`` in ``param``'s layout if it is a per-element state of ``param``, else ``None``.
    Two kinds of optimizer keep it, in two forms: torch's (and vescale_zero.optim's) create
    it from the parameter (``torch.zeros_like(p)``): a ragged tensor of the parameter's shape;
    DeepSpeed's kernels (FusedAdam, DeepSpeedCPUAdam, the CPU Adagrad / Lion, FusedLamb) create
    it from ``p.data``, which is this rank's flat piece: a plain 1-D tensor of the piece's
    length (optimizer_state [Note: optimizer state after a load]). The second is returned as
    a ragged view of the same storage (writes land in the optimizer's tensor)."""
    if not torch.is_tensor(value):
        return None
    if is_ragged(value):
        return value if value.shape == param.shape else None
    piece = local_piece(param)
    if value.dim() == 1 and value.numel() == piece.numel():
        return like_param(value, param)
    return None


def _state_entry(param: torch.Tensor, key: str):
    ref = _OPTIMIZERS.get(param)
    optimizer = ref() if ref is not None else None
    if optimizer is None:
        raise ValueError("this ragged parameter has no optimizer: the optimizer accessors serve the parameters of an "
                         "optimizer built by deepspeed.initialize")
    state = optimizer.state.get(param, {})
    value = _per_element(param, state.get(key))
    if value is None:
        per_element = sorted(k for k, v in state.items() if _per_element(param, v) is not None)
        if not state:
            raise ValueError(f"optimizer state {key!r}: the optimizer has no state for this parameter yet (it is "
                             "created by the first engine.step()); read it after a step")
        raise ValueError(f"optimizer state {key!r} is not a per-element state of this parameter in "
                         f"{type(optimizer).__name__}; its per-element states are {per_element}")
    return optimizer, state, value


def _grad(param: torch.Tensor, what: str) -> torch.Tensor:
    if param.grad is None:
        raise ValueError(f"{what}: this parameter has no gradient now; call it after engine.backward() at the "
                         "gradient accumulation boundary and before engine.step()")
    return param.grad


def get_full_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    grad = param.grad
    return grad.full_tensor() if is_ragged(grad) else grad


def set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    if not param.requires_grad:
        return
    _check_full(param, value, "safe_set_full_grad")
    with torch.no_grad():
        local_piece(_grad(param, "safe_set_full_grad")).copy_(value.reshape(-1)[_range(param)])


def get_full_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    return param.full_tensor() if param.requires_grad else None


def set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    if not param.requires_grad:
        return
    _check_full(param, value, "safe_set_full_fp32_param")
    _sharded_for_write(param)
    with torch.no_grad():
        local_piece(param).copy_(value.reshape(-1)[_range(param)])


def get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    return _state(param, optim_state_key).full_tensor() if param.requires_grad else None


def set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    if not param.requires_grad:
        return
    _check_full(param, value, "safe_set_full_optimizer_state")
    _write_state(param, optim_state_key, lambda state: local_piece(state).copy_(value.reshape(-1)[_range(param)]))


def get_local_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    return local_piece(_grad(param, "safe_get_local_grad")) if param.requires_grad else None


def set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    if not param.requires_grad:
        return
    local = local_piece(_grad(param, "safe_set_local_grad"))
    _check_local(local, value, "safe_set_local_grad")
    with torch.no_grad():
        local.copy_(value.reshape(-1))


def get_local_fp32_param(param: torch.Tensor) -> Optional[torch.Tensor]:
    return local_piece(param) if param.requires_grad else None


def set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    if not param.requires_grad:
        return
    _check_local(local_piece(param), value, "safe_set_local_fp32_param")
    _sharded_for_write(param)
    with torch.no_grad():
        local_piece(param).copy_(value.reshape(-1))


def get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Optional[torch.Tensor]:
    return local_piece(_state(param, optim_state_key)) if param.requires_grad else None


def set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    if not param.requires_grad:
        return
    _check_local(local_piece(_state(param, optim_state_key)), value, "safe_set_local_optimizer_state")
    _write_state(param, optim_state_key, lambda state: local_piece(state).copy_(value.reshape(-1)))


def update_full_grad_vectorized(param_list: List[torch.Tensor], update_func: Callable[..., torch.Tensor]) -> None:
    for param in param_list:
        if param.requires_grad:
            grad = _grad(param, "safe_update_full_grad_vectorized").full_tensor()
            set_full_grad(param, update_func(grad, param))


_OURS: Dict[str, Callable[..., Any]] = {
    "safe_get_full_grad": get_full_grad, "safe_set_full_grad": set_full_grad,
    "safe_get_full_fp32_param": get_full_fp32_param, "safe_set_full_fp32_param": set_full_fp32_param,
    "safe_get_full_optimizer_state": get_full_optimizer_state,
    "safe_set_full_optimizer_state": set_full_optimizer_state,
    "safe_get_local_grad": get_local_grad, "safe_set_local_grad": set_local_grad,
    "safe_get_local_fp32_param": get_local_fp32_param, "safe_set_local_fp32_param": set_local_fp32_param,
    "safe_get_local_optimizer_state": get_local_optimizer_state,
    "safe_set_local_optimizer_state": set_local_optimizer_state,
    "safe_update_full_grad_vectorized": update_full_grad_vectorized,
}


# ---- routing: [Note: routing the host's accessors] -------------------------------------------


# host patch deepspeed.utils.tensor_fragment.safe_get_full_grad: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_full_grad: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_get_full_fp32_param: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_full_fp32_param: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_get_full_optimizer_state: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_full_optimizer_state: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_get_local_grad: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_local_grad: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_get_local_fp32_param: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_local_fp32_param: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_get_local_optimizer_state: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_set_local_optimizer_state: checked against deepspeed 0.16.9-0.19.8
# host patch deepspeed.utils.tensor_fragment.safe_update_full_grad_vectorized: checked against deepspeed 0.16.9-0.19.8
def routed_accessor(original: Callable[..., Any]) -> Callable[..., Any]:
    """What DeepSpeed's accessor (``original``: a copy of its body) forwards to once routed in place
    by ``vescale_zero.host_patches.install("deepspeed")``: a ragged parameter to the function here,
    anything else to ``original``, unchanged."""
    ours = _OURS[original.__name__]

    def routed(*args: Any, **kwargs: Any) -> Any:
        param = args[0] if args else kwargs.get("param", kwargs.get("param_list"))
        if isinstance(param, (list, tuple)):  # the vectorized accessor: a list of one model's parameters
            param = param[0] if param else None
        return (ours if is_ragged(param) else original)(*args, **kwargs)

    return routed
