"""The host releases vescale-zero supports ([Note: one door to DeepSpeed's releases],
[Note: one door to Megatron's releases]): setup.py's extras state the registry's ranges; a
release outside them fails the adapter's import in one line naming the range and the installed
release; and the examples' jobs train on whatever release of DeepSpeed / megatron-core this venv
has (CI runs this file in every venv of its host matrix: .ci/run, docs/testing.md).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from vescale_zero.host_patches import HOST_VERSIONS, supported_releases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")


def _setup_requirements() -> dict:
    """setup.py's module-level requirement strings (``DEEPSPEED = "deepspeed>=0.16,<0.20"``, ...)."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", node.value.value)
            if m and m.group(2):
                out[m.group(1)] = m.group(2)
    return out


def test_setup_extras_state_the_registrys_ranges():
    """Each host's requirement in setup.py is ``>=FIRST,<NEXT`` over the minor releases that
    ``HOST_VERSIONS`` names (what CI installs, from its oldest to its newest), nothing wider,
    nothing narrower."""
    given = _setup_requirements()
    problems = []
    for host in ("torch", "deepspeed", "megatron-core", "transformers", "accelerate", "trl", "peft"):
        first, last = supported_releases(host)
        major, minor = map(int, last.split("."))
        want = f">={first},<{major}.{minor + 1}"
        if given.get(host) != want:
            problems.append(f"setup.py {host}{given.get(host)}: HOST_VERSIONS {HOST_VERSIONS[host]} means {want}")
    assert not problems, "\n".join(problems)


_GATE = r"""
import importlib.metadata, json, sys
distribution, fake, module = sys.argv[1], sys.argv[2], sys.argv[3]
real = importlib.metadata.version
importlib.metadata.version = lambda name: fake if name == distribution else real(name)
try:
    importlib.import_module(module)
    print(json.dumps({"error": None}))
except ImportError as e:
    print(json.dumps({"error": str(e), "type": type(e).__name__}))
"""


@pytest.mark.parametrize("distribution,module", [("deepspeed", "vescale_zero.integrations.deepspeed"),
                                                 ("megatron-core", "vescale_zero.integrations.megatron")])
def test_a_release_outside_the_range_fails_the_import_in_one_line(distribution, module):
    """The adapter's import, with the installed release reported as one below and one above the
    range: an ImportError of one line naming the range and that release, before any of the
    adapter's modules imports the host's internals."""
    first, last = supported_releases(distribution)
    major, minor = map(int, first.split("."))
    below = f"{major}.{minor - 1}.0"
    major, minor = map(int, last.split("."))
    above = f"{major}.{minor + 1}.0"
    for fake in (below, above):
        run = subprocess.run([sys.executable, "-c", "import importlib\n" + _GATE, distribution, fake, module],
                             capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
        assert run.returncode == 0, run.stderr[-2000:]
        said = json.loads(run.stdout.strip().splitlines()[-1])["error"]
        assert said is not None and "\n" not in said, said
        assert f"{distribution} {first}.x to {last}.x" in said and fake in said, said


@pytest.mark.slow  # ~30 s: torchrun and DeepSpeed's imports
def test_readme_deepspeed_command_trains_on_two_ranks(tmp_path):
    """README's DeepSpeed example, ``torchrun ... examples/deepspeed/train.py --deepspeed_config
    configs/deepspeed/ragged.json``, on the installed DeepSpeed: it trains and the loss falls. The
    config's AdamW is DeepSpeed's torch AdamW here (``torch_adam``): the fused kernel is a JIT
    build of minutes on a CPU machine, and the step's math is the same."""
    pytest.importorskip("deepspeed")
    with open(os.path.join(ROOT, "configs", "deepspeed", "ragged.json")) as f:
        config = json.load(f)
    config["optimizer"]["params"]["torch_adam"] = True
    path = tmp_path / "ragged.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "examples/deepspeed/train.py", "--deepspeed_config", str(path), "--steps", "6"]
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"step +\d+  loss ([\d.]+)", out)]
    assert len(losses) == 6 and losses[-1] < losses[0], out[-4000:]
    assert re.search(r"done: 6 steps, stage ragged", out), out[-4000:]
