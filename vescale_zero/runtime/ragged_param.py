"""One parameter of a ``fully_shard`` group, and the two parameter objects that stand for it.

::

    original nn.Parameter  (the module's; replaced by fully_shard)
        |
        |  split by the group's plan
        v
    sharded    nn.Parameter(RaggedDTensor): global shape,     held between forward/backward;
               RaggedShard placement; its local tensor is      the optimizer's parameter
               [start, end) of the flattened tensor, a view
               into master.local
    unsharded  nn.Parameter, full shape, a view into           held while the group is gathered
               compute.full (param_dtype)                       (forward, backward, recompute)

Both objects live as long as the group. :meth:`RaggedParam.to_sharded` /
:meth:`RaggedParam.to_unsharded` put one of them into every module attribute that held the
original (a tied weight has several owners), so a module always reads the right one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from ..primitives.placement import ShardedRange
from ..primitives.ragged_tensor import RaggedDTensor
from ..primitives.tensor_parallel import TensorParallelLayout
from ..torch_compat import DTensorSpec
from .param_attributes import copy_parameter_attributes

__all__ = ["ManagedParam", "ShardedRange", "RaggedParam"]


@dataclass(frozen=True)
class ManagedParam:
    """A parameter of the group: its name and every (module, attribute) that holds it.
    ``shape``: what the group holds of it -- for a tensor-parallel parameter (``tp``, see
    tensor_parallel [Note: ragged inside the tensor-parallel piece]) its TP-local tensor's."""

    fqn: str
    owners: Tuple[Tuple[nn.Module, str], ...]
    shape: torch.Size
    requires_grad: bool
    tp: Optional[TensorParallelLayout] = None


def _new_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    # keep framework tags (e.g. tensor-parallel attrs)
    return copy_parameter_attributes(like, nn.Parameter(data, requires_grad=like.requires_grad))


class RaggedParam:
    """The sharded and unsharded parameter objects of one managed parameter.

    Args:
        managed: name, owners and shape.
        original: the module's parameter (its attributes are copied onto both objects).
        sharded_data: this rank's piece, a view into the group's master shard.
        spec: the layout of the sharded parameter (``ragged_tensor.ragged_spec``): it becomes a
            :class:`RaggedDTensor` whose local tensor is ``sharded_data``.
        unsharded_data: the whole tensor, a view into the group's full compute buffer (for a
            tensor-parallel parameter, a DTensor on its tp mesh whose local tensor is that view).
        unsharded_like: whose attributes the unsharded object copies (default ``original``).
    """

    def __init__(self, managed: ManagedParam, original: nn.Parameter, sharded_data: torch.Tensor,
                 unsharded_data: torch.Tensor, spec: DTensorSpec,
                 unsharded_like: Optional[nn.Parameter] = None) -> None:
        self.managed = managed
        self.sharded = _new_param(RaggedDTensor.from_piece(sharded_data, spec), original)
        self.unsharded = _new_param(unsharded_data, original if unsharded_like is None else unsharded_like)

    @property
    def requires_grad(self) -> bool:
        return self.managed.requires_grad

    def _install(self, param: nn.Parameter) -> None:
        for module, attr in self.managed.owners:
            module._parameters[attr] = param

    def to_sharded(self) -> None:
        self._install(self.sharded)

    def to_unsharded(self) -> None:
        self._install(self.unsharded)

