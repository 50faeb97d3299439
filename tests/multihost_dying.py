"""A world whose second host dies (run by tests/test_hosts.py, 4 ranks on 2 hosts).

Every rank joins and all-reduces once; then the second host's ranks say
``ready`` (a file ``READY_DIR/ready-RANK``) and sleep (the test kills them),
while the first host's ranks say ``waiting`` (``READY_DIR/waiting-RANK``) and
wait for them: rank 0 in an all-reduce, rank 1 in a channel receive from rank 2.
"""

import asyncio
import os
import pathlib
import time

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    t = torch.ones(4)
    await comm.all_reduce(t)
    await comm.barrier()
    if comm.rank >= 2:
        pathlib.Path(os.environ["READY_DIR"], f"ready-{comm.rank}").touch()
        time.sleep(600)  # killed here
    started = time.monotonic()
    pathlib.Path(os.environ["READY_DIR"], f"waiting-{comm.rank}").touch()
    try:
        if comm.rank == 0:
            await comm.all_reduce(t)
        else:
            await comm.channel(5).recv(2)
    except asyncomm.PeerFailedError as exc:
        print(f"rank {comm.rank} stopped after {time.monotonic() - started:.1f} s: {exc}",
              flush=True)
        # torchrun ends a failed rank's siblings at once: the first to see the death waits
        # for the other to see it too (rank 0's all-reduce fails as the connection closes,
        # rank 1's receive when its probe of rank 2 does, up to ASYNCOMM_PROBE_S later)
        await asyncio.sleep(3)
        raise


if __name__ == "__main__":
    asyncomm.run(main)
