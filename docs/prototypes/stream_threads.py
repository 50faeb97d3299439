"""Where a channel stream's CPU goes, thread by thread, beside raw gloo: for measuring only.

Not part of asyncomm's package. Run with ``asyncomm run -n 2 stream_threads.py`` (``SECS``:
seconds of each way, default 2). Rounds of 64 x 1 MiB channel messages from rank 0 to rank 1
(gathered sends, then an answer) alternate with raw gloo ``isend``/``irecv`` rounds of the
same; each rank prints, per way, the rate, the wall time a frame and every thread's CPU a
frame (``/proc/self/task/*/stat``), named as ``threading`` names them.
"""

import asyncio
import os
import threading
import time

import torch
import torch.distributed as dist

import asyncomm

N, MIB = 64, 1 << 20
SECS = float(os.environ.get("SECS", "2"))


def cpu_by_thread() -> dict[str, float]:
    """CPU seconds so far of each of this process's threads, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def main(comm: asyncomm.Comm) -> None:
    peer = 1 - comm.rank
    ch, ack = comm.channel(3), comm.channel(4)
    big = torch.zeros(MIB // 4)
    inbox = [torch.zeros(MIB // 4) for _ in range(N)]

    async def channel_round() -> None:
        if comm.rank == 0:
            await asyncio.gather(*(ch.send(big, peer) for _ in range(N)))
            await ack.recv(peer)
        else:
            for _ in range(N):
                await ch.recv(peer)
            await ack.send(0, peer)

    def raw_round() -> None:
        if comm.rank == 0:
            for work in [dist.isend(big, peer) for _ in range(N)]:
                work.wait()
            dist.recv(torch.zeros(1), peer)
        else:
            for work in [dist.irecv(b, peer) for b in inbox]:
                work.wait()
            dist.send(torch.zeros(1), peer)

    for _ in range(3):
        await channel_round()
    rounds = max(1, int(SECS * 25))  # the same count on both ranks
    for way in ("asyncomm", "raw", "asyncomm", "raw"):
        await comm.barrier()
        before, start = cpu_by_thread(), time.perf_counter()
        for _ in range(rounds):
            if way == "raw":
                raw_round()
            else:
                await channel_round()
        took = time.perf_counter() - start
        after = cpu_by_thread()
        frames = rounds * N
        per = {k: (v - before.get(k, 0.0)) / frames * 1e6 for k, v in after.items()
               if v - before.get(k, 0.0) > 0.01}
        print(f"[{comm.rank}] {way}: {frames * MIB / took / 2**20:.0f} MiB/s, "
              f"{took / frames * 1e6:.0f} us a frame, CPU {sum(per.values()):.0f} us a frame: "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])),
              flush=True)


asyncomm.run(main, backend="gloo")
