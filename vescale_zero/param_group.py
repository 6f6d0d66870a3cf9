"""ParamGroup: the parameters that ``fully_shard`` gathers together, and their buffers.

One group owns, per rank::

    role            buffer (DBuffer)   dtype          lives
    sharded params  master.local       param's own    always (the optimizer's tensors)
    gather input    compute.local      param_dtype    always; *is* master.local without MP
    full params     compute.full       param_dtype    while unsharded (forward/backward)
    full grads      grad.full          param_dtype    from pre-backward to reduce-scatter
    reduce input    reduce.full        reduce_dtype   only when reduce_dtype != param_dtype
    sharded grads   sharded_grad.local param's own    always (``param.grad`` views)

Every parameter object the module sees is a view: a sharded parameter into
``master.local``, an unsharded parameter into ``compute.full``, a gradient into
``grad.full`` (autograd accumulates into it in place) or ``sharded_grad.local``.

[Note: gradient path]
pre-backward attaches ``grad.full`` views as the unsharded parameters' ``.grad``;
AccumulateGrad adds into them in place. When the last of the group's gradients has
been accumulated (or, at the latest, when the whole backward ends) the group runs one
reduce-scatter (AVG) from the full gradient buffer into its sharded gradient buffer,
asynchronously; ``finish_grad_sync`` waits for it and attaches the sharded ``.grad``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .collectives import CommStats, all_gather
from .dbuffer import DBuffer
from .fp8_gather import FP8GatherLayout
from .planner import ShardPlan, TensorSpec, plan

__all__ = ["ManagedParam", "ParamGroup", "GroupState", "ShardedRange"]


@dataclass(frozen=True)
class ShardedRange:
    """Which flat elements ``[start, end)`` of a full parameter of ``shape`` a sharded
    parameter holds, and the block size its layout keeps whole (structure-aware optimizers
    read it as ``param.sharded_range``)."""

    start: int
    end: int
    shape: Tuple[int, ...]
    granularity: int


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited on
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class ManagedParam:
    """A parameter of the group: its name and every (module, attribute) that holds it."""

    fqn: str
    owners: Tuple[Tuple[nn.Module, str], ...]
    shape: torch.Size
    requires_grad: bool


def _new_param(data: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=like.requires_grad)
    for key, value in vars(like).items():  # keep framework tags (e.g. tensor-parallel attrs)
        setattr(param, key, value)
    return param


class ParamGroup:
    """Buffers and state of one FSDP group on one rank (see module docstring)."""

    def __init__(
        self,
        managed: Sequence[ManagedParam],
        originals: Sequence[nn.Parameter],
        granularities: Sequence[int],
        process_group: dist.ProcessGroup,
        *,
        param_dtype: Optional[torch.dtype] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        align: int = 1,
        fp8_tile: Optional[int] = None,
    ) -> None:
        dtypes = {p.dtype for p in originals}
        devices = {p.device for p in originals}
        if len(dtypes) != 1 or len(devices) != 1:
            names = [f"{m.fqn}: {p.dtype} on {p.device}" for m, p in zip(managed, originals)]
            raise ValueError(
                "all parameters of one fully_shard group must share a dtype and a device "
                f"(they share one flat buffer); got {names}. Cast/move the module first, or "
                "apply fully_shard to sub-modules so each group is uniform."
            )
        self.managed = list(managed)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.orig_dtype = originals[0].dtype
        self.device = originals[0].device
        self.param_dtype = param_dtype or self.orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        specs = [TensorSpec(p.numel(), g, m.fqn) for m, p, g in zip(managed, originals, granularities)]
        self.plan: ShardPlan = plan(specs, self.world_size, align=align)
        self.stats = CommStats()

        shapes = [m.shape for m in managed]
        new = lambda dtype, **kw: DBuffer(self.plan, self.rank, dtype, self.device, shapes=shapes, **kw)  # noqa: E731
        self.master = new(self.orig_dtype, with_full=False)
        self.compute = (
            new(self.orig_dtype, local=self.master.local)
            if self.param_dtype == self.orig_dtype
            else new(self.param_dtype)
        )
        self.grad = new(self.param_dtype, with_local=False)
        self.reduce = None if self.reduce_dtype == self.param_dtype else new(self.reduce_dtype, with_local=False)
        self.sharded_grad = new(self.orig_dtype, with_full=False)

        with torch.no_grad():
            for i, p in enumerate(originals):
                start, end = self.master.local_range(i)
                self.master.local_view(i).copy_(p.detach().reshape(-1)[start:end])
        self.sharded_params: List[nn.Parameter] = [
            _new_param(self.master.local_view(i), p) for i, p in enumerate(originals)
        ]
        for i, (sp, m) in enumerate(zip(self.sharded_params, managed)):
            start, end = self.master.local_range(i)
            sp.sharded_range = ShardedRange(start, end, tuple(m.shape), granularities[i])
        self.unsharded_params: List[nn.Parameter] = [
            _new_param(self.compute.full_view(i), p) for i, (m, p) in enumerate(zip(managed, originals))
        ]
        self._grad_indices = [i for i, m in enumerate(managed) if m.requires_grad]
        for i in self._grad_indices:
            self.unsharded_params[i].register_post_accumulate_grad_hook(self._on_grad_accumulated)

        # [Note: FP8 all-gather] With ``fp8_tile`` the gather moves float8 bytes plus one
        # scale per tile instead of ``param_dtype``: each rank quantizes its own tile bands
        # of the master shard (see vescale_zero.fp8_gather), and the full buffer is filled by
        # dequantizing. The granularity must keep tile bands whole (fully_shard sees to it).
        self.fp8: Optional[FP8GatherLayout] = FP8GatherLayout(self.plan, shapes, fp8_tile) if fp8_tile else None
        if self.fp8 is not None:
            w, S, T = self.world_size, self.plan.shard_size, self.fp8.max_scales
            self._fp8_local = torch.zeros(S, dtype=torch.uint8, device=self.device)
            self._fp8_full = torch.empty(w * S, dtype=torch.uint8, device=self.device)
            self._scales_local = torch.ones(T, dtype=torch.float32, device=self.device)
            self._scales_full = torch.empty(w * T, dtype=torch.float32, device=self.device)
            self._fp8_version = -1

        self.state = GroupState.SHARDED
        self._cast_version = -1
        self.requires_grad_sync = True
        self.gradient_divide_factor: Optional[float] = None  # None: AVG over the group
        self.ran_forward = False  # with grad enabled, since the last backward
        self._unshard_work = None
        self._in_backward = False
        self._grads_ready = 0
        self._post_backward_done = False
        self._pending_reduce: Optional[tuple] = None
        self.on_reduce_issued: Optional[Callable[["ParamGroup"], None]] = None  # set by the runtime
        self.to_sharded_params()

    # ---- which parameter objects the modules hold ------------------------------------
    def _install(self, params: Sequence[nn.Parameter]) -> None:
        for m, p in zip(self.managed, params):
            for module, attr in m.owners:
                module._parameters[attr] = p

    def to_sharded_params(self) -> None:
        self._install(self.sharded_params)

    def to_unsharded_params(self) -> None:
        self._install(self.unsharded_params)

    # ---- all-gather / free -----------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather the full parameters into ``compute.full`` (no-op unless sharded)."""
        if self.state is not GroupState.SHARDED:
            return
        if self.fp8 is not None:
            self._unshard_fp8(async_op)
            return
        if self.compute.local is not self.master.local:
            # One cast per group, and only when the optimizer has changed the master shard
            # since the last one (views share the version counter of ``master.local``).
            if self._cast_version != self.master.local._version:
                with torch.no_grad():
                    self.compute.local.copy_(self.master.local)
                self._cast_version = self.master.local._version
        self._unshard_work = self.compute.all_gather(self.process_group, stats=self.stats, async_op=async_op)
        self.state = GroupState.UNSHARDING

    def _unshard_fp8(self, async_op: bool) -> None:
        if self._fp8_version != self.master.local._version:  # quantize once per optimizer step
            with torch.no_grad():
                self.fp8.quantize_local(self.rank, self.master.local, self._fp8_local, self._scales_local)
            self._fp8_version = self.master.local._version
        works = [
            all_gather(self._fp8_full, self._fp8_local, self.process_group, self.stats, async_op),
            all_gather(self._scales_full, self._scales_local, self.process_group, self.stats, async_op),
        ]
        self._unshard_work = works if async_op else None
        self.compute.allocate()
        self.state = GroupState.UNSHARDING

    def wait_for_unshard(self) -> None:
        if self.state is GroupState.UNSHARDING:
            if self._unshard_work is not None:
                for work in self._unshard_work if isinstance(self._unshard_work, list) else [self._unshard_work]:
                    work.wait()
                self._unshard_work = None
            if self.fp8 is not None:
                with torch.no_grad():  # through the wire: see DBuffer [Note: version counter]
                    self.fp8.dequantize_full(self._fp8_full, self._scales_full, self.compute._wire)
            self.state = GroupState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters and hand the modules their sharded parameters."""
        self.wait_for_unshard()
        self.compute.free()
        self.to_sharded_params()
        self.state = GroupState.SHARDED

    # ---- backward --------------------------------------------------------------------
    def pre_backward(self) -> None:
        """Re-gather parameters and attach full-gradient views before the module's backward."""
        self.unshard()
        self.wait_for_unshard()
        if not self._grad_indices or self._in_backward:
            return
        self.grad.allocate(zero=not self.grad.is_allocated)  # kept (not zeroed) while accumulating
        for i in self._grad_indices:
            up = self.unsharded_params[i]
            if up.grad is None:
                up.grad = self.grad.full_view(i)
        self._in_backward = True
        self._grads_ready = 0
        self._post_backward_done = False

    def _on_grad_accumulated(self, _param: torch.Tensor) -> None:
        if self._in_backward:
            self._grads_ready += 1
            if self._grads_ready == len(self._grad_indices):
                self.post_backward()

    def _gather_stray_grads(self) -> None:
        """Fold gradients autograd left outside ``grad.full`` (e.g. no pre-backward ran)."""
        for i in self._grad_indices:
            up = self.unsharded_params[i]
            view = self.grad.full_view(i)
            if up.grad is not None and up.grad.data_ptr() != view.data_ptr():
                if not self.grad.is_allocated:
                    self.grad.allocate(zero=True)
                with torch.no_grad():
                    view.add_(up.grad)
                up.grad = view

    def post_backward(self) -> None:
        """Issue this group's reduce-scatter (async) and reshard its parameters."""
        if self._post_backward_done or not self._grad_indices:
            return
        self._post_backward_done = True
        self._in_backward = False
        self._gather_stray_grads()
        self.grad.allocate(zero=not self.grad.is_allocated)  # every rank joins the collective
        if not self.requires_grad_sync:
            return
        for i in self._grad_indices:
            self.unsharded_params[i].grad = None
        source = self.grad
        if self.reduce is not None:
            with torch.no_grad():
                self.reduce.allocate().copy_(self.grad.full)  # one cast per group
            self.grad.free()
            source = self.reduce
        op = dist.ReduceOp.AVG
        if self.gradient_divide_factor is not None:
            # [Note: divide factor] SUM of gradients pre-divided by the factor: the mean
            # over a larger population than this group (Megatron's expert parameters are
            # reduced over the expert-data-parallel group but averaged over data-parallel),
            # or a plain sum (factor 1) when the loss is normalised afterwards.
            # Multiplies by the reciprocal, as Megatron's DDP does, so the two round alike.
            if self.gradient_divide_factor != 1:
                with torch.no_grad():
                    source.full.mul_(1.0 / self.gradient_divide_factor)
            op = dist.ReduceOp.SUM
        accumulate = any(self.sharded_params[i].grad is not None for i in self._grad_indices)
        direct = not accumulate and self.reduce_dtype == self.orig_dtype
        out = self.sharded_grad.local if direct else torch.empty(self.plan.shard_size, dtype=self.reduce_dtype, device=self.device)
        work = source.reduce_scatter(self.process_group, into=out, op=op, stats=self.stats, async_op=True)
        self._pending_reduce = (work, source, out, accumulate)
        if self.on_reduce_issued is not None:
            self.on_reduce_issued(self)
        if len(self._grad_indices) == len(self.managed):
            # A frozen parameter has no AccumulateGrad to tell us that backward is done
            # with it, so groups holding one reshard only when the whole backward ends.
            self.reshard()

    def finish_grad_sync(self) -> None:
        """Wait for the reduce-scatter and give the sharded parameters their ``.grad``."""
        self._in_backward = False
        if self._pending_reduce is None:
            return
        work, source, out, accumulate = self._pending_reduce
        self._pending_reduce = None
        work.wait()
        source.free()
        local = self.sharded_grad.local
        with torch.no_grad():
            if out is not local:
                if accumulate:
                    for i in self._grad_indices:
                        if self.sharded_params[i].grad is None:
                            self.sharded_grad.local_view(i).zero_()
                    self._accumulate_into_grads(out)
                else:
                    local.copy_(out)  # one cast per group
            for i in self._grad_indices:
                sp = self.sharded_params[i]
                if sp.grad is None:
                    sp.grad = self.sharded_grad.local_view(i)

    def zero_grad(self) -> None:
        """Drop every gradient of the group: locally accumulated full gradients (from
        backwards without gradient sync) and the sharded ones (zeroed, ``.grad = None``)."""
        if self._pending_reduce is not None:
            self.finish_grad_sync()
        for i in self._grad_indices:
            self.unsharded_params[i].grad = None
            self.sharded_params[i].grad = None
        self.grad.free()
        if self.reduce is not None:
            self.reduce.free()
        self.sharded_grad.local.zero_()

    def _accumulate_into_grads(self, reduced: torch.Tensor) -> None:
        ours = all(
            sp.grad is None or sp.grad.data_ptr() == self.sharded_grad.local_view(i).data_ptr()
            for i, sp in ((i, self.sharded_params[i]) for i in self._grad_indices)
        )
        if ours:
            self.sharded_grad.local.add_(reduced)  # one add per group
            return
        slices = self.plan.local_slices(self.rank)
        for i in self._grad_indices:  # a user replaced some .grad: add piece by piece
            start, end, off = slices[i]
            piece = reduced.narrow(0, off, end - start)
            target = self.sharded_params[i].grad
            (target if target is not None else self.sharded_grad.local_view(i)).add_(piece)

    # ---- introspection ---------------------------------------------------------------
    @property
    def grad_indices(self) -> List[int]:
        return list(self._grad_indices)
