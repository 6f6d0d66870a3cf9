"""The gradient side of one group: full gradients -> one reduce-scatter -> sharded gradients.

::

    buffer         dtype          lives                                  is
    (autograd's)   param_dtype    first gradient .. issue                 the unsharded params' .grad
                                  (see the Note below)
    full           reduce_dtype   issue .. finish; from the first         the collective's input; the
                                  backward without sync when it           gradients accumulated without
                                  accumulates (see below) .. finish       sync
    sharded        master dtype   first reduce-scatter .. the last        the sharded params' .grad
                                  .grad view let go (zero_grad)           (grad_shard, see below)

``full`` from a backward without sync: [Note: accumulating in the reduce dtype]; the sharded
gradients' lifetime: grad_shard [Note: gradient shards live with their .grad].

``issue`` copies the gradients into ``full`` (casting to the reduce dtype on the way), or adds
them to what backwards without sync accumulated there, scales once per group and starts the
reduce-scatter (asynchronous); ``finish`` waits, frees ``full`` and leaves the result in the
shard, added to what is there when gradients accumulate across synced backwards.

[Note: HSDP] With a replicate group (``fully_shard`` on a 2-D ``("replicate", "shard")``
mesh) the reduce-scatter runs inside the shard group and ``finish`` then all-reduces the
reduced *shard* across the replicas (bytes across replicas = shard size), before it is
cast or accumulated: the mean of a mean of equal-sized groups is the mean over the whole
data-parallel world, as DDP over it gives. A divide factor divides once: SUM in both.
Without gradient sync nothing is reduced, so the replicas are skipped too.

[Note: what runs after the reduce-scatter]
FSDP2's settings act on the reduced shard in this order, before it becomes the sharded
``.grad``: under HSDP the all-reduce across replicas ([Note: HSDP]; with ``requires_all_reduce``
False the reduced shards are summed instead, and the next backward that all-reduces adds them
in); then ``all_reduce_hook`` (on its own stream if one was given); then, with ``force_sum``
(every collective a SUM), one division by the divide factor, or by the ranks the gradient was
reduced over (shard group x replicas); then the cast or the addition into the sharded gradients
(after the copy to the host when offloaded). Without ``force_sum`` the collectives average
(AVG), or a divide factor is applied before a SUM ([Note: divide factor]). Last, once every
sharded ``.grad`` is in place, ``post_finish_hooks`` run (no arguments), e.g. an optimizer
that starts its step in backward (optim/muon_hidden [Note: the Muon step hidden in backward]);
a reduction that only adds into HSDP's partial sum runs none.

[Note: all-reduce instead of reduce-scatter]
With :attr:`GradReducer.reduce_by_all_reduce` (DeepSpeed's ``"reduce_scatter": false``) the
group's gradients are reduced by one all-reduce of ``full`` instead of a reduce-scatter, and
each rank keeps its own range of the result, ``[rank * S, (rank + 1) * S)``: the same shard, the
collective ZeRO-3 runs under that key. Averaging divides every rank's ``full`` by the group
size before a SUM (gloo has no AVG all-reduce), as ZeRO-3 does there. It moves twice the bytes
of a reduce-scatter; everything after the collective is unchanged
([Note: what runs after the reduce-scatter]).

[Note: gradients are copied in at the reduce-scatter]
Autograd hands a parameter its first gradient as a tensor of its own (AccumulateGrad keeps
the incoming tensor as ``.grad``) and adds every later one of the window (another micro-batch
without sync, a recompute's nested backward, a second use of the parameter) into it in
place. Those tensors stay the parameters' ``.grad`` until the group issues its reduce-scatter:
only then does ``full`` get storage, and each gradient is copied into its view (cast to the
reduce dtype in the same copy) and dropped at once. Backward therefore never holds a group's
whole gradient buffer while its parameters are still gathered and its gradients arrive -- a
buffer taken at the first gradient would sit beside every incoming gradient (a 14336x4096
weight's, say) for the whole of the group's backward, while the activations are largest --
and each element is still read and written once, as a copy-in costs, with no zeroing of
``full`` except its padding and the views of tensors that got no gradient.

[Note: accumulating in the reduce dtype]
Backwards without gradient sync (``set_requires_gradient_sync(False)``, Megatron's
``no_sync``, DeepSpeed's micro-batches before the boundary) must sum their gradients in the
reduce dtype, as PyTorch FSDP2 (``unsharded_accumulated_grad``), Megatron's DDP (fp32
``main_grad`` under ``--accumulate-allreduce-grads-in-fp32``) and DeepSpeed (``grad_accum_dtype``)
do. Autograd cannot: it adds every later gradient into ``.grad`` in the parameter's dtype, so
bf16 compute summed 32 micro-batches to 0.9-1% relative error, and fp16 with a loss scale
overflowed in the sum where every single micro-batch was finite.

So when a group's backward ends without sync (:meth:`GradReducer.accumulate_unsynced`), its gradients
go into ``full``, in the reduce dtype: copied (cast) by the first backward of the window,
added by every later one, each autograd ``.grad`` dropped at once. ``full`` then stays
allocated until the synced backward adds its own gradients and reduce-scatters it (or
``zero``). Two designs were possible:

* this one, a full-size buffer per group while accumulating: ``4 * global_size`` bytes per
  group for an fp32 reduce dtype (the whole model's parameter count plus the plan's
  padding, times 4, on every rank), where autograd's bf16 ``.grad`` held 2 per element
  before: +2 bytes per parameter while a window is open, freed by the synced backward's
  reduce-scatter. It is what FSDP2 holds (its fp32 ``unsharded_accumulated_grad`` per
  parameter), and a backward without sync runs no collective at all, which is what the user
  asked for when turning sync off (a single node's many micro-batches; a slow network between
  replicas). Measured (tests/test_grad_accumulation.py, a 3-layer GPT, 159296 planned elements,
  2 ranks): 637184 B held while accumulating (318592 B in bf16 before), FSDP2 637184 B; the
  step's peak 1342600 B, FSDP2's 1345032 B.
* an early reduce-scatter per micro-batch into an fp32 sharded accumulator: ``4 * S`` bytes
  per group (``1/m`` of the above), but one collective per group per micro-batch instead of
  per step (k times the gradient traffic for k micro-batches). That is exactly what running
  every backward *with* gradient sync already does here -- each reduce-scatter's result is
  added to the sharded gradient in the master dtype -- so a user short of memory keeps sync on;
  turning it off buys fewer collectives with memory, and now with the right dtype.

When the parameters already compute in the reduce dtype (fp32 training, or bf16 reduce of
bf16 compute), autograd's ``.grad`` is already the accumulator: nothing moves until the
synced backward copies it in, as before (:attr:`GradReducer.accumulates_in_full` is false),
so such training pays no extra copy and no extra buffer. A reduce dtype narrower than the
compute dtype (fp32 compute, bf16 reduce) also keeps summing in the wider ``.grad``: FSDP2
would cast the sum down to the reduce dtype; we never accumulate in less than autograd does.
The synced path is unchanged when nothing was accumulated: ``full`` is allocated at ``issue``
and freed at ``finish``, one group in flight
([Note: gradients are copied in at the reduce-scatter]).

[Note: gradients written into full during backward]
A framework whose kernels accumulate weight gradients straight into a full-size buffer during
backward (Megatron's ``--gradient-accumulation-fusion``: the wgrad GEMM adds into
``param.main_grad``, fp32, and autograd gets a dummy) sets :attr:`GradReducer.written_into_full`:
from the group's first backward of a window, ``full`` is allocated and zeroed
(:meth:`GradReducer.open_full`) and is the accumulator of every backward until the synced one
reduce-scatters it, as Megatron's DDP gradient buffer (and Megatron-FSDP's main-grad buffer) is:
the kernel adds into its views, the other gradients (and those the framework still hands to
autograd) are added at the end of each backward, in backward order, and a ``.grad`` the
predicate says is already in ``full`` (a dummy) is dropped. It costs ``full`` from the group's
first backward to its reduce-scatter, what Megatron's own buffers hold.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..primitives.collectives import CommStats, all_reduce
from ..primitives.dbuffer import DBuffer
from ..primitives.planner import ShardPlan
from ..primitives.ragged_tensor import like_param, local_piece
from ..primitives.tensor_parallel import local_gradient
from .grad_shard import GradShard
from .offload import HostCopies

__all__ = ["GradReducer"]


class _OwnRangeOfAllReduce:
    """The work of an all-reduce of ``full`` whose ``wait()`` also copies this rank's range into
    ``out`` ([Note: all-reduce instead of reduce-scatter])."""

    def __init__(self, work: dist.Work, full: torch.Tensor, out: torch.Tensor, start: int) -> None:
        self._work, self._full, self._out, self._start = work, full, out, start

    def wait(self, timeout: Optional[object] = None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._out.copy_(self._full.narrow(0, self._start, self._out.numel()))
            self._work = self._full = None
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


class GradReducer:
    """Buffers and the reduce-scatter of one group's gradients (see module docstring).

    Args:
        plan, rank, process_group: the group's layout and ranks (the shard group).
        replicate_group: HSDP's group of this rank's replicas, or ``None`` (see [Note: HSDP]).
        stats: where the reduce-scatter's bytes are counted.
        reduce_dtype: of the collective (and of ``full``).
        shard_dtype: of the sharded gradients (the master parameters' dtype).
        grad_dtype: of the unsharded parameters' gradients (the compute dtype); default
            ``reduce_dtype``.
        device, shapes: of the buffers and each tensor's full view.
        host_copies: an offloaded group's copies (vescale_zero.runtime.offload): the sharded gradients
            then live in host memory and each reduce-scatter's result is copied there.
    """

    def __init__(self, plan: ShardPlan, rank: int, process_group: dist.ProcessGroup, stats: CommStats, *,
                 reduce_dtype: torch.dtype, shard_dtype: torch.dtype,
                 device: torch.device, shapes: Sequence[Sequence[int]],
                 replicate_group: Optional[dist.ProcessGroup] = None,
                 grad_dtype: Optional[torch.dtype] = None, host_copies: Optional[HostCopies] = None) -> None:
        self.plan, self.rank, self.process_group, self.stats = plan, rank, process_group, stats
        self.replicate_group = replicate_group
        self.reduce_dtype, self.shard_dtype = reduce_dtype, shard_dtype
        self.grad_dtype = grad_dtype or reduce_dtype
        self.full = DBuffer(plan, rank, reduce_dtype, device, shapes=shapes, with_local=False)
        self.host_copies = host_copies
        if host_copies is None:
            self.sharded = GradShard(plan, rank, shard_dtype, device)
        else:
            offload = host_copies.offload
            self.sharded = GradShard(plan, rank, shard_dtype, offload.device, pin_memory=offload.pins(device))
        self.requires_grad_sync = True
        self.divide_factor: Optional[float] = None  # None: AVG over the group
        # FSDP2's settings, [Note: HSDP] and [Note: what runs after the reduce-scatter]
        self.requires_all_reduce = True
        self.force_sum = False
        self.all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        self.all_reduce_hook_stream: Optional[torch.Stream] = None
        self.comm: Optional[Callable] = None  # a custom reduce-scatter (FSDP2's ReduceScatter) runs it
        self.post_finish_hooks: List[Callable[[], None]] = []  # [Note: what runs after the reduce-scatter]
        self.reduce_group: dist.ProcessGroup = process_group  # set_separate_reduce_scatter_group
        self.reduce_by_all_reduce = False  # [Note: all-reduce instead of reduce-scatter]
        self._partial: Optional[torch.Tensor] = None  # HSDP without all-reduce: the reduced shards' sum
        self._pending: Optional[Tuple] = None
        self._holds_accumulated = False  # ``full`` holds the sum of the gradients of backwards without sync
        # [Note: gradients written into full during backward]: param -> its .grad is already in full
        self.written_into_full: Optional[Callable[[nn.Parameter], bool]] = None

    _SETTINGS = ("divide_factor", "requires_grad_sync", "requires_all_reduce", "force_sum", "all_reduce_hook",
                 "all_reduce_hook_stream", "comm", "reduce_by_all_reduce", "post_finish_hooks")

    def keep_settings_of(self, other: "GradReducer") -> None:
        """Take ``other``'s user settings (a group rebuilt when it leaves the meta device); the
        shard group is the same, so is a separate reduce-scatter group made for it."""
        for name in self._SETTINGS:
            setattr(self, name, getattr(other, name))
        self.reduce_group = other.reduce_group

    def discard(self) -> None:
        """runtime [Note: resetting an iteration]: wait for a reduce-scatter in flight and drop
        its result, the gradients accumulated without sync and HSDP's partial sum; the sharded
        ``.grad`` stay."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
        self.full.free()
        self._holds_accumulated = False
        self._partial = None

    def open_full(self) -> None:
        """``full`` as the accumulator of this backward
        ([Note: gradients written into full during backward]): allocated and zeroed unless it
        already holds this window's gradients."""
        if self._pending is not None:
            raise RuntimeError(
                "vescale_zero: a fully_shard group's backward started while its previous reduce-scatter was still "
                "in flight; finish_grad_sync() must run at the end of every synced backward")
        if not self._holds_accumulated:
            self.full.allocate(zero=True)
            self._holds_accumulated = True

    @property
    def accumulates_in_full(self) -> bool:
        """Backwards without sync sum into ``full`` ([Note: accumulating in the reduce dtype]):
        the reduce dtype is wider than the gradients autograd makes. Otherwise autograd's
        ``.grad`` accumulates, at no extra cost (never in a dtype narrower than its own)."""
        return _bits(self.reduce_dtype) > _bits(self.grad_dtype)

    @property
    def arrived(self) -> bool:
        """A reduce-scatter is in flight and :meth:`finish` would neither wait on the network nor
        run a collective (HSDP's all-reduce across replicas runs in one order on every rank: a
        finish whose timing depends on the network cannot issue it)."""
        return self._pending is not None and self.replicate_group is None and self._pending[0].is_completed()

    def _take_grads(self, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        """Move the unsharded ``params``' ``.grad`` into ``full``, dropping each at once. Into an
        empty ``full`` they are copied ([Note: gradients are copied in at the reduce-scatter]):
        it gets its storage here, and tensors without a gradient, and the padding, are zeros
        (every rank joins the collective); into gradients accumulated without sync they are
        added ([Note: accumulating in the reduce dtype]), in the reduce dtype."""
        add = self._holds_accumulated
        if not add:
            self.full.allocate()
            self.full.zero_padding()
        written = set()
        in_full = self.written_into_full
        with torch.no_grad():
            for i, up in params:
                if up.grad is not None and in_full is not None and in_full(up):
                    up.grad = None  # a dummy: the gradient is in ``full`` already
                    written.add(i)
                elif up.grad is not None:
                    view = self.full.full_view(i)
                    # a DTensor gradient: tensor_parallel [Note: ragged inside the tensor-parallel piece]
                    grad = local_gradient(up.grad, up)
                    if add:
                        view.add_(grad)
                    else:
                        view.copy_(grad)
                    up.grad = None
                    written.add(i)
        if not add:
            views = [self.full.full_view(i) for i in range(len(self.plan.specs)) if i not in written]
            if views:
                torch._foreach_zero_(views)

    def accumulate_unsynced(self, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        """This group's backward ended without gradient sync: sum the gradients of
        ``(index, unsharded param)`` into ``full`` in the reduce dtype, for the synced backward
        to reduce ([Note: accumulating in the reduce dtype]); a no-op unless
        :attr:`accumulates_in_full` (autograd's ``.grad`` accumulates then)."""
        if not (self.accumulates_in_full or self.written_into_full is not None) or all(
                up.grad is None for _, up in params):
            return
        if self._pending is not None:
            raise RuntimeError(
                "vescale_zero: a fully_shard group's backward without gradient sync ended while its previous "
                "reduce-scatter was still in flight (its gradients would be added into the collective's input); "
                "finish_grad_sync() must run at the end of every synced backward")
        self._take_grads(params)
        self._holds_accumulated = True

    def issue(self, accumulate: bool, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        """Copy the gradients of ``(index, unsharded param)`` in (or add them to those accumulated
        without sync) and start the reduce-scatter of ``full`` (asynchronous). ``accumulate``: add
        the result to the sharded gradients already there instead of replacing them."""
        self._take_grads(params)
        self._holds_accumulated = False  # ``full`` is the collective's input now; finish frees it
        source = self.full
        op = dist.ReduceOp.AVG
        post_divide: Optional[float] = None  # [Note: what runs after the reduce-scatter]
        if self.force_sum:
            op = dist.ReduceOp.SUM
            post_divide = self.divide_factor or float(dist.get_world_size(self.process_group) * (
                dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1))
        elif self.divide_factor is not None:
            # [Note: divide factor] SUM of gradients pre-divided by the factor: the mean
            # over a larger population than this group (Megatron's expert parameters are
            # reduced over the expert-data-parallel group but averaged over data-parallel),
            # or a plain sum (factor 1) when the loss is normalised afterwards.
            # Multiplies by the reciprocal, as Megatron's DDP does, so the two round alike.
            if self.divide_factor != 1:
                with torch.no_grad():
                    source.full.mul_(1.0 / self.divide_factor)
            op = dist.ReduceOp.SUM
        direct = not accumulate and self.reduce_dtype == self.shard_dtype and self.host_copies is None
        # The shard gets its storage here if no .grad holds it
        # (grad_shard [Note: gradient shards live with their .grad]); ``_pending`` holds it until
        # finish hands out the views.
        out = self.sharded.allocate() if direct else torch.empty(
            self.plan.shard_size, dtype=self.reduce_dtype, device=self.full.device)
        if self.reduce_by_all_reduce:
            work = self._all_reduce_into(out, op)
        else:
            work = source.reduce_scatter(self.reduce_group, into=out, op=op, stats=self.stats, async_op=True,
                                         comm=self.comm)
        self._pending = (work, source, out, accumulate, op == dist.ReduceOp.AVG, post_divide)

    def _all_reduce_into(self, out: torch.Tensor, op: dist.ReduceOp) -> _OwnRangeOfAllReduce:
        """[Note: all-reduce instead of reduce-scatter]: one all-reduce of ``full``, this rank's
        range into ``out`` when waited on."""
        full = self.full.full
        if op == dist.ReduceOp.AVG:
            with torch.no_grad():
                full.div_(dist.get_world_size(self.reduce_group))
        self.stats.all_reduce_bytes += full.numel() * full.element_size()
        self.stats.all_reduces += 1
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)
        return _OwnRangeOfAllReduce(work, full, out, self.rank * self.plan.shard_size)

    def finish(self, params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        """Wait for the reduce-scatter; give each ``(index, sharded param)`` its ``.grad``."""
        if self._pending is None:
            return
        work, source, out, accumulate, average, post_divide = self._pending
        self._pending = None
        work.wait()
        source.free()
        with torch.no_grad():  # [Note: what runs after the reduce-scatter]
            if self.replicate_group is not None:  # [Note: HSDP]
                if not self.requires_all_reduce:
                    self._partial = out.clone() if self._partial is None else self._partial.add_(out)
                    return
                if self._partial is not None:
                    out.add_(self._partial)
                    self._partial = None
                all_reduce(out, self.replicate_group, average, self.stats)
            if self.all_reduce_hook is not None:
                self._run_hook(out)
            if post_divide is not None and post_divide != 1:
                out.div_(post_divide)
        if self.host_copies is not None:
            out = self._to_host(out, accumulate)
        shard = out if out is self.sharded.live else self.sharded.allocate(zero=accumulate)
        with torch.no_grad():
            if out is not shard:
                if accumulate:
                    for i, sp in params:
                        if sp.grad is None:
                            self.sharded.view_of(shard, i).zero_()
                    self._accumulate(shard, out, params)
                else:
                    shard.copy_(out)  # one cast per group
            for i, sp in params:
                if sp.grad is None:
                    sp.grad = like_param(self.sharded.view_of(shard, i), sp)
        for hook in self.post_finish_hooks:
            hook()

    def _run_hook(self, reduced: torch.Tensor) -> None:
        stream = self.all_reduce_hook_stream
        if stream is None:
            self.all_reduce_hook(reduced)
            return
        current = torch.accelerator.current_stream(reduced.device)
        stream.wait_stream(current)
        with stream:
            self.all_reduce_hook(reduced)
        current.wait_stream(stream)

    def _to_host(self, reduced: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """An offloaded group's reduced shard (on the device) in host memory, cast to the shard
        dtype on the device first: copied straight into the host shard, without waiting
        (offload [Note: host copies and their streams]), when it replaces the gradients; into
        a host staging tensor, waited for, when it is added to them."""
        copies = self.host_copies
        with torch.no_grad():
            reduced = reduced.to(self.shard_dtype)
            if not accumulate:
                shard = self.sharded.allocate()
                copies.to_host(shard, reduced)
                return shard
            staged = copies.offload.empty(reduced.numel(), self.shard_dtype, self.full.device)
            copies.to_host(staged, reduced, wait=True)
            return staged

    def _accumulate(self, shard: torch.Tensor, reduced: torch.Tensor,
                    params: Sequence[Tuple[int, nn.Parameter]]) -> None:
        views = [(i, sp, self.sharded.view_of(shard, i)) for i, sp in params]
        if all(sp.grad is None or local_piece(sp.grad).data_ptr() == view.data_ptr() for _, sp, view in views):
            shard.add_(reduced)  # one add per group
            return
        slices = self.plan.local_slices(self.rank)
        for i, sp, view in views:  # a user replaced some .grad: add piece by piece
            start, end, off = slices[i]
            target = local_piece(sp.grad) if sp.grad is not None else view
            target.add_(reduced.narrow(0, off, end - start))

    def zero(self) -> None:
        """Drop what the reducer holds: an unfinished reduce-scatter's input, the gradients
        accumulated without sync, and the sharded gradient (persistent views see it zeroed;
        grad_shard [Note: a kept gradient stays the caller's]). The unsharded ``.grad`` are the
        caller's."""
        if self._pending is not None:
            work = self._pending[0]
            work.wait()
            self._pending = None
        self.full.free()
        self._holds_accumulated = False
        self.sharded.forget()  # Megatron's main_grad: zeroed; a kept .grad: left to its holder
