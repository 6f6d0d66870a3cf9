"""``examples/megatron/pretrain_gpt.py @configs/megatron/gpt_vescale.args``, as README gives it.

The argument file holds one flag and its value per line; the example must read it as the
same arguments given on the command line, and start and train with it under torchrun (on
CPU through the test-only CUDA shim, made tiny by flags after the file, which override it).
Parity with megatron-core's DDP is tests/test_megatron.py's; this is the user's command line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is a test dependency (pip install -e '.[test]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = "examples/megatron/pretrain_gpt.py"
ARGS_FILE = "configs/megatron/gpt_vescale.args"
TINY = ["--tensor-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-2"]


def _parser():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, EXAMPLE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def test_argument_file_reads_as_its_flags_on_the_command_line(tmp_path):
    """``@FILE`` parses to what its tokens give on the command line; later flags override it;
    comments and blank lines are ignored."""
    parser = _parser()
    path = os.path.join(ROOT, ARGS_FILE)
    with open(path) as f:
        tokens = shlex.split(f.read(), comments=True)
    from_file = parser.parse_args(["@" + path])
    assert from_file == parser.parse_args(tokens)
    assert (from_file.num_layers, from_file.lr, from_file.bf16, from_file.use_vescale_fsdp) == (8, 3e-4, True, True)
    assert parser.parse_args(["@" + path, "--num-layers", "2"]).num_layers == 2
    commented = tmp_path / "commented.args"
    commented.write_text("# a tiny model\n--num-layers 3   # three layers\n\n--lr 0.5\n")
    args = parser.parse_args(["@" + str(commented)])
    assert (args.num_layers, args.lr) == (3, 0.5)


@pytest.mark.slow  # ~20 s: torchrun and two megatron-core imports
def test_readme_command_trains_on_two_ranks():
    """README's ``torchrun ... pretrain_gpt.py @configs/megatron/gpt_vescale.args`` on 2 CPU
    ranks: it starts, trains with the file's ``--use-vescale-fsdp`` (the flags after the file
    only shrink the model), and the loss falls."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.megatron_example_on_cpu", EXAMPLE, "@" + ARGS_FILE, *TINY]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "unrecognized arguments" not in out
    done = re.search(r"done: VeScaleFSDP \(ragged\), tp=1 pp=1 dp=2, loss ([\d.]+) -> ([\d.]+)", out)
    assert done, out[-4000:]
    assert float(done.group(2)) < float(done.group(1)), done.group(0)
    assert len(re.findall(r"^iteration +\d+/3 ", out, flags=re.M)) == 3, out[-4000:]
