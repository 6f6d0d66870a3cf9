"""The job's collective timeout, carried by every process group vescale-zero shards over.

[Note: the job's timeout]
A job states how long a collective may wait for a peer once, for its default process group:
``dist.init_process_group(timeout=...)``, ``deepspeed.init_distributed(timeout=...)``,
Megatron's ``--distributed-timeout-minutes``. A group made later with ``dist.new_group``
without ``timeout=`` does not inherit it: it gets torch's default (30 minutes on gloo, 10 on
NCCL). DeepSpeed's data-parallel group is made that way (deepspeed 0.19.8), and so are the
groups of ``init_device_mesh``. A rank that stops answering (alive but stuck) then holds its
peers in a collective on such a group for torch's default, not for the job's timeout.

So ``fully_shard`` gives every group it shards a module over (the shard group and, for HSDP,
the replicate group) the job's timeout wherever theirs is longer (:func:`carry_job_timeout`):
every gather, reduce-scatter, norm and overflow all-reduce we issue runs on such a group or on
the default group itself, under ``fully_shard``, DeepSpeed (whose data-parallel group the
engine shards over, so DeepSpeed's own collectives on it get the timeout too) and Megatron
alike. A group with a shorter timeout of its own keeps it.

Reading and setting a group's timeout lean on torch internals: ``vescale_zero.torch_compat``
(``process_group_timeout``, ``set_process_group_timeout``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..torch_compat import process_group_timeout, set_process_group_timeout

__all__ = ["group_timeout", "job_timeout", "carry_job_timeout"]


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> Optional[timedelta]:
    """The timeout of ``group``'s collectives (default: the default group's, the job's);
    ``None`` where the backend does not say."""
    return process_group_timeout(dist.group.WORLD if group is None else group)


def job_timeout() -> Optional[timedelta]:
    """The default process group's timeout ([Note: the job's timeout])."""
    return group_timeout(None)


def carry_job_timeout(*groups: Optional[dist.ProcessGroup]) -> None:
    """Give each of ``groups`` (``None`` entries skipped) the job's timeout where its own is
    longer ([Note: the job's timeout]); a no-op where either timeout is unknown."""
    job = job_timeout()
    if job is None:
        return
    for group in groups:
        if group is None or group is dist.group.WORLD:
            continue
        own = group_timeout(group)
        if own is not None and own > job:
            set_process_group_timeout(group, job)
