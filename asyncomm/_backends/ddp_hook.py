"""The communication hook behind ``asyncomm.trace.ddp``: DDP's own all-reduce, handed over.

DDP's reducer runs its collectives inside torch. A communication hook is the
one place where a program sees each bucket go: this one does what DDP does
by default (torch's ``allreduce_hook``: the bucket averaged over the group)
and gives the future of each bucket's result to whoever registered it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# (the future of a bucket's all-reduce, its bytes, when it was issued, whether it is the
# step's last bucket: backward has every gradient then) -> the future DDP waits on
Watch = Callable[[torch.futures.Future[torch.Tensor], int, float, bool],
                 torch.futures.Future[torch.Tensor]]


def register(model: torch.nn.parallel.DistributedDataParallel, watch: Watch) -> None:
    """Register on ``model`` a hook doing DDP's default all-reduce, each bucket ``watch``ed."""
    def hook(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        return watch(default_hooks.allreduce_hook(group, bucket), bucket.buffer().nbytes, start,
                     bucket.is_last())

    # DDP checks a hook's annotations against the objects themselves (not their names)
    hook.__annotations__ = {"group": Any, "bucket": dist.GradBucket,  # type: ignore[attr-defined]
                            "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(model.process_group, hook)
