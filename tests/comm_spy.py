"""Test-only: record the core's collectives (who calls what, on which group, how big).

:class:`CommSpy` wraps the names ``vescale_zero.primitives.dbuffer`` (all-gather, reduce-scatter) and
``vescale_zero.runtime.grad_reduce`` (the HSDP all-reduce across replicas) and ``vescale_zero.runtime.param_gather``
(the FP8 gather's byte all-gather) call, and Muon's moves (``vescale_zero.optim.muon``), while installed.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

import vescale_zero.optim.muon as muon_module
import vescale_zero.primitives.dbuffer as dbuffer_module
import vescale_zero.runtime.grad_reduce as grad_reduce_module
import vescale_zero.runtime.param_gather as param_gather_module

__all__ = ["CommSpy"]


class CommSpy:
    """Records ``(kind, group size, numel, group, step, micro-batch)`` of every collective a
    DBuffer or a gradient reducer runs (the core's collectives, as those modules call them);
    ``step`` and ``micro-batch`` are those of the enclosing :meth:`window`, else ``None``. Muon's
    moves are ``("all_to_all", group size, elements this rank sends to the others, group, ...)``."""

    def __init__(self) -> None:
        self.calls, self._at = [], (None, None)

    def _wrap(self, kind, real, group_pos):
        def spy(*args, **kwargs):
            tensor, group = args[0], args[group_pos] if len(args) > group_pos else kwargs.get("group")
            self.calls.append((kind, dist.get_world_size(group), tensor.numel(), group) + self._at)
            return real(*args, **kwargs)
        return spy

    def _wrap_all_to_all(self, real):
        def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            me = dist.get_rank(group)
            sent = sum(n for r, n in enumerate(input_split_sizes) if r != me)
            self.calls.append(("all_to_all", dist.get_world_size(group), sent, group) + self._at)
            return real(output, input, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                        group=group, async_op=async_op)
        return spy

    @contextlib.contextmanager
    def installed(self):
        saved = (dbuffer_module.all_gather, dbuffer_module.reduce_scatter, grad_reduce_module.all_reduce,
                 param_gather_module.all_gather)
        dbuffer_module.all_gather = self._wrap("all_gather", saved[0], 2)
        dbuffer_module.reduce_scatter = self._wrap("reduce_scatter", saved[1], 2)
        grad_reduce_module.all_reduce = self._wrap("all_reduce", saved[2], 1)
        param_gather_module.all_gather = self._wrap("all_gather", saved[3], 2)
        moves = muon_module.all_to_all_single
        muon_module.all_to_all_single = self._wrap_all_to_all(moves)
        try:
            yield self
        finally:
            (dbuffer_module.all_gather, dbuffer_module.reduce_scatter, grad_reduce_module.all_reduce,
             param_gather_module.all_gather) = saved
            muon_module.all_to_all_single = moves

    @contextlib.contextmanager
    def window(self, step, micro):
        self._at = (step, micro)
        try:
            yield
        finally:
            self._at = (None, None)

    def ranks_of(self, kind: str) -> list:
        """The distinct rank lists of the groups ``kind`` ran on, sorted."""
        return sorted({tuple(dist.get_process_group_ranks(c[3])) for c in self.calls if c[0] == kind})
