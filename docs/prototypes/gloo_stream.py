"""A lean gloo stream, for measuring only: 64 x 1 MiB over envelopes and data, least Python.

Not part of asyncomm (torch only). Run by hand, two ranks on this host::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 WORLD_SIZE=2 RANK=1 python gloo_stream.py &
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 WORLD_SIZE=2 RANK=0 python gloo_stream.py

It prints the medians of rounds of 64 x 1 MiB sent by rank 0 and received by
rank 1, then acknowledged, against raw gloo ``send``/``recv`` of the same
(64 in flight into 64 buffers), alternated in one run. The protocol is
asyncomm's on gloo, with nothing else: the sender's loop queues the messages
of an iteration and, when it ends, hands them to a thread that sends one
envelope message (the sizes), then the data, waits for the sends in order
and completes each message's future on the loop. The receiver's one thread
keeps envelope receives posted; for an envelope it posts the data receives
into pooled buffers, waits for them in order and hands each buffer to the
loop. No windows or credit, no framing, no validation, no mailboxes: the
floor under asyncomm's stream row (see docs/benchmarks.md, "Channels").
"""

import asyncio
import collections
import os
import queue
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

N, MIB, ENVELOPE, ROUNDS = 64, 1 << 20, 16 << 10, 24


def main() -> None:
    rank = int(os.environ["RANK"])
    peer = 1 - rank
    dist.init_process_group("gloo")
    pg: Any = dist.group.WORLD
    loop = asyncio.new_event_loop()
    t = torch.zeros(MIB // 4)
    inbox = [torch.empty_like(t) for _ in range(N)]
    flag = torch.zeros(2)
    pool = [torch.empty(MIB, dtype=torch.uint8) for _ in range(2 * N)]

    issued: list[tuple[torch.Tensor, asyncio.Future[None]]] = []
    to_send: queue.SimpleQueue[list[tuple[torch.Tensor, asyncio.Future[None]]]] = (
        queue.SimpleQueue())

    def flush() -> None:  # the iteration's end: its messages go together
        to_send.put(issued[:])
        issued.clear()

    def sender() -> None:
        while True:
            batch = to_send.get()
            sizes = torch.tensor([len(batch)] + [b.nbytes for b, _ in batch])
            envelope = pg.send([sizes.view(torch.uint8)], peer, 1)
            works = [(pg.send([b], peer, 2), f) for b, f in batch]
            envelope.wait()
            for work, future in works:
                work.wait()
                loop.call_soon_threadsafe(future.set_result, None)

    def send(tensor: torch.Tensor) -> asyncio.Future[None]:
        future = loop.create_future()
        if not issued:
            loop.call_soon(flush)
        issued.append((tensor.view(torch.uint8).reshape(-1), future))
        return future

    arrived: asyncio.Queue[torch.Tensor] = asyncio.Queue()

    def receiver() -> None:
        posted: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

        def post() -> None:
            envelope = torch.zeros(ENVELOPE, dtype=torch.uint8)
            posted.append((envelope, pg.recv_anysource([envelope], 1)))

        for _ in range(4):
            post()
        taken = 0
        while True:
            envelope, work = posted.popleft()
            work.wait()
            post()
            sizes = envelope.view(torch.int64)
            works = []
            for size in sizes[1:1 + int(sizes[0])].tolist():
                buffer = pool[taken % len(pool)][:size]
                taken += 1
                works.append((buffer, pg.recv([buffer], peer, 2)))
            for buffer, work in works:
                work.wait()
                loop.call_soon_threadsafe(arrived.put_nowait, buffer)

    threading.Thread(target=sender if rank == 0 else receiver, daemon=True).start()

    def raw_round() -> None:
        if rank == 0:
            for work in [pg.send([t], peer, 9) for _ in range(N)]:
                work.wait()
            pg.recv([flag], peer, 10).wait()
        else:
            for work in [pg.recv([b], peer, 9) for b in inbox]:
                work.wait()
            pg.send([flag], peer, 10).wait()

    async def lean_round() -> None:
        if rank == 0:
            await asyncio.gather(*(send(t) for _ in range(N)))
            await loop.run_in_executor(None, lambda: pg.recv([flag], peer, 10).wait())
        else:
            for _ in range(N):
                await arrived.get()
            pg.send([flag], peer, 10).wait()

    rates: dict[str, list[float]] = {"raw": [], "lean": []}
    for _ in range(ROUNDS):
        for name in rates:
            dist.barrier()
            start = time.perf_counter()
            if name == "raw":
                raw_round()
            else:
                loop.run_until_complete(lean_round())
            rates[name].append(N * MIB / (time.perf_counter() - start) / 1e9)
    if rank == 0:
        raw, lean = (statistics.median(rates[k][2:]) for k in ("raw", "lean"))
        print(f"raw gloo {raw:.2f} GB/s, lean stream {lean:.2f} GB/s, lean/raw {lean / raw:.2f}")
    os._exit(0)  # the threads stay blocked in gloo: no orderly teardown for a prototype


if __name__ == "__main__":
    main()
