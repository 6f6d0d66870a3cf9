"""``python -m vescale_zero.gpu_check --out DIR [--device cuda|cpu]``: see the package's docstring."""

from __future__ import annotations

import argparse
import os
import sys

from . import __doc__ as DOC
from .plan import SECTIONS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vescale_zero.gpu_check", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for report.md, report.json and sections.log")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (full sizes, NCCL) or cpu (the dry mode: tiny sizes, gloo); default: cuda if available")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check; sections that no longer fit are skipped (default: 330 on "
                        "cuda, 900 on cpu)")
    p.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], help="run only these")
    p.add_argument("--prelude", metavar="MODULE:FUNCTION",
                   help="called with the section's name in each section's process before it runs (test harnesses "
                        "install stand-ins with it: tests.megatron_shim:gpu_check_prelude)")
    p.add_argument("--section", help=argparse.SUPPRESS)  # [Note: one process per section]: the child's side
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.section:
        from .runner import run_section

        rc = run_section(args.section, device, args.result, args.timeout, args.prelude)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no interpreter teardown: a process group's exit can hang or abort after the result is out
    if not args.out:
        p.error("--out DIR is required")
    from .runner import run_check

    budget = args.budget or (330.0 if device == "cuda" else 900.0)
    return run_check(args.out, device, budget, args.prelude, args.sections)


if __name__ == "__main__":
    sys.exit(main())
