"""One rank of the two-host HSDP job of ``tests/test_multinode.py`` (run by torchrun on each host).

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST_A:PORT \
        --node-rank {0,1} tests/multinode_worker.py OUT_DIR

HSDP 2 x 2 on a ``("replicate", "shard")`` mesh: ranks 0,1 (host A) and 2,3 (host B) are the
shard groups, so the all-gathers and reduce-scatters stay inside a host and only the gradient
all-reduce across replicas ({0,2} and {1,3}) crosses the link. Each rank trains ``AwkwardLM`` on
its quarter of the global batch (AdamW, clipping) and rank 0 writes to ``OUT_DIR/result.pt`` the
full trained state dict, every rank's host identity (its network namespace) and the bytes
each host's link interface (``GLOO_SOCKET_IFNAME``) sent and received during training.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vescale_zero as vz  # noqa: E402
from tests.models import AwkwardLM, make_batches, rank_slice  # noqa: E402

REPLICAS, SHARD = 2, 2
STEPS, GLOBAL_BATCH, LR, CLIP, MODEL_SEED, DATA_SEED = 3, 16, 1e-2, 0.05, 3, 5


def _link_counters() -> list:
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return [int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes")]


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == REPLICAS * SHARD, f"launch {REPLICAS * SHARD} ranks (2 hosts x 2), not {world}"
    mesh = init_device_mesh("cpu", (REPLICAS, SHARD), mesh_dim_names=("replicate", "shard"))
    model = AwkwardLM(seed=MODEL_SEED)
    for block in model.blocks:
        vz.fully_shard(block, mesh=mesh)
    vz.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)

    host = os.stat("/proc/self/ns/net").st_ino  # the namespace: one per host
    identity = {"rank": rank, "host": host, "shard_group": dist.get_process_group_ranks(mesh.get_group("shard")),
                "replicate_group": dist.get_process_group_ranks(mesh.get_group("replicate"))}
    dist.barrier()
    before = _link_counters()
    for batch in make_batches(STEPS, GLOBAL_BATCH, seed=DATA_SEED):
        x, y = rank_slice(batch, rank, world)
        model(x, y).backward()
        vz.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
    dist.barrier()
    after = _link_counters()
    identity["link_tx_rx"] = [a - b for a, b in zip(after, before)]
    identities = [None] * world
    dist.all_gather_object(identities, identity)
    state = vz.full_state_dict(model)
    if rank == 0:
        torch.save({"state": state, "ranks": identities}, Path(out_dir) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
