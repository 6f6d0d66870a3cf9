"""torch's internals are reached through ``vescale_zero.torch_compat`` only
(vescale_zero/torch_compat.py [Note: one door to torch internals])."""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ("vescale_zero", "integrations", "benchmarks", "examples")
DOOR = os.path.join("vescale_zero", "torch_compat.py")


def _dotted(node: ast.AST, names: Dict[str, str]) -> Optional[str]:
    """``torch.a.b`` for an attribute chain rooted at a name bound to a torch module or object."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    return ".".join([names[node.id]] + parts[::-1])


def _is_aten_op(dotted: str) -> bool:
    """``torch._foreach_mul_`` and the like: aten operators with stable schemas, called as ops."""
    parts = dotted.split(".")
    return len(parts) == 2 and hasattr(torch.ops.aten, parts[1])


def _private_uses(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names: Dict[str, str] = {}  # local name -> what it holds, for names bound to torch
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    if any(p.startswith("_") for p in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                names[alias.asname or alias.name] = dotted
                if any(p.startswith("_") for p in dotted.split(".")):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # the whole chain, once
            dotted = _dotted(node, names)
            if dotted is None:
                continue
            if dotted.endswith("__version__"):
                found.append(f"{node.lineno}: {dotted}")
            elif any(p.startswith("_") and not p.startswith("__") for p in dotted.split(".")) \
                    and not _is_aten_op(dotted):
                found.append(f"{node.lineno}: {dotted}")
    return found


def test_torch_internals_are_reached_through_torch_compat_only():
    """No private torch module, attribute or ``torch.__version__`` outside torch_compat.py in the
    package, its integrations, benchmarks and examples (aten ops such as ``torch._foreach_mul_``
    are allowed); the scan itself sees a private import (checked on torch_compat.py)."""
    assert _private_uses(os.path.join(ROOT, DOOR)), "the scan finds nothing in torch_compat.py: it is broken"
    problems = []
    for top in CHECKED:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                if name.endswith(".py") and rel != DOOR:
                    problems += [f"{rel}:{use}" for use in _private_uses(path)]
    assert not problems, ("torch internals used outside vescale_zero/torch_compat.py; import them from there "
                          "([Note: one door to torch internals]):\n" + "\n".join(problems))
