"""A real two-host HSDP job: two network namespaces joined by a veth link, torchrun on each.

Host A (10.77.0.1) and host B (10.77.0.2) each run ``torchrun --nnodes 2 --nproc-per-node 2
--rdzv-backend c10d --rdzv-endpoint 10.77.0.1:PORT`` of ``tests/multinode_worker.py`` (HSDP 2 x 2,
the replicate dimension across the hosts, gloo on the veth interface). Checked:

* the trained model equals a single-process unsharded reference on the whole global batch
  (fp32, within 1e-6: HSDP sums gradients as two halves, the reference as one sum);
* ranks 0,1 ran on one host and 2,3 on the other, each shard group inside a host and each
  replicate group across the two;
* the gradient all-reduce really crossed the link: each host's interface sent and received at
  least the all-reduce's minimum payload (half of each rank's shard, per replica pair, per step).

Skips (saying why) where network namespaces cannot be made (no root / CAP_NET_ADMIN); every
subprocess has a timeout, and the namespaces are removed whatever happens.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import multinode_worker as worker
from tests.models import AwkwardLM, make_batches, train_reference
from tests.netns import link_bytes, two_hosts, why_no_namespaces

REPO = Path(__file__).resolve().parents[1]
PORT, TIMEOUT = 29531, 240


def _launch(host, node_rank: int, endpoint: str, out_dir: Path, log: Path) -> subprocess.Popen:
    # is_host: c10d guesses who hosts the rendezvous store from the machine's hostname, which
    # a namespace shares with the machine; name it (as on hosts whose endpoint is not their name).
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", f"timeout=120,is_host={int(node_rank == 0)}",
            "--node-rank", str(node_rank), "--local-addr", host.address, "--max-restarts", "0",
            str(REPO / "tests" / "multinode_worker.py"), str(out_dir)]
    return host.popen(argv, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_hsdp_across_two_network_hosts(tmp_path):
    reason = why_no_namespaces()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    logs = [tmp_path / "host_a.log", tmp_path / "host_b.log"]
    with two_hosts() as (a, b):
        before = [link_bytes(a), link_bytes(b)]
        endpoint = f"{a.address}:{PORT}"
        jobs = [_launch(h, i, endpoint, tmp_path, log) for i, (h, log) in enumerate(zip((a, b), logs))]
        try:
            codes = [job.wait(timeout=TIMEOUT) for job in jobs]
        except subprocess.TimeoutExpired:
            codes = None  # two_hosts kills what still runs in the namespaces
        after = [link_bytes(a), link_bytes(b)]
    out = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0, 0], f"torchrun exit codes {codes} (None: over {TIMEOUT}s)\n{out}"
    result = torch.load(tmp_path / "result.pt")

    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    hosts = [r["host"] for r in ranks]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], f"ranks per host: {hosts}"
    assert [r["shard_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["replicate_group"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]

    model = AwkwardLM(seed=worker.MODEL_SEED)
    batches = make_batches(worker.STEPS, worker.GLOBAL_BATCH, seed=worker.DATA_SEED)
    ref = train_reference(model, batches, lr=worker.LR, clip=worker.CLIP)["params"]
    state = result["state"]
    assert set(ref) <= set(state), sorted(set(ref) - set(state))
    diffs = {k: (state[k] - v).abs().max().item() for k, v in ref.items()}
    assert max(diffs.values()) <= 1e-6, {k: d for k, d in diffs.items() if d > 1e-6}
    moved = {k: (state[k] - v).abs().max().item() for k, v in model.named_parameters() if v.requires_grad}
    assert min(moved.values()) > 1e-4, moved  # training changed every trainable parameter

    # Each replica pair all-reduces its rank's shard (about half of the trainable elements) every
    # step; an all-reduce of two ranks sends at least half of it each way. Two pairs cross the link.
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    floor = worker.STEPS * 2 * (trainable // 2 // 2) * 4
    for who, (tx, rx) in (("A", ranks[0]["link_tx_rx"]), ("B", ranks[2]["link_tx_rx"])):
        assert tx >= floor and rx >= floor, f"host {who} sent {tx} and received {rx} bytes in training, < {floor}"
    total = [x1 - x0 for (x1, _), (x0, _) in zip(after, before)]
    assert min(total) >= floor, total
