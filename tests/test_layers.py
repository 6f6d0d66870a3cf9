"""The package's layers and its two front doors, read from the imports (no spawn, under a second).

* Each layer of ``vescale_zero/`` imports only the layers below it (``docs/design.md``, the code's
  layers): primitives (1) <- runtime (2) <- api (3) <- optim, checkpoint (4) <- tools (5);
  ``torch_compat``, ``host_patches`` and ``testing`` may be imported by any layer, ``hosts`` by the
  adapters only; tools (the CLI, the GPU check) may reach the adapters.
* The adapters (``integrations/``, installed as ``vescale_zero.integrations``) enter the core through
  the public API (``vescale_zero``'s ``__all__``, ``vescale_zero.optim``, ``vescale_zero.checkpoint``)
  and ``vescale_zero/hosts.py``, plus ``torch_compat`` and the registry of host patches; never another
  core module (``vescale_zero/hosts.py`` says what it offers and why).

Function-level imports count as much as module-level ones. Each check is seen red on planted lines.
"""

from __future__ import annotations

import ast
import os
import textwrap
from typing import Iterator, List, Tuple

import vescale_zero

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {"primitives": 1, "runtime": 2, "api": 3, "optim": 4, "checkpoint": 4, "tools": 5}
ANY_LAYER = {"torch_compat", "host_patches", "testing"}
DOORS = {"hosts", "optim", "checkpoint", "torch_compat", "host_patches", "integrations"}
"""What an adapter may import of ``vescale_zero`` besides the names of its ``__all__``."""


def _module_name(path: str) -> Tuple[str, str]:
    """``(module, package)`` of a file under the repository (integrations/ is vescale_zero.integrations)."""
    dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    if dotted.startswith("integrations"):
        dotted = "vescale_zero." + dotted
    if dotted.endswith(".__init__"):
        dotted = dotted[: -len(".__init__")]
        return dotted, dotted
    return dotted, dotted.rpartition(".")[0]


def _imports(source: str, package: str) -> Iterator[Tuple[int, str]]:
    """``(line, dotted name)`` of everything ``source`` imports, relative imports resolved
    against ``package``; ``from m import x`` gives ``m.x``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([module] if module else []))
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _files(top: str) -> List[str]:
    out = []
    for folder, _, names in os.walk(os.path.join(ROOT, top)):
        out += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return out


def _layer_problems(source: str, module: str, package: str) -> List[str]:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return []
    own = LAYERS[parts[1]]
    problems = []
    for line, name in _imports(source, package):
        target = name.split(".")
        if target[0] != "vescale_zero" or len(target) < 2 or target[1] in ANY_LAYER:
            continue
        layer = target[1]
        if layer == "integrations" and parts[1] == "tools":
            continue  # the CLI and the GPU check reach the adapters (lazily)
        if layer in ("hosts", "integrations") or LAYERS.get(layer, 0) > own:
            problems.append(f"{line}: {name} (layer {parts[1]} imports {layer})")
    return problems


def _adapter_problems(source: str, package: str) -> List[str]:
    public = set(vescale_zero.__all__)
    problems = []
    for line, name in _imports(source, package):
        target = name.split(".")
        if target[0] != "vescale_zero":
            continue
        if len(target) == 1 or (len(target) == 2 and target[1] in public) or target[1] in DOORS:
            continue
        problems.append(f"{line}: {name}")
    return problems


def test_each_layer_imports_only_the_layers_below():
    planted = textwrap.dedent("""
        from ..api.fully_shard import fully_shard
        from .. import hosts
        def f():
            from vescale_zero.tools import cli
        from ..primitives.planner import plan
        from ..torch_compat import tree_map
    """)
    assert len(_layer_problems(planted, "vescale_zero.runtime.x", "vescale_zero.runtime")) == 3
    problems = []
    for path in _files("vescale_zero"):
        module, package = _module_name(path)
        with open(path, encoding="utf-8") as f:
            problems += [f"{os.path.relpath(path, ROOT)}:{p}" for p in _layer_problems(f.read(), module, package)]
    assert not problems, "an import against the layers (docs/design.md, the code's layers):\n" + "\n".join(problems)


def test_adapters_enter_the_core_only_through_its_front_doors():
    planted = textwrap.dedent("""
        import vescale_zero as vz
        from vescale_zero import fully_shard, hosts
        from vescale_zero.hosts import groups_of
        from vescale_zero.runtime.param_group import ParamGroup
        from vescale_zero import runtime
        import vescale_zero.api.fully_shard
        from ...primitives import placement
        from ..loss_scaling import LossScaler
        from .engine import RaggedEngineMixin
    """)
    found = _adapter_problems(planted, "vescale_zero.integrations.deepspeed")
    assert len(found) == 4, found
    problems = []
    for path in _files("integrations"):
        _, package = _module_name(path)
        with open(path, encoding="utf-8") as f:
            problems += [f"{os.path.relpath(path, ROOT)}:{p}" for p in _adapter_problems(f.read(), package)]
    assert not problems, ("an adapter imports a core module: use the public API or vescale_zero/hosts.py (add the "
                          "name there, with its line in the table):\n" + "\n".join(problems))
