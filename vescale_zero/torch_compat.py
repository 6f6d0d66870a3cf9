"""Every torch internal that vescale-zero leans on, in one place (torch 2.11 to 2.15).

[Note: one door to torch internals]
torch's private modules (``torch.distributed.tensor._*``, ``torch.utils._*``, ``torch._C._*``,
DCP's underscored helpers, ``torch.testing._internal``) change between releases without notice.
The package, its integrations, benchmarks and examples import them from this module only, never
from torch directly, and nothing outside this module reads ``torch.__version__``: where releases
differ, the difference is handled here once, by feature detection (what the installed torch has;
no version check is needed so far). ``tests/test_torch_compat.py`` fails on a private torch name
anywhere else (the tests themselves may reach internals: they are not shipped). The ``torch._foreach_*``
and ``torch._amp_*`` kernels that optimizers call are aten operators with stable schemas, not
Python internals: they are called directly. A ``DTensor``'s ``_local_tensor`` / ``_spec`` are
read where ``RaggedDTensor`` (a DTensor subclass) needs them. The releases supported are the
ones CI tests (README, "Install and run the tests"); setup.py states the same range.

What differs across the supported releases, and how it is handled:

* ``Placement`` is a pybind11 C++ class. On 2.11 its metaclass insists that a Python subclass
  call ``Placement.__init__``, which a dataclass's generated ``__init__`` does not (``TypeError:
  ... Placement.__init__() must be called when overriding __init__``); 2.12+ do not check.
  :func:`init_placement_base` calls it, which is right on every release.
* DTensor's C++ dispatch fast path: on 2.11 it takes every ``DTensor`` instance, subclasses
  included, so a subclass's own ``__torch_dispatch__`` is never called (an op on a
  ``RaggedDTensor`` would run DTensor's sharding propagation and return a plain ``DTensor``);
  2.12+ leave subclasses that override ``__torch_dispatch__`` to it. Where a probe shows the
  override is skipped, :func:`honour_torch_dispatch` answers the per-op lookup that 2.11's
  dispatcher makes *before* its fast path (``torch.library.register_torch_dispatch``'s
  registry) with the class's own ``__torch_dispatch__``, for the classes named to it only.
* The single-tensor collectives: 2.13 and 2.14 deprecate ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` (a FutureWarning per call) for ``all_gather_single`` /
  ``reduce_scatter_single``, which 2.11 and 2.12 do not have; 2.15 has both, neither deprecated.
  :data:`all_gather_single` / :data:`reduce_scatter_single` are the new names where they exist.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch.distributed import _state_dict_utils as state_dict_utils
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._ops._math_ops import _NormPartial as NormPartial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement
from torch.optim.optimizer import _foreach_supported_types as optim_foreach_supported_types
from torch.utils._foreach_utils import _foreach_supported_types as utils_foreach_supported_types
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "DTensorSpec", "TensorMeta", "NormPartial", "Placement", "init_placement_base", "honour_torch_dispatch",
    "dispatch_rule_lookup_needed", "rule_lookups_answered",
    "optim_foreach_supported_types", "utils_foreach_supported_types", "TorchDispatchMode",
    "tree_flatten", "tree_map", "tree_unflatten", "autograd_graph_task_id", "queue_backward_callback",
    "engine_will_execute",
    "read_dcp_state_dict", "init_fake_process_group", "compile_counter", "work_class", "all_gather_single",
    "reduce_scatter_single", "dtensor_api", "state_dict_utils", "local_shape_and_global_offset",
    "process_group_timeout", "set_process_group_timeout", "collect_sanitizer_reports", "shard_placement_result",
]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def init_placement_base(placement: Placement) -> None:
    """Construct the C++ ``Placement`` base of a Python placement (call it from the subclass's
    ``__init__`` or dataclass ``__post_init__``)."""
    Placement.__init__(placement)


class _Reached(Exception):
    pass


class _DispatchProbe(DTensor):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise _Reached


@functools.lru_cache(maxsize=None)
def _subclass_dispatch_honoured() -> bool:
    """Whether an op on a DTensor subclass reaches the subclass's ``__torch_dispatch__`` (2.12+),
    rather than DTensor's C++ fast path (2.11, which fails here on the probe's missing spec)."""
    probe = torch.Tensor._make_wrapper_subclass(_DispatchProbe, (1,), dtype=torch.float32, device="cpu")
    try:
        torch.ops.aten.alias.default(probe)
    except _Reached:
        return True
    except Exception:  # noqa: BLE001 - the fast path took it
        return False
    return False


_HONOURED: Set[type] = set()


def honour_torch_dispatch(cls: type) -> None:
    """Make every op on instances of the DTensor subclass ``cls`` run ``cls.__torch_dispatch__``
    ([Note: one door to torch internals], DTensor's C++ dispatch fast path): where the probe shows
    the fast path skips it, ``vescale_zero.host_patches.install("torch")`` (at ``import
    vescale_zero``) answers the rule lookup for the classes named here (:func:`rule_lookups_answered`)."""
    _HONOURED.add(cls)


def dispatch_rule_lookup_needed() -> bool:
    """Whether a class named to :func:`honour_torch_dispatch` needs the rule lookup answered (2.11)."""
    return bool(_HONOURED) and not _subclass_dispatch_honoured()


# host patch torch._library.simple_registry.GenericTorchDispatchRuleHolder.find: checked against torch 2.11.0-2.15.0
def rule_lookups_answered(registered: Callable[..., Any]) -> Callable[..., Any]:
    """``GenericTorchDispatchRuleHolder.find`` (``registered``) that answers, for the classes named
    to :func:`honour_torch_dispatch` without a registered rule, with their own ``__torch_dispatch__``."""

    def find(self: Any, torch_dispatch_class: type) -> Optional[Callable[..., Any]]:
        rule = registered(self, torch_dispatch_class)
        if rule is None and torch_dispatch_class in _HONOURED:
            return torch_dispatch_class.__torch_dispatch__.__func__
        return rule

    return find


def autograd_graph_task_id() -> int:
    """The id of the backward the autograd engine runs on this thread, ``-1`` outside backward."""
    return torch._C._current_graph_task_id()


def engine_will_execute(node: Any) -> bool:
    """Whether the backward the autograd engine runs on this thread will run ``node`` (a
    ``grad_fn``): it is reached from what is differentiated. False outside backward."""
    return autograd_graph_task_id() != -1 and bool(torch._C._will_engine_execute_node(node))


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd engine finishes the current backward."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def read_dcp_state_dict(state: Dict[str, Any], storage_reader: Any) -> None:
    """Fill ``state`` with every entry of a DCP checkpoint, whole, in this process, with no process
    group (what torch's ``dcp_to_torch_save`` does)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A default process group that pretends to ``world_size`` ranks and moves no data (torch's
    fake backend): for measuring one rank's memory at any world size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def compile_counter(backend: str) -> Any:
    """A ``torch.compile`` backend that counts the graphs (``frame_count``) and hands them to ``backend``."""
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend(backend)


def work_class() -> type:
    """The class of the handles that async collectives return."""
    return torch._C._distributed_c10d.Work


def local_shape_and_global_offset(shape: Sequence[int], mesh: Any, placements: Sequence[Any]
                                  ) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """This rank's local shape and its offset in the global tensor of ``shape`` laid out by
    ``placements`` (torch's own placements) on ``mesh``."""
    local, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, list(placements))
    return tuple(local), tuple(offset)


def process_group_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """The timeout ``group``'s collectives were made with; ``None`` where its backend does not say."""
    for device in getattr(group, "_device_types", ()):
        timeout = getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def set_process_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Give ``group``'s collectives ``timeout`` from now on."""
    _set_pg_timeout(timeout, group)


def collect_sanitizer_reports(into: List[Exception]) -> None:
    """Make torch's CUDA sanitizer (on in this process: ``TORCH_CUDA_SANITIZER=1`` at ``import
    torch``) append every report to ``into`` instead of raising the first: its event handler's
    kernel-launch check is wrapped (``torch.cuda._sanitizer``)."""
    import torch.cuda._sanitizer as csan

    if not csan.cuda_sanitizer.enabled:
        raise RuntimeError("the CUDA sanitizer is off in this process: start it with TORCH_CUDA_SANITIZER=1")
    handler = csan.cuda_sanitizer.dispatch.event_handler
    launch = handler._handle_kernel_launch

    def noting(*args: Any, **kwargs: Any) -> list:  # count every report; raise none, so the steps run to the end
        into.extend(launch(*args, **kwargs))
        return []

    # host patch torch.cuda._sanitizer.EventHandler._handle_kernel_launch: checked against torch 2.11.0-2.15.0
    handler._handle_kernel_launch = noting  # on this instance only


def shard_placement_result(result: Any) -> Tuple[Any, Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """``(placement, shard group, replicate group)`` of what an FSDP2 ``shard_placement_fn``
    returned: a placement (groups ``None``: the ``fully_shard`` mesh's), or FSDP2's
    ``ShardPlacementResult`` (``torch.distributed.fsdp._fully_shard._fsdp_common``, 2.12+: a
    placement and a mesh info whose ``shard_process_group`` / ``replicate_process_group`` name
    the parameter's own groups)."""
    info = getattr(result, "mesh_info", None)
    if not hasattr(result, "placement") or isinstance(result, Placement):
        return result, None, None
    if info is None:
        return result.placement, None, None
    return result.placement, getattr(info, "shard_process_group", None), getattr(info, "replicate_process_group", None)
