"""The core helpers the adapters share to put other parameter objects in a module's places
for a while (vescale_zero/api/param_swap.py) and to carry a parameter's attributes onto them
(vescale_zero/runtime/param_attributes.py)."""

from __future__ import annotations

import torch
from torch import nn

from vescale_zero.api.param_swap import put_parameters, replace_parameters
from vescale_zero.runtime.param_attributes import copy_parameter_attributes


def test_replaced_by_identity_tied_once_and_put_back():
    """A tied parameter (two modules, two names) is replaced under both names by ONE object made
    by one call; parameters the callable declines stay; put_parameters restores every place."""
    emb, head, other = nn.Embedding(4, 3), nn.Linear(3, 4, bias=False), nn.Linear(3, 3)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "other": other})
    originals = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    calls = []

    def full(param):
        if param is other.bias:
            return None
        calls.append(param)
        return nn.Parameter(torch.zeros(param.shape))

    slots = replace_parameters(model, full)
    assert len(calls) == 2 and len(slots) == 3  # tied weight: one call, two places
    assert model["emb"].weight is model["head"].weight and model["emb"].weight is not originals["emb.weight"]
    assert model["other"].bias is originals["other.bias"]
    put_parameters(slots)
    assert {n: p for n, p in model.named_parameters(remove_duplicate=False)} == originals


def test_copy_parameter_attributes_skips_what_it_is_told():
    src = nn.Parameter(torch.ones(2))
    src.tensor_model_parallel, src.sharded_range, tag = True, (0, 1), object()
    src.tag = tag
    dst = copy_parameter_attributes(src, nn.Parameter(torch.zeros(2)), skip=("sharded_range",))
    assert dst.tensor_model_parallel is True and dst.tag is tag and not hasattr(dst, "sharded_range")
