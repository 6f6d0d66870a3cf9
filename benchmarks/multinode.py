"""Why HSDP exists: flat FSDP vs HSDP vs DDP across a slow link between two hosts, in one run.

    sudo .venv/bin/python benchmarks/multinode.py [--rates 1gbit 200mbit] [--cycles 3] [--steps 4]
        [--width 512] [--layers 4] [--json out.json]

Two hosts are two network namespaces joined by one veth link (``tests/netns.py``),
its two directions each limited by ``tc ... tbf`` to an inter-node bandwidth (``--rates``), while
the two ranks inside a host talk over loopback (the fast intra-node link). On each host
``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` runs ranks 0,1 (host A) and 2,3
(host B); per rate, one job trains the same MLP (fp32, AdamW) under

* ``flat``: vescale-zero ``fully_shard`` over the 4 ranks (gathers and reduce-scatters cross the link);
* ``hsdp``: ``fully_shard`` on the 2 x 2 ``("replicate", "shard")`` mesh, shard groups {0,1} {2,3}
  inside the hosts: only the all-reduce of each shard across replicas crosses the link;
* ``ddp``: torch ``DistributedDataParallel`` (all-reduce of the whole gradient over the 4 ranks),

interleaved (A B C A B C ...) so that machine noise hits all alike. Measured the same way for all:
ms per step (rank 0's wall clock between barriers, median over the cycles) and the bytes each host's
link interface sent per step (its kernel counters, over the timed steps). Needs root (network
namespaces, ``tc``). Absolute times on a shared CPU machine are noise: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("flat", "hsdp", "ddp")
REPO = Path(__file__).resolve().parents[1]


def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)],
                         nn.Linear(width, 1))


def _build(system: str, args: argparse.Namespace):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import vescale_zero as vz

    model = _mlp(args.width, args.layers)
    if system == "ddp":
        model = DDP(model)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if system == "hsdp" else None
        for layer in list(model)[:-1]:
            vz.fully_shard(layer, mesh=mesh)
        vz.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _link_counters() -> List[int]:
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return [int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes")]


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): every system, interleaved; rank 0 writes the numbers."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    setups = {s: _build(s, args) for s in SYSTEMS}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)
    times: Dict[str, List[float]] = {s: [] for s in SYSTEMS}
    link: Dict[str, List[int]] = {s: [0, 0] for s in SYSTEMS}

    def steps(system: str, n: int) -> None:
        model, opt = setups[system]
        for _ in range(n):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    for s in SYSTEMS:  # warm-up: first gathers, gloo connections, allocator
        steps(s, 2)
    for _ in range(args.cycles):
        for s in SYSTEMS:
            dist.barrier()
            before, t0 = _link_counters(), time.perf_counter()
            steps(s, args.steps)
            dist.barrier()
            elapsed, after = time.perf_counter() - t0, _link_counters()
            times[s].append(1e3 * elapsed / args.steps)
            link[s] = [acc + a - b for acc, a, b in zip(link[s], after, before)]
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "times": times, "link": link})
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(per_rank))
    dist.barrier()
    dist.destroy_process_group()


def _job(args: argparse.Namespace, rate: str, out_dir: Path) -> List[dict]:
    from tests.netns import limit_rate, two_hosts

    with two_hosts() as (a, b):
        limit_rate([a, b], rate)
        out = out_dir / f"{rate}.json"
        jobs = []
        for node, host in enumerate((a, b)):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.address}:29541",
                    "--rdzv-conf", f"timeout=120,is_host={int(node == 0)}", "--node-rank", str(node),
                    "--local-addr", host.address, "--max-restarts", "0", __file__, "--worker-out", str(out),
                    "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
                    "--cycles", str(args.cycles), "--steps", str(args.steps)]
            log = (out_dir / f"{rate}.{node}.log").open("w")
            jobs.append(host.popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        try:
            codes = [j.wait(timeout=args.timeout) for j in jobs]
        except subprocess.TimeoutExpired:
            codes = None
        if codes != [0, 0]:
            logs = "\n".join((out_dir / f"{rate}.{n}.log").read_text()[-2000:] for n in (0, 1))
            raise SystemExit(f"{rate}: torchrun exit codes {codes} (None: over {args.timeout}s)\n{logs}")
        return json.loads(out.read_text())


def _table(results: Dict[str, List[dict]], args: argparse.Namespace) -> List[dict]:
    rows = []
    for rate, per_rank in results.items():
        by_rank = {r["rank"]: r for r in per_rank}
        n = args.cycles * args.steps
        for s in SYSTEMS:
            a_tx, a_rx = by_rank[0]["link"][s]
            rows.append({"link": rate, "system": s, "ms_per_step": statistics.median(by_rank[0]["times"][s]),
                         "a_to_b_mb": a_tx / n / 1e6, "b_to_a_mb": a_rx / n / 1e6})
    print(f"\nMLP {args.layers} x Linear({args.width}) + head, fp32 AdamW, batch {args.batch} per rank; "
          f"2 hosts x 2 ranks; median of {args.cycles} cycles x {args.steps} steps")
    print(f"{'link':>8s} {'system':>6s} {'ms/step':>9s} {'x hsdp':>7s} {'MB/step A->B':>13s} {'MB/step B->A':>13s} "
          f"{'x hsdp':>7s}")
    for r in rows:
        base = next(b for b in rows if b["link"] == r["link"] and b["system"] == "hsdp")
        ms = r["ms_per_step"]
        print(f"{r['link']:>8s} {r['system']:>6s} {ms:9.1f} {ms / base['ms_per_step']:7.2f} {r['a_to_b_mb']:13.2f} "
              f"{r['b_to_a_mb']:13.2f} {r['a_to_b_mb'] / base['a_to_b_mb']:7.2f}")
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"], help="tc rates of the inter-host link")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per system per cycle")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker_out:
        sys.path.insert(0, str(REPO))
        worker(args)
        return
    from tests.netns import why_no_namespaces

    reason = why_no_namespaces()
    if reason:
        raise SystemExit(f"benchmarks/multinode.py needs network namespaces: {reason}")
    with tempfile.TemporaryDirectory(prefix="vzmn-bench-") as tmp:
        results = {rate: _job(args, rate, Path(tmp)) for rate in args.rates}
    rows = _table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
