"""torch's element-wise optimizers step the local pieces of ragged parameters directly.

[Note: torch's optimizers step the local pieces]
Every op an optimizer runs on a :class:`~vescale_zero.ragged_tensor.RaggedDTensor` is answered
by its ``__torch_dispatch__`` on the local pieces ([Note: ops on ragged tensors]): exact, but
torch's entry into a Python subclass costs about 0.6 us per tensor argument per op, and a
wrapper per output of an out-of-place op. An AdamW step runs about a dozen tensor-list ops,
so on small tensors that host time is a fifth of the step::

    AdamW.step ── _init_group ──> lists of RaggedDTensors (params, grads, exp_avgs, ...)
        │
        └── adam(params, grads, exp_avgs, ...)          <- torch.optim.adam.adam, wrapped here:
               │  lists of RaggedDTensors -> lists of their local pieces (one attribute read each)
               └── _fused_adam / _multi_tensor_adam / _single_tensor_adam on plain tensors

So each of torch's *element-wise* functional optimizers (``torch.optim.adam.adam``,
``sgd.sgd``, ... ``_FUNCTIONALS``) is wrapped once: the lists it receives are replaced by
the local pieces, and the optimizer's own code runs on plain tensors, unchanged. The state
stays what the optimizer made it (``torch.zeros_like(p)`` of a ragged parameter is ragged,
so ``get_state_dict`` / DCP see the layout); a buffer the functional creates itself (SGD's
momentum on the first step) is handed back in the parameter's layout.

What keeps this exact: these optimizers are element-wise, so index ``i`` of every list is
one parameter's piece, its gradient's and its state's, all of one layout (checked: same
placements, or a plain 0-dim tensor such as Adam's ``step``). Anything else takes the
dispatch path unchanged, which answers or refuses op by op: another DTensor in a list, a
plain tensor beside a ragged one at an index, ``differentiable=True`` (autograd must see the
parameters), a compiled step, parameters in gathered mode ([Note: gathered mode]). Optimizers
that are not element-wise (Adafactor's row and column statistics, torch's Muon) are not
wrapped: their ops meet the dispatch, which refuses what needs the whole tensor.

Version counters: a ragged parameter's own counter is what autograd checks if a graph saved
the parameter; the kernels bump only the pieces', so the parameters' counters are bumped once
after the step, where torch's kernels bump plain parameters' (its fused kernels bump none).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from operator import attrgetter, is_, is_not
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from .ragged_tensor import RaggedDTensor, like_param

__all__ = ["install_local_optimizer_steps", "wrapped_functionals"]

# (module, functional): torch's element-wise optimizers; the classes call these module globals.
_FUNCTIONALS: Tuple[Tuple[str, str], ...] = (
    ("torch.optim.adam", "adam"),
    ("torch.optim.adamw", "adamw"),
    ("torch.optim.sgd", "sgd"),
    ("torch.optim.adagrad", "adagrad"),
    ("torch.optim.adamax", "adamax"),
    ("torch.optim.adadelta", "adadelta"),
    ("torch.optim.asgd", "asgd"),
    ("torch.optim.nadam", "nadam"),
    ("torch.optim.radam", "radam"),
    ("torch.optim.rmsprop", "rmsprop"),
    ("torch.optim.rprop", "rprop"),
)
_WRAPPED: Dict[str, Callable] = {}  # "module.name" -> the wrapper installed


def install_local_optimizer_steps() -> None:
    """Wraps torch's element-wise functional optimizers
    ([Note: torch's optimizers step the local pieces]); once per process, on the first
    ``fully_shard``. A functional whose signature is not the expected one (another torch) is
    left alone: its ops take the dispatch path."""
    for module_name, name in _FUNCTIONALS:
        key = f"{module_name}.{name}"
        if key in _WRAPPED:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, name, None)
        if original is None or getattr(original, "__vz_local_steps__", False):
            continue
        lists = _list_parameters(original)
        if not lists or lists[0][1] != "params":
            continue
        wrapper = _wrap_functional(original, lists)
        setattr(module, name, wrapper)
        _WRAPPED[key] = wrapper


def wrapped_functionals() -> List[str]:
    """The functionals wrapped in this process (``"torch.optim.adam.adam"``, ...)."""
    return sorted(_WRAPPED)


def _list_parameters(fn: Callable) -> List[Tuple[int, str]]:
    """``(position, name)`` of ``fn``'s tensor-list parameters, in order."""
    out = []
    for i, (pname, param) in enumerate(inspect.signature(fn).parameters.items()):
        if param.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            break
        if "list" in str(param.annotation).lower():
            out.append((i, pname))
    return out


def _wrap_functional(original: Callable, lists: List[Tuple[int, str]]) -> Callable:
    positions = [i for i, _ in lists]

    @functools.wraps(original)
    def step_local_pieces(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= positions[-1] or kwargs.get("differentiable") or RaggedDTensor._gathered_count:
            return original(*args, **kwargs)
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        tensor_lists = [args[i] for i in positions]
        found = _local_lists(tensor_lists)
        if found is None:
            return original(*args, **kwargs)
        local, before = found
        local_args = list(args)
        for i, pieces in zip(positions, local):
            local_args[i] = pieces
        out = original(*local_args, **kwargs)
        _hand_back(tensor_lists, local, before, bump=not kwargs.get("fused"))
        return out

    step_local_pieces.__vz_local_steps__ = True  # type: ignore[attr-defined]
    return step_local_pieces


def _local_lists(tensor_lists: List[list]) -> Optional[Tuple[List[list], List[list]]]:
    """``(the lists with each ragged tensor replaced by its local piece, a copy of those)``, or
    ``None`` when the dispatch path must answer (no ragged parameter, or an index whose tensors
    do not share one layout; see the Note). The hot path of every step, run with caches the
    kernels have just emptied: C-level passes (``map``, comprehensions) where it can."""
    params = tensor_lists[0]
    param_types = set(map(type, params))
    if RaggedDTensor not in param_types:
        return None
    all_ragged = param_types == _RAGGED_ONLY
    specs = list(map(_SPEC, params)) if all_ragged else None
    local: List[list] = []
    for tensors in tensor_lists:
        if type(tensors) is not list or (tensors and len(tensors) != len(params)):
            return None
        same_specs = (all_ragged and tensors and set(map(type, tensors)) == _RAGGED_ONLY
                      and all(map(is_, map(_SPEC, tensors), specs)))
        if same_specs:  # parameter-shaped, each with its parameter's very spec (zeros_like, a gradient)
            pieces = list(map(_LOCAL, tensors))
        else:  # numbers per parameter (Adam's steps), buffers yet to be made (None), other specs, plain ones
            pieces = _mixed_pieces(tensors, params)
            if pieces is None:
                return None
        local.append(pieces)
    return local, [list(pieces) for pieces in local]


_RAGGED_ONLY = {RaggedDTensor}
_SPEC = attrgetter("_spec")
_LOCAL = attrgetter("_local_tensor")


def _mixed_pieces(tensors: list, params: list) -> Optional[list]:
    """Local pieces of a list beside the parameters, index by index: at a ragged parameter's
    index a ragged tensor of its layout, a plain 0-dim tensor or ``None``; at a plain one's a
    plain tensor or ``None``. ``None`` if any index breaks that (the dispatch path answers)."""
    pieces = []
    for t, p in zip(tensors, params):
        if type(p) is RaggedDTensor:
            if type(t) is RaggedDTensor and t._spec.placements == p._spec.placements:
                pieces.append(t._local_tensor)
            elif t is None or (not isinstance(t, DTensor) and t.dim() == 0):
                pieces.append(t)
            else:
                return None
        elif t is None or not isinstance(t, DTensor):
            pieces.append(t)
        else:
            return None
    return pieces


def _hand_back(tensor_lists: List[list], local: List[list], before: List[list], bump: bool) -> None:
    """After the step: a tensor the functional put into a list (SGD's first momentum buffer)
    goes back into the caller's list, in its parameter's layout; the parameters' version
    counters are bumped (see the Note)."""
    params = tensor_lists[0]
    for tensors, pieces, was in zip(tensor_lists, local, before):
        if any(map(is_not, pieces, was)):
            for i, (piece, old) in enumerate(zip(pieces, was)):
                if piece is not old:
                    tensors[i] = like_param(piece, params[i]) if isinstance(piece, torch.Tensor) else piece
    if bump:
        torch.autograd.graph.increment_version(params)
