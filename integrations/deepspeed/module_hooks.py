"""``optimizer.parameter_offload`` under ``"stage": "ragged"``: the handle on the module hooks that
code written for ZeRO-3 pauses around generation.

[Note: pausing the hooks for generation]
Under ZeRO-3 a model's parameters are gathered by hooks on every module, held by the ZeRO-3
optimizer's ``parameter_offload``. Generation runs one forward per token, so TRL's
``unwrap_model_for_generation`` (trl 1.16) gathers every parameter once
(``GatheredParameters(model.parameters())``), removes the hooks (``remove_hooks``: clears each
parameter's ``ds_active_sub_modules``, calls ``.remove()`` on ``forward_hooks`` and
``backward_hooks``), generates, and re-adds them (``add_hooks``:
``_register_deepspeed_module(module)``). "ragged" reports stage 3, so TRL takes that path.
Ours keeps no hook state per parameter (``module`` below lists none); the one "forward hook"
is the whole model's: removing it holds the full parameters (one all-gather per group, the
hooks paused: vescale_zero.runtime [Note: full parameters held]) and re-registering releases
them, so generation gathers nothing per token.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

from torch import nn

__all__ = ["RaggedModuleHooks"]


class _WholeModelHook:
    """The removable handle of the model's hooks: removing it holds the full parameters."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def remove(self) -> None:
        self._module.hold_full_parameters()


class _NoParameterHookState:
    """ZeRO-3's per-parameter hook state, of which ragged sharding has none."""

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Tuple[str, Any]]:
        return iter(())

    def ds_external_parameters(self) -> List[Tuple[str, Any]]:
        return []


class RaggedModuleHooks:
    """What ``DeepSpeedZeRoOffload`` is to callers that pause ZeRO-3's hooks
    ([Note: pausing the hooks for generation])."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self.module = _NoParameterHookState()
        self.forward_hooks: List[_WholeModelHook] = [_WholeModelHook(module)]
        self.backward_hooks: List[Any] = []

    def _register_deepspeed_module(self, _module: Any = None, count: Any = None) -> None:
        """The hooks come back: the full parameters are released (no-op if they were not held)."""
        self._module.release_full_parameters()
        self.forward_hooks = [_WholeModelHook(self._module)]
