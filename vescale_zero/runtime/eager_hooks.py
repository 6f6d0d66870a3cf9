"""Our hooks run eagerly, around a compiled module, never inside its graph.

[Note: hooks outside the compiled graph]
Users compile each transformer block (``block.compile()`` or ``torch.compile(block)``) and
shard it with ``fully_shard``, in either order. Dynamo then traces the module's whole call,
its forward hooks included (and the hooks of any child module it inlines), so our hooks
would be traced too: they read autograd-engine state, issue collectives, swap parameters
and allocate storage, none of which Dynamo can put in a graph, and each such spot breaks
the block's graph in pieces (5-8 graphs per block instead of 1; one break was on
``untyped_storage().nbytes()`` in :mod:`vescale_zero.primitives.dbuffer`). Every function we register
as a hook (module forward pre/post hooks, multi-grad and post-accumulate-grad hooks,
autograd-engine callbacks) is therefore wrapped by :func:`outside_compile`, which is
``torch.compiler.disable``: Dynamo leaves the hook to run eagerly, before and after the
block's one compiled graph, as PyTorch's FSDP2 keeps its hooks outside the compiled
forward. A hook that only ever runs in the autograd engine is not traced today, unless
compiled autograd is on (which we do not test); it is wrapped all the same so that every
hook follows one rule. The wrapper changes nothing when nothing is compiled.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

__all__ = ["outside_compile"]

F = TypeVar("F", bound=Callable)


def outside_compile(fn: F) -> F:
    """``fn`` run eagerly even when called from code ``torch.compile`` traces (see
    [Note: hooks outside the compiled graph]); works on functions and on methods."""
    return torch.compiler.disable(fn, recursive=True)  # keeps fn's name and docstring
