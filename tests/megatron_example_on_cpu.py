"""Test-only: run a megatron-core script on CPU, as torchrun would run it on GPUs.

    torchrun --nproc-per-node 2 -m tests.megatron_example_on_cpu examples/megatron/pretrain_gpt.py ARGS...

Installs the test-only CUDA shim (:mod:`tests.megatron_shim`) in this rank's process, then
runs the script as ``__main__`` with ``ARGS`` as its command line (``@FILE`` included).
"""

from __future__ import annotations

import runpy
import sys

from tests.megatron_shim import install_cuda_shim

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.megatron_example_on_cpu SCRIPT [ARGS...]")
    install_cuda_shim()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
