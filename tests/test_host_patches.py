"""The host functions the adapters patch still have the signatures the patches were written
for (vescale_zero/host_patches.py [Note: host patches]), and every patch site names its
entry there with the version it was checked against."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from vescale_zero.host_patches import HOST_PATCHES, HOST_VERSIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = re.compile(r"#\s*host patch (\S+): checked against (\S+) (\S+)")

# Run in a fresh interpreter that imports the hosts only: in this process an adapter may have
# patched them already. Prints {path: signature | "missing: <why>" | "not callable"} and the
# installed versions.
_PROBE = r"""
import importlib, importlib.metadata, inspect, json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
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
    out[path] = str(sig.replace(parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
                                return_annotation=empty))
versions = {}
for host in hosts:
    try:
        versions[host] = importlib.metadata.version(host)
    except importlib.metadata.PackageNotFoundError:
        versions[host] = None
print(json.dumps({"found": out, "versions": versions}))
"""


def _probe() -> dict:
    paths = sorted({p.signature_of for p in HOST_PATCHES.values()})
    run = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(paths), json.dumps(sorted(HOST_VERSIONS))],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_patched_host_functions_keep_the_signatures_the_patches_were_written_for():
    """For every entry whose host is installed: the function the patch relies on exists and,
    where a signature is recorded, has it (names, kinds, defaults). Hosts not installed here
    (Megatron-LM) are listed, not checked."""
    probe = _probe()
    found, versions = probe["found"], probe["versions"]
    problems, checked = [], 0
    for patch in HOST_PATCHES.values():
        installed = versions.get(patch.host)
        got = found[patch.signature_of]
        if installed is None and got.startswith("missing"):
            continue  # not installable here: see HOST_VERSIONS
        where = (f"{patch.patched} (relies on {patch.signature_of}; patch checked against {patch.host} "
                 f"{HOST_VERSIONS[patch.host]}, installed {patch.host} {installed})")
        if got.startswith("missing"):
            problems.append(f"{where}: gone from the host ({got})")
        elif patch.signature is not None and got != patch.signature:
            problems.append(f"{where}: signature changed\n    expected {patch.signature}\n    found    {got}")
        checked += 1
    assert not problems, ("host functions patched by vescale_zero.integrations changed; re-read each patch against "
                          "the installed version, then update vescale_zero/host_patches.py and the patch site:\n"
                          + "\n".join(problems))
    assert checked >= 17, checked  # DeepSpeed, accelerate, transformers and megatron-core are in the test extra


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
