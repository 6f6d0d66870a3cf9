"""PyTorch's own FSDP2 unit tests with ``vescale_zero.fully_shard`` bound where they import torch's.

    python benchmarks/fsdp2_unit_tests.py DIR [--which torch,ours] [-k EXPR] [--timeout S]

DIR holds torch's test files (``test/distributed/_composable/fsdp/test_fully_shard_*.py`` of the
torch release installed, read from its repository: none of them is part of this project). Each
file runs twice under pytest, test bodies unchanged: with torch's ``fully_shard`` (the baseline:
what FSDP2 itself passes on this machine) and with ours bound in its place (``--which``). Every
process of a run (the multi-process classes spawn their ranks) starts with a small
``sitecustomize`` written by this script, which

* binds ``vescale_zero.fully_shard`` as ``torch.distributed.fsdp.fully_shard`` (and in
  ``torch.testing._internal.common_fsdp``, whose helpers shard models too) for the "ours" run;
* lets ``FSDPTest``'s classes run on a CPU process group: torch 2.13's ``FSDPTest._run`` exits
  with "multi-gpu-N" when there are fewer accelerators than ranks, even for classes marked
  CPU-capable; ``FSDPTestMixin._run`` does the same steps and skips only on a non-CPU device;
* gives ``torch.testing._internal.common_utils`` names newer test files import that the
  installed torch lacks (``HardwareClassification``), as inert stand-ins.

It prints one line per test (torch's outcome, ours, and why a failure is FSDP2-private where it
is), then the counts: of the tests FSDP2 passes, how many pass with ours, split into tests of
behaviour and tests of FSDP2's private state (``PRIVATE``, below). Needs ``expecttest`` (torch's
test utilities import it) and ``pytest-timeout``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Dict, List, Tuple

FILES = ("test_fully_shard_state.py", "test_fully_shard_init.py", "test_fully_shard_training.py")

SITECUSTOMIZE = '''
import enum, os
_mode = os.environ.get("VZ_FSDP2_UNIT_TESTS")
if _mode:
    import torch.testing._internal.common_utils as _cu
    if not hasattr(_cu, "HardwareClassification"):
        _cu.HardwareClassification = enum.Enum("HardwareClassification", "GENERIC CPU GPU")
    import torch.testing._internal.common_fsdp as _cf
    _cf.FSDPTest._run = classmethod(_cf.FSDPTestMixin._run.__func__)
    if _mode == "ours":
        import torch.distributed.fsdp as _fsdp
        import vescale_zero as _vz
        _fsdp.fully_shard = _vz.fully_shard
        _cf.fully_shard = _vz.fully_shard
'''

PRIVATE: Dict[str, str] = {
    # test_fully_shard_state.py
    "test_fully_shard_state": "fully_shard.state(module): FSDP2's composable-API state objects",
    "test_fully_shard_reapply": "the composable-API decorator's AssertionError (ours: ValueError naming the module)",
    "test_fully_shard_cls": "the class name FSDP2 gives (FSDPMLP; ours RaggedFSDPMLP)",
    "test_fully_shard_deepcopy": "FSDP2's AssertionError text (ours: RuntimeError naming the way)",
    # test_fully_shard_init.py
    "test_managed_modules_single": "FSDP2's private _get_managed_modules",
    "test_managed_modules_nested": "FSDP2's private _get_managed_modules over FSDP2's state",
    "test_managed_modules_nested_fully_shard_and_replicate": "FSDP2's private _get_managed_modules",
    "test_managed_modules_duplicate": "FSDP2's private _get_managed_modules",
    "test_managed_modules_list_of_mlps": "FSDP2's private _get_managed_modules",
    "test_managed_states_shared_params_and_buffers": "FSDP2's private _get_managed_states",
    "test_managed_states_nested_fully_shard": "FSDP2's private _get_managed_states over FSDP2's state",
    "test_managed_states_list_of_mlps": "FSDP2's private _get_managed_states",
    "test_get_param_module_infos_shared_params": "FSDP2's private ParamModuleInfo",
    "test_get_param_module_infos_duplicates": "FSDP2's private ParamModuleInfo",
    "test_get_param_module_infos_list_of_mlps": "FSDP2's private ParamModuleInfo",
    "test_fully_shard_is_root": "fully_shard.state(...)._lazy_init / _is_root",
    "test_fully_shard_module_and_param_fqns": "FSDP2's param groups' _module_fqn / _param_fqn",
    "test_fully_shard_double_lazy_init": "fully_shard.state(...)._lazy_init",
    "test_fully_shard_multi_module_root": "fully_shard.state(...)._lazy_init (ours refuses a list as root at forward)",
    "test_raise_scalar_parameter": "an FSDP2 limitation (Shard(0) needs a dim); ours shards scalars",
    "test_raise_noncontiguous_parameter": "an FSDP2 limitation's message",
    "test_invalid_mesh_ndim": "FSDP2's message text (ours: ValueError naming 1-D / 2-D meshes)",
    "test_2d_mesh_without_mesh_dim_names": "FSDP2's AssertionError (ours: ValueError naming the dimension names)",
    "test_invalid_shard_dim": "FSDP2's AssertionError text (ours: ValueError naming the dimension)",
    # test_fully_shard_training.py
    "test_modules_to_run_forward_empty_for_single_module": "FSDP2's private _modules_to_run_forward",
    "test_partial_group_reshard_toggle": "FSDP2's private _fsdp_param_group.is_unsharded",
    "test_share_comm_context": "FSDP2's streams and foreach_all_gather / foreach_reduce internals",
    "test_gradient_accumulation": "collective counts of FSDP2's per-parameter collectives (ours: fewer all-gathers "
                                  "kept; reduce-scatter counts differ by design)",
    "test_shared_params_separate_fsdp_groups_error": "FSDP2's error text (ours raises at fully_shard, naming the "
                                                      "list form)",
}
"""Tests that check FSDP2's private state, its internal functions or its exact messages rather
than a behaviour (the reason for each)."""


def _sitecustomize_dir() -> str:
    where = tempfile.mkdtemp(prefix="fsdp2_unit_tests_")
    with open(os.path.join(where, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(SITECUSTOMIZE)
    return where


def _run(test_dir: str, files: List[str], mode: str, python: str, timeout: int, extra: List[str]
         ) -> Dict[str, str]:
    """``{"file::Class::test": outcome}`` of one pytest run of ``files`` in ``mode``."""
    report = os.path.join(tempfile.mkdtemp(prefix="fsdp2_unit_tests_"), "junit.xml")
    env = dict(os.environ, VZ_FSDP2_UNIT_TESTS=mode,
               PYTHONPATH=os.pathsep.join([_sitecustomize_dir(), test_dir, os.environ.get("PYTHONPATH", "")]))
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}", f"--junitxml={report}",
           "--rootdir", test_dir, *extra, *files]
    subprocess.run(cmd, cwd=test_dir, env=env, check=False)
    outcomes: Dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                          else "skipped" if "skipped" in kinds else "passed")
    return outcomes


def _counts(torch_run: Dict[str, str], ours: Dict[str, str]) -> Tuple[int, int, int, int]:
    baseline = [t for t, o in torch_run.items() if o == "passed"]
    behaviour = [t for t in baseline if t.split("::")[-1] not in PRIVATE]
    private = [t for t in baseline if t.split("::")[-1] in PRIVATE]
    return (sum(ours.get(t) == "passed" for t in behaviour), len(behaviour),
            sum(ours.get(t) == "passed" for t in private), len(private))


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_dir", help="a directory holding torch's test_fully_shard_*.py files")
    parser.add_argument("--files", default=",".join(FILES), help="comma-separated test files in test_dir")
    parser.add_argument("--which", default="torch,ours", help="runs to make: torch, ours or both")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (a venv with torch, "
                                                                 "vescale_zero, expecttest, pytest-timeout)")
    parser.add_argument("--timeout", type=int, default=1800, help="per test, seconds")
    parser.add_argument("-k", default=None, help="pytest -k expression")
    args = parser.parse_args(argv)
    test_dir = os.path.abspath(args.test_dir)
    files = [f for f in args.files.split(",") if f]
    extra = ["-k", args.k] if args.k else []
    runs = {mode: _run(test_dir, files, mode, args.python, args.timeout, extra) for mode in args.which.split(",")}
    names = sorted(set().union(*runs.values()))
    for name in names:
        cells = "  ".join(f"{mode}={runs[mode].get(name, '-'):7s}" for mode in runs)
        why = PRIVATE.get(name.split("::")[-1])
        print(f"{name:95s} {cells}{'  private: ' + why if why else ''}")
    if "torch" in runs and "ours" in runs:
        passed, behaviour, private_passed, private = _counts(runs["torch"], runs["ours"])
        print(f"\nFSDP2 passes {behaviour + private} of {len(names)} here; with vescale_zero.fully_shard: "
              f"{passed} of the {behaviour} behaviour tests, {private_passed} of the {private} FSDP2-private ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
