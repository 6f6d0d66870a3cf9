"""The registry of host patches (vescale_zero/host_patches.py [Note: host patches]): the host
functions still have the signatures the patches were written for; every entry names its site
with the version it was checked against; nothing else in the package or the adapters assigns to
a host module or class, overrides a private host method or imports a private host name without
an entry; and ``uninstall`` puts every original back."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Dict, List, Set

import pytest

from vescale_zero.host_patches import HOST_PATCHES, HOST_VERSIONS, INSTALLED_KINDS, KINDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = re.compile(r"#\s*host patch (\S+): checked against (\S+) (\S+)")

# Run in a fresh interpreter that imports the hosts only: in this process an adapter may have
# patched them already. Prints {path: signature | "missing: <why>" | "not callable"} and the
# installed versions.
_PROBE = r"""
import importlib, importlib.metadata, inspect, json, os, re, sys, typing
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if not hasattr(typing, "override"):  # Python 3.11: megatron-core 0.18+'s megatron.training imports 3.12's name
    import typing_extensions
    typing.override = typing_extensions.override
paths, hosts = json.loads(sys.argv[1]), json.loads(sys.argv[2])

def resolve(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError as e:
            error = e
    else:
        raise error
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj

out = {}
for path in paths:
    try:
        obj = resolve(path)
    except (ImportError, AttributeError) as e:
        out[path] = f"missing: {type(e).__name__}: {e}"
        continue
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        out[path] = "not callable"
        continue
    empty = inspect.Parameter.empty
    text = str(sig.replace(parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
                           return_annotation=empty))
    out[path] = re.sub(r" at 0x[0-9a-f]+>", ">", text)  # a function default: without its address
versions = {}
for host in hosts:
    try:
        versions[host] = importlib.metadata.version(host)
    except importlib.metadata.PackageNotFoundError:
        versions[host] = None
try:  # Megatron-LM: megatron-core's wheel carries it from 0.17 on (not a distribution of its own)
    importlib.import_module("megatron.training.training")
    versions["Megatron-LM"] = versions.get("megatron-core")
except ImportError:
    pass
print(json.dumps({"found": out, "versions": versions}))
"""


def _probe() -> dict:
    paths = sorted({p.signature_of for p in HOST_PATCHES.values()})
    run = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(paths), json.dumps(sorted(HOST_VERSIONS))],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


HOST_PATCHES_HOSTS = {p.host for p in HOST_PATCHES.values()}


def test_patched_host_functions_keep_the_signatures_the_patches_were_written_for():
    """For every entry whose host is installed: the function the patch relies on exists and,
    where a signature is recorded, has it (names, kinds, defaults). Hosts not installed here are
    not checked: CI runs this test in every venv of its host matrix (the oldest and the newest
    release of each host, and the releases between: .ci/run), each with its own hosts."""
    probe = _probe()
    found, versions = probe["found"], probe["versions"]
    problems, checked = [], {}
    for patch in HOST_PATCHES.values():
        installed = versions.get(patch.host)
        got = found[patch.signature_of]
        if got.startswith("missing") and (installed is None or (patch.optional and patch.host == "Megatron-LM")):
            continue  # not installed here; or a Megatron-LM name that this release does not have
        where = (f"{patch.patched} (relies on {patch.signature_of}; patch checked against {patch.host} "
                 f"{HOST_VERSIONS[patch.host]}, installed {patch.host} {installed})")
        if got.startswith("missing"):
            problems.append(f"{where}: gone from the host ({got})")
        elif patch.signature is not None and got not in patch.signature.split(" | "):
            problems.append(f"{where}: signature changed\n    expected {patch.signature}\n    found    {got}")
        checked[patch.host] = checked.get(patch.host, 0) + 1
    assert not problems, ("host functions patched by vescale_zero.integrations changed; re-read each patch against "
                          "the installed version, then update vescale_zero/host_patches.py and the patch site:\n"
                          + "\n".join(problems))
    installed = {host for host, version in versions.items() if version is not None and host in HOST_PATCHES_HOSTS}
    assert installed and installed <= set(checked), (checked, versions)  # every host installed here was checked


def test_every_patch_site_names_its_registry_entry_and_version():
    """Each ``# host patch KEY: checked against HOST VERSION`` line under integrations/ or
    vescale_zero/ names an entry of HOST_PATCHES and its host's version there; every entry has
    such a line."""
    seen, problems = set(), []
    walks = [os.walk(os.path.join(ROOT, top)) for top in ("integrations", "vescale_zero")]
    for folder, _, files in (entry for walk in walks for entry in walk):
        for name in files:
            if not name.endswith(".py") or name == "host_patches.py":
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = SITE.search(line)
                    if m is None:
                        continue
                    key, host, version = m.groups()
                    entry = HOST_PATCHES.get(key)
                    where = f"{os.path.relpath(path, ROOT)}:{number}"
                    if entry is None:
                        problems.append(f"{where}: {key} is not in HOST_PATCHES")
                    elif (host, version) != (entry.host, HOST_VERSIONS[entry.host]):
                        problems.append(f"{where}: says {host} {version}, HOST_PATCHES {entry.host} "
                                        f"{HOST_VERSIONS[entry.host]}")
                    seen.add(key)
    missing = sorted(set(HOST_PATCHES) - seen)
    assert not problems and not missing, "\n".join(problems + [f"no patch site names {k}" for k in missing])


# ---- nothing else changes a host: the tree parsed ----------------------------------------------------------------

HOSTS = ("torch", "deepspeed", "accelerate", "transformers", "megatron", "trl", "peft")
SHIPPED = ("vescale_zero", "integrations")  # the package and its adapters (tests may patch freely)
REGISTRY = os.path.join("vescale_zero", "host_patches.py")
DOOR = "torch_compat"  # what it exports is torch's (modules among them): names bound to it are host names


def _is_host(module: str) -> bool:
    return module.split(".")[0] in HOSTS


def _host_names(tree: ast.AST) -> Set[str]:
    """Names bound to a host's module, class or function in one file: imported from a host (or
    from torch_compat), got by ``importlib.import_module`` / ``sys.modules`` (any name but a literal
    of ours), an attribute of such a name, or a loop variable over them."""
    bound: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if _is_host(a.name)}
        elif isinstance(node, ast.ImportFrom) and (_is_host(node.module or "") if node.level == 0
                                                   else (node.module or "").endswith(DOOR)):
            bound |= {a.asname or a.name for a in node.names}
    for _ in range(3):  # aliases of aliases
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _holds_host(node.value, bound):
                    bound |= {n.id for t in targets for n in _plain_names(t)}
            elif isinstance(node, ast.For) and _holds_host(node.iter, bound):
                bound |= {n.id for n in _plain_names(node.target)}
    return bound


def _plain_names(target: ast.AST) -> List[ast.Name]:
    """The names a target binds (``a``, ``a, b``), not ``self`` of ``self.x``."""
    if isinstance(target, ast.Name):
        return [target]
    return [n for e in getattr(target, "elts", ()) for n in _plain_names(e)]


def _holds_host(value: ast.AST, bound: Set[str]) -> bool:
    text = ast.unparse(value)
    if "import_module(" in text or "sys.modules" in text or "__import__(" in text:
        literals = [c.value for c in ast.walk(value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        return not literals or not all(x.startswith("vescale_zero") for x in literals)
    if isinstance(value, (ast.Tuple, ast.List)):
        return any(_root(e) in bound for e in value.elts)
    return isinstance(value, ast.Attribute) and _root(value) in bound  # holder = simple_registry.Holder


def _root(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _host_assignments(source: str) -> List[str]:
    """``line: statement`` of every assignment (or deletion) of a host object's attribute or item,
    every code rewrite (``__code__``, a function's ``__globals__``), and every ``setattr`` /
    ``delattr`` on a host object, in ``source``; but an assignment on a host *instance* right
    below the marker of its ``instance`` entry."""
    tree = ast.parse(source)
    lines = source.splitlines()
    bound = _host_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _root(node.args[0]) in bound:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                code = isinstance(t, ast.Attribute) and t.attr == "__code__"
                namespace = isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) \
                    and t.value.attr == "__globals__"
                if code or namespace or (isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in bound):
                    marker = SITE.search(lines[node.lineno - 2]) if node.lineno > 1 else None
                    entry = HOST_PATCHES.get(marker.group(1)) if marker else None
                    if entry is None or entry.kind != "instance":
                        found.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def _shipped_files() -> List[str]:
    out = []
    for top in SHIPPED:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return [f for f in out if os.path.relpath(f, ROOT) != REGISTRY]


def test_nothing_but_the_registry_assigns_to_a_host():
    """Parsing vescale_zero/ and integrations/ (not the registry itself): no assignment to a host
    module's or class's attribute, no code rewrite, no ``setattr`` on a host object. The scan
    sees the forms it looks for (checked on planted lines first)."""
    planted = textwrap.dedent("""
        import deepspeed
        import importlib
        import sys
        from deepspeed.runtime.engine import DeepSpeedEngine
        from ..torch_compat import dtensor_api as _api
        deepspeed.initialize = None
        DeepSpeedEngine._take_model_step = None
        setattr(DeepSpeedEngine, "_backward_prologue", None)
        _api.distribute_tensor = None
        def f(fn, name):
            fn.__code__ = f.__code__
            mod = importlib.import_module(name)
            mod.x = 1
            for m in list(sys.modules.values()):
                m.unwrap_model = None
            holder = deepspeed.runtime.Holder
            holder.find = None
    """)
    assert len(_host_assignments(planted)) == 8, _host_assignments(planted)
    problems = []
    for path in _shipped_files():
        with open(path, encoding="utf-8") as f:
            problems += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _host_assignments(f.read())]
    assert not problems, ("a host module or class is changed outside vescale_zero/host_patches.py: declare the change "
                          "in HOST_PATCHES (its replacement stays beside its adapter, named by `by`) and let "
                          "install() apply it ([Note: host patches]):\n" + "\n".join(problems))


def _classes_and_imports(path: str):
    """``(classes, private host imports)`` of one file: each class with its base names and the
    host modules they were imported from, and its private methods; each ``from HOST import _x``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    origin: Dict[str, str] = {}
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_host(node.module or ""):
            for a in node.names:
                origin[a.asname or a.name] = f"{node.module}.{a.name}"
                if a.name.startswith("_") and node.module.split(".")[0] != "torch":  # torch's: torch_compat's
                    private.append((node.lineno, f"{node.module}.{a.name}"))
    classes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b) for b in node.bases]
            methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            methods |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                        if isinstance(t, ast.Name)}
            classes.append((node.name, bases, {m for m in methods if m.startswith("_") and not m.startswith("__")},
                            origin))
    return classes, private


def _host_class(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_private_host_methods_overridden_and_private_host_names_imported_are_declared():
    """Every private method of a host class that a class of ours overrides (directly, or in a
    mixin that a class of ours combines with a host class) and every private name imported from
    a host other than torch (torch's internals go through torch_compat) has its entry in
    HOST_PATCHES (kind ``override`` / ``import``)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    declared = {k for k, p in HOST_PATCHES.items() if p.kind in ("override", "import")}
    ours: Dict[str, Set[str]] = {}  # our class -> its private methods
    host_bases: Dict[str, List[str]] = {}  # our class -> the host classes it (or a class combining it) derives from
    combined: Dict[str, List[str]] = {}  # our class -> our classes among its bases
    problems, checked = [], 0
    for path in _shipped_files():
        classes, private = _classes_and_imports(path)
        for line, name in private:
            if name not in declared:
                problems.append(f"{os.path.relpath(path, ROOT)}:{line}: imports the private host name {name}")
        for name, bases, methods, origin in classes:
            ours.setdefault(name, set()).update(methods)
            hosts = [origin[b] for b in bases if b in origin]
            host_bases.setdefault(name, []).extend(hosts)
            combined.setdefault(name, []).extend(b for b in bases if b not in origin)
    for name, hosts in list(host_bases.items()):  # a mixin combined with a host class overrides it too
        for mixin in combined.get(name, []):
            if hosts and mixin in ours:
                host_bases.setdefault(mixin, []).extend(hosts)
    for name, hosts in host_bases.items():
        for dotted in set(hosts):
            host = _host_class(dotted)
            for method in sorted(ours.get(name, ())):
                definer = next((c for c in host.__mro__ if method in vars(c)), None)
                if definer is None:
                    continue  # ours alone
                checked += 1
                key = f"{definer.__module__}.{definer.__qualname__}.{method}"
                if key not in declared:
                    problems.append(f"{name}.{method} overrides the private host method {key}")
    assert not problems, ("declare these in vescale_zero/host_patches.py HOST_PATCHES (kind override / import, with "
                          "the signature relied on) and mark the site ([Note: host patches]):\n" + "\n".join(problems))
    assert checked >= 9, checked  # the ragged engines' overrides of DeepSpeedEngine, at least


# ---- uninstall restores every original ----------------------------------------------------------------------------

# In a fresh interpreter: every host loaded first (Megatron-LM, not installable here, as a bare stand-in), the
# originals noted, every patch set installed as users install them, then uninstalled. Prints the problems found.
_ROUND_TRIP = r"""
import importlib, json, os, sys, types
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import accelerate, deepspeed, transformers.modeling_utils, megatron.core.utils, torch.optim
from deepspeed.runtime.zero import partition_parameters  # noqa: F401

training = types.ModuleType("megatron.training.training")
checkpointing = types.ModuleType("megatron.training.checkpointing")
package = types.ModuleType("megatron.training")
for module, names in ((training, ("get_megatron_muon_optimizer", "get_model", "to_empty_if_meta_device",
                                  "calc_params_l2_norm", "save_checkpoint", "load_checkpoint")),
                      (checkpointing, ("save_checkpoint", "load_checkpoint"))):
    for name in names:
        setattr(module, name, lambda *a, **k: None)
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.utils import check_param_hashes_across_dp_replicas, unwrap_model
training.DDP, training.get_megatron_optimizer = DistributedDataParallel, get_megatron_optimizer
training.check_param_hashes_across_dp_replicas = check_param_hashes_across_dp_replicas
training.unwrap_model = unwrap_model
package.training, package.checkpointing, package.get_args = training, checkpointing, lambda: None
sys.modules.update({"megatron.training": package, "megatron.training.training": training,
                    "megatron.training.checkpointing": checkpointing})

# the registry's entries, read before `import vescale_zero` (which installs torch's): its file alone
import importlib.util
spec = importlib.util.spec_from_file_location("registry", os.path.join("vescale_zero", "host_patches.py"))
registry = sys.modules["registry"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(registry)

MISSING = object()
def owner_of(patch):
    path, _, attr = patch.patched.rpartition(".")
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in sys.modules:
            obj = sys.modules[".".join(parts[:i])]
            break
    else:
        return None, attr  # a host not installed here (its entry's `when` does not hold)
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj, attr
def raw(patch):
    owner, attr = owner_of(patch)
    if owner is None:
        return MISSING, None
    value = owner.__dict__.get(attr, MISSING) if isinstance(owner, type) else getattr(owner, attr, MISSING)
    return value, getattr(value, "__code__", None)
entries = [p for p in registry.HOST_PATCHES.values() if p.kind in registry.INSTALLED_KINDS]
before = {p.patched: raw(p) for p in entries}
holders = [m for m in list(sys.modules.values()) if getattr(m, "unwrap_model", None) is unwrap_model]

import vescale_zero  # install("torch")
from vescale_zero import host_patches as hp
import vescale_zero.integrations.deepspeed  # deepspeed, deepspeed.zero_to_fp32, accelerate
from vescale_zero.integrations.megatron import use_vescale_fsdp_in_megatron_lm
hp.install("torch.optim"); hp.install("transformers")
use_vescale_fsdp_in_megatron_lm(get_args=lambda: None)
installed = hp.installed()
problems = []
changed = [k for k in installed if raw(hp.HOST_PATCHES[k]) == before[k]]
problems += [f"installed but unchanged: {k}" for k in changed]
skipped = sorted(p.patched for p in entries if p.patched not in installed)
for s in sorted({p.installed_by for p in entries}):
    hp.uninstall(s)
problems += [f"left installed: {k}" for k in hp.installed()]
for p in entries:
    now, code = raw(p)
    if now is not before[p.patched][0] or code is not before[p.patched][1]:
        problems.append(f"not restored: {p.patched}")
problems += [f"unwrap_model not restored in {m.__name__}" for m in holders if m.unwrap_model is not unwrap_model]
print(json.dumps({"problems": problems, "installed": len(installed), "skipped": skipped}))
"""


def test_uninstall_restores_every_original():
    """Every entry install() applies is in place after the users' switches (``import vescale_zero``,
    the DeepSpeed import, the first fully_shard's set, transformers', ``use_vescale_fsdp_in_megatron_lm``)
    and, after ``uninstall`` of every patch set, each host attribute is its original object again
    (a routed function its original code; ``unwrap_model`` in every module that held it); only
    entries whose ``when`` does not hold here are skipped."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-c", _ROUND_TRIP], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not result["problems"], "\n".join(result["problems"])
    conditional = {k for k, p in HOST_PATCHES.items() if p.when is not None}
    assert set(result["skipped"]) <= conditional, result["skipped"]
    assert result["installed"] == sum(p.kind in INSTALLED_KINDS for p in HOST_PATCHES.values()) - len(
        result["skipped"]), result


def test_every_entry_is_well_formed():
    """Each entry's kind is known, its host has a version, and what ``by`` names exists (its
    module imported where its host is installed)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("megatron.core")
    problems = []
    for key, patch in HOST_PATCHES.items():
        if patch.kind not in KINDS or patch.host not in HOST_VERSIONS:
            problems.append(f"{key}: kind {patch.kind!r}, host {patch.host!r}")
            continue
        module, _, name = patch.by.partition(":")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{key}: by {patch.by!r}: {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)
