"""DeepSpeed's own ZeRO-3 unit tests, run on CPU as written, with ``"stage": "ragged"`` in place of 3.

    .venv/bin/python benchmarks/deepspeed_unit_tests.py DEEPSPEED_DIR --mode ragged --out ragged.json
    .venv/bin/python benchmarks/deepspeed_unit_tests.py DEEPSPEED_DIR --mode stage3 --out stage3.json
    .venv/bin/python benchmarks/deepspeed_unit_tests.py [DEEPSPEED_DIR] --compare stage3.json ragged.json [...]

``DEEPSPEED_DIR`` holds DeepSpeed's ``tests/unit`` (a checkout, or ``git archive vX.Y.Z tests`` of
one: take the tag closest to the installed deepspeed). Nothing of DeepSpeed's is copied here: the
test files run unchanged from that directory, in the interpreter running this script.

``--mode stage3`` runs them as they are (stock ZeRO-3 on DeepSpeed's CPU accelerator: the
reference). ``--mode ragged`` imports ``vescale_zero.integrations.deepspeed`` in every process
(pytest's and each test's ranks) and rewrites ``zero_optimization.stage`` 3 to ``"ragged"`` in every
config given to ``deepspeed.initialize`` (``config=``, ``config_params=``, or the JSON file named by
``args.deepspeed_config``) and to ``deepspeed.zero.Init`` (``config_dict_or_path=``, ``config=``);
``zero.Init()`` without a config stays DeepSpeed's stage-3 partitioning, as a user's script has it.
Both modes set ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE`` (DeepSpeed's CPU accelerator counts NUMA nodes
as devices, so without it every 2-rank test skips) and skip the JIT build of the shared-memory comm op.

Each file runs in its own pytest; a case that hangs (DeepSpeed's harness then ends the session) is
recorded as ``hang``, the file resumes after it, and it runs once more at the end. ``--out`` gets
``{file: {case: outcome}}`` (passed / failed / skipped / error / hang / not zero3, with the
failure's last line, and whether the case reached ZeRO-3); ``--compare`` prints a per-file table of
several such runs and the cases that pass in the first (the reference) and not in another.

On a shared 2-core machine a case takes about a minute (each spawns its ranks), so: the reference
with ``--mode stage3 --zero3-only`` (the cases parametrized with stage 0-2 are left out), then the
ragged runs with ``--only <the reference's JSON>`` (the cases that reached ZeRO-3 and passed there).
Set ``TORCH_EXTENSIONS_DIR`` to a directory of your own: DeepSpeed compiles its CPU Adam kernels
there on first use, and a build another process holds the lock of stalls every case behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from typing import Dict, List

FILES = (
    "unit/v1/zero/test_zero.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/v1/zero/test_offload_states.py",
    "unit/v1/zero/test_zero_user_backward.py",
    "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
    "unit/runtime/zero/test_zeropp.py",
)
"""The files run by default, relative to ``DEEPSPEED_DIR/tests``."""

_SITECUSTOMIZE = '''
"""Loaded by every Python process of the run (PYTHONPATH): see benchmarks/deepspeed_unit_tests.py."""
import os

if os.environ.get("VZ_DS_UNIT_MODE"):
    import copy
    import functools
    import inspect
    import json
    import tempfile

    import deepspeed
    from deepspeed.runtime.zero import partition_parameters

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a 40 s JIT build per process otherwise

    ragged = os.environ["VZ_DS_UNIT_MODE"] == "ragged"
    if ragged:
        import vescale_zero.integrations.deepspeed  # noqa: F401

    def _note():
        """The running case reached ZeRO-3 (a stage-3 config, or zero.Init): recorded for --compare."""
        with open(os.environ["VZ_DS_UNIT_CURRENT"]) as f:
            case = f.read()
        with open(os.environ["VZ_DS_UNIT_STAGE3"], "a") as f:
            f.write(case + "\\n")

    def _ragged(config):
        if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
            with open(config) as f:
                config = json.load(f)
        if not isinstance(config, dict):
            return config
        zero = config.get("zero_optimization")
        if isinstance(zero, dict) and zero.get("stage") == 3:
            _note()
            if ragged:
                config = copy.deepcopy(config)
                config["zero_optimization"]["stage"] = "ragged"
        return config

    _initialize = deepspeed.initialize

    @functools.wraps(_initialize)
    def initialize(*args, **kwargs):
        for key in ("config", "config_params"):
            if kwargs.get(key) is not None:
                kwargs[key] = _ragged(kwargs[key])
        ns = kwargs.get("args", args[0] if args else None)
        path = getattr(ns, "deepspeed_config", None)
        if kwargs.get("config") is None and kwargs.get("config_params") is None and path:
            rewritten = _ragged(path)
            fd, name = tempfile.mkstemp(suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(rewritten, f)
            ns = copy.copy(ns)
            ns.deepspeed_config = name
            if args:
                args = (ns,) + tuple(args[1:])
            else:
                kwargs["args"] = ns
        return _initialize(*args, **kwargs)

    deepspeed.initialize = initialize
    _init = partition_parameters.Init.__init__
    _signature = inspect.signature(_init)

    @functools.wraps(_init)
    def init(self, *args, **kwargs):
        bound = _signature.bind(self, *args, **kwargs)
        if bound.arguments.get("enabled", True):
            _note()
        for key in ("config_dict_or_path", "config"):
            if bound.arguments.get(key) is not None:
                bound.arguments[key] = _ragged(bound.arguments[key])
        return _init(*bound.args, **bound.kwargs)

    partition_parameters.Init.__init__ = init
'''

_PLUGIN = '''
"""pytest plugin of benchmarks/deepspeed_unit_tests.py: each case's start and outcome, as they happen."""
import json
import os

_LOG = os.environ["VZ_DS_UNIT_LOG"]


def _write(record):
    with open(_LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


_STAGE_PARAMS = ("zero_stage", "stage")


def pytest_collection_modifyitems(config, items):
    """With VZ_DS_UNIT_ZERO3_ONLY: leave out the cases parametrized with a ZeRO stage other than 3
    (they never reach ZeRO-3, and no config of theirs is rewritten)."""
    if not os.environ.get("VZ_DS_UNIT_ZERO3_ONLY"):
        return
    kept, left_out = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        stages = [params[k] for k in _STAGE_PARAMS if k in params]
        (left_out if stages and all(v != 3 for v in stages) else kept).append(item)
    for item in left_out:
        _write({"case": item.nodeid, "event": "not zero3", "why": "parametrized with another ZeRO stage"})
    items[:] = kept
    config.hook.pytest_deselected(items=left_out)


def pytest_runtest_logstart(nodeid, location):
    _write({"case": nodeid, "event": "start"})
    with open(os.environ["VZ_DS_UNIT_CURRENT"], "w") as f:
        f.write(nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
        why = ""
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            why = str(report.longrepr[2])
        elif report.outcome == "failed":
            lines = [line for line in str(report.longrepr).splitlines() if line.startswith("E ")]
            why = lines[-1][1:].strip() if lines else str(report.longrepr).splitlines()[-1]
        _write({"case": nodeid_of(report), "event": outcome, "why": why[:400]})


def nodeid_of(report):
    return report.nodeid
'''


def _run_file(tests: str, rel: str, targets: List[str], env: Dict[str, str], timeout: int, extra: List[str]) -> Dict:
    """``{case: {"outcome", "why", "zero3"}}`` of one file's ``targets`` (the file, or some of its
    cases), resuming after a case that hangs; ``zero3``: the case reached ZeRO-3. The cases that
    hung are run once more at the end (a first case may spend DeepSpeed's timeout compiling an op)."""
    results: Dict[str, Dict] = {}
    scratch = tempfile.mkdtemp(prefix="vz_ds_unit_case_")
    current, reached = os.path.join(scratch, "current"), os.path.join(scratch, "stage3")
    open(reached, "w").close()
    env = {**env, "VZ_DS_UNIT_CURRENT": current, "VZ_DS_UNIT_STAGE3": reached}
    retried = False
    while True:
        path = os.path.join(scratch, "log.jsonl")
        open(path, "w").close()
        deselect = [f"--deselect={case}" for case in results]
        cmd = [sys.executable, "-m", "pytest", *targets, "-p", "_vz_ds_unit_plugin", "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", "-m", "not sequential and not nightly and not inference", *extra, *deselect]
        try:
            subprocess.run(cmd, cwd=tests, env={**env, "VZ_DS_UNIT_LOG": path}, timeout=timeout,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pass
        started, finished = [], set()
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec["event"] == "start":
                    started.append(rec["case"])
                else:
                    finished.add(rec["case"])
                    old = results.get(rec["case"], {}).get("outcome")
                    if old not in ("failed", "error") or retried:  # a teardown error after a pass is an error
                        results[rec["case"]] = {"outcome": rec["event"], "why": rec["why"]}
        hung = [case for case in started if case not in finished]
        for case in hung:
            results[case] = {"outcome": "hang", "why": "no result (DeepSpeed's harness timed out or the run ended)"}
        with open(reached) as f:
            for case in f.read().splitlines():
                if case in results:
                    results[case]["zero3"] = True
        if hung and not retried:
            print(f"  {rel}: {hung[0]} hung; resuming after it", flush=True)
            continue
        if retried:
            for case in targets:
                results.setdefault(case, {"outcome": "hang", "why": "not reached after a case that hung twice"})
            return results
        again = [case for case, r in results.items() if r["outcome"] == "hang"]
        if not again:
            return results
        print(f"  {rel}: running the {len(again)} cases that hung once more", flush=True)
        retried, targets = True, again
        results = {case: r for case, r in results.items() if case not in again}


def run(args: argparse.Namespace) -> None:
    tests = os.path.join(os.path.abspath(args.deepspeed), "tests")
    if not os.path.isdir(os.path.join(tests, "unit")):
        raise SystemExit(f"{args.deepspeed}: no tests/unit there; give a DeepSpeed checkout (or `git archive` of its "
                         "tests)")
    here = tempfile.mkdtemp(prefix="vz_ds_unit_")
    with open(os.path.join(here, "sitecustomize.py"), "w") as f:
        f.write(textwrap.dedent(_SITECUSTOMIZE))
    with open(os.path.join(here, "_vz_ds_unit_plugin.py"), "w") as f:
        f.write(textwrap.dedent(_PLUGIN))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": str(args.local_size), "VZ_DS_UNIT_MODE": args.mode,
           "DS_UNITTEST_TIMEOUT": str(args.case_timeout), "VZ_DS_UNIT_ZERO3_ONLY": "1" if args.zero3_only else "",
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out: Dict[str, Dict] = {}
    if args.out and os.path.exists(args.out) and args.resume:
        with open(args.out) as f:
            out = json.load(f)
    extra = ["-k", args.k] if args.k else []
    only = None
    if args.only:
        with open(args.only) as f:
            only = {rel: [case for case, r in cases.items() if r.get("zero3") and r["outcome"] == "passed"]
                    for rel, cases in json.load(f).items()}
    for rel in args.files or FILES:
        rel = rel if rel.startswith("unit/") else f"unit/{rel}"
        if rel in out:
            continue
        targets = [rel] if only is None else only.get(rel, [])
        if not targets:
            continue
        print(f"{rel} ({args.mode}, {len(targets) if only is not None else 'all'} cases)", flush=True)
        out[rel] = _run_file(tests, rel, targets, env, args.file_timeout, extra)
        counts = Counter(r["outcome"] for r in out[rel].values())
        print(f"  {dict(counts)}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1, sort_keys=True)


PRIVATE = ("ds_tensor", "ds_persist", "averaged_gradients", "_external_params", "DeepSpeedZeroOptimizer_Stage3",
           "get_fp32_grad_partitions", "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat",
           "ds_grads_remaining", "param_coordinator", "ds_active_sub_modules", "__ds_", "ipg_bucket",
           "_get_norm_groups", "ds_id")
"""Names of ZeRO-3's private state: a case whose test reads one tests stage 3's implementation, not
behaviour a job relies on (counted apart by --compare; checked by reading the case, see docs)."""


def private_reads(tests: str, case: str) -> List[str]:
    """The names of :data:`PRIVATE` in ``case``'s test class (or function) and the module-level
    functions it calls, two levels deep."""
    import ast

    rel, _, rest = case.partition("::")
    path = os.path.join(tests, rel)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top = functions.get(rest.split("::")[0].split("[")[0])
    if top is None:
        return []
    seen, todo, text = set(), [top], []
    for _ in range(3):
        found = []
        for node in todo:
            if node.name in seen:
                continue
            seen.add(node.name)
            text.append(ast.get_source_segment(source, node) or "")
            found += [functions[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in functions]
        todo = found
    body = "\n".join(text)
    return [name for name in PRIVATE if name in body]


def compare(paths: List[str], tests: str = "") -> None:
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    names = [os.path.basename(p).rsplit(".", 1)[0] for p in paths]
    print("| file | " + " | ".join(f"{n} pass/fail/skip/other stage" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for rel in runs[0]:
        cells = []
        for run_ in runs:
            c = Counter(r["outcome"] for r in run_.get(rel, {}).values())
            cells.append(f"{c['passed']}/{c['failed'] + c['error'] + c['hang']}/{c['skipped']}/{c['not zero3']}")
        print(f"| {rel} | " + " | ".join(cells) + " |")
    print("\ncases passing in the first run that reached ZeRO-3 (behaviour / reading ZeRO-3's private state):")
    for rel, cases in runs[0].items():
        counted = [c for c, r in cases.items() if r["outcome"] == "passed" and r.get("zero3")]
        private = {c: private_reads(tests, c) for c in counted} if tests else {}
        cells = []
        for name, run_ in zip(names[1:], runs[1:]):
            ok = [c for c in counted if run_.get(rel, {}).get(c, {}).get("outcome") == "passed"]
            cells.append(f"{name}: {sum(not private.get(c) for c in ok)}/{sum(bool(private.get(c)) for c in ok)}")
        print(f"  {rel}: {sum(not private.get(c) for c in counted)}/{sum(bool(private.get(c)) for c in counted)}; "
              + ", ".join(cells))
    print("\ncases passing in the first run and not in another:")
    for rel, cases in runs[0].items():
        for case, res in cases.items():
            if res["outcome"] != "passed":
                continue
            for name, run_ in zip(names[1:], runs[1:]):
                other = run_.get(rel, {}).get(case, {"outcome": "missing", "why": ""})
                if other["outcome"] != "passed":
                    mark = f" (reads {', '.join(private_reads(tests, case))})" if tests and private_reads(tests, case) \
                        else ""
                    print(f"  {case}{mark} [{name}: {other['outcome']}] {other['why'][:200]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deepspeed", nargs="?", help="a directory holding DeepSpeed's tests/unit")
    p.add_argument("--mode", choices=("stage3", "ragged"), default="ragged")
    p.add_argument("--files", nargs="*", help="files under tests/ (default: FILES)")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--out", help="JSON results file")
    p.add_argument("--zero3-only", action="store_true",
                   help="leave out the cases parametrized with a ZeRO stage other than 3 (recorded as 'not zero3')")
    p.add_argument("--only", metavar="JSON", help="only the cases that reached ZeRO-3 and passed in this run")
    p.add_argument("--resume", action="store_true", help="skip the files already in --out")
    p.add_argument("--local-size", type=int, default=4, help="devices DeepSpeed's CPU accelerator reports")
    p.add_argument("--case-timeout", type=int, default=300, help="DeepSpeed's per-case timeout (s)")
    p.add_argument("--file-timeout", type=int, default=7200, help="one file's pytest (s)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="print a table of runs (the first: the reference)")
    args = p.parse_args()
    if args.compare:
        compare(args.compare, os.path.join(os.path.abspath(args.deepspeed), "tests") if args.deepspeed else "")
    elif args.deepspeed:
        run(args)
    else:
        p.error("give DEEPSPEED_DIR, or --compare")


if __name__ == "__main__":
    main()
