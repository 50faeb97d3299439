"""The rounds of the awaited prototypes: an 8-byte all_reduce, raw, bridged and awaited.

Imported by ``awaited_floor.py`` and ``awaited_duties.py`` (run from anywhere: a
script's own folder is on its path).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

import torch
from mpi4py import MPI

N = 20000


async def rounds(name: str, awaited: Callable[[torch.Tensor], Awaitable[object]]) -> None:
    """Print, per round, the blocking ``Allreduce`` (raw), the busy-poll bridge people
    write by hand (``Iallreduce``, then ``while not req.Test(): await asyncio.sleep(0)``)
    and ``await awaited(t)``, each ``N`` times, and their ratios to raw."""
    comm = MPI.COMM_WORLD
    t = torch.zeros(2)
    buf = [t.numpy(), MPI.FLOAT]

    async def bridge() -> None:
        request = comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
        while not request.Test():
            await asyncio.sleep(0)

    for _ in range(3):
        took = {}
        for variant in ("raw", "bridge", name):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(N):
                if variant == "raw":
                    comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
                elif variant == "bridge":
                    await bridge()
                else:
                    await awaited(t)
            took[variant] = (time.perf_counter() - start) / N * 1e6
        if comm.rank == 0:
            print("  ".join(f"{k} {v:.2f} us" for k, v in took.items()),
                  f"{name}/raw {took[name] / took['raw']:.2f}",
                  f"bridge/raw {took['bridge'] / took['raw']:.2f}", flush=True)
