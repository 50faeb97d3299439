"""A lean channel, for measuring only: what a small message costs with nothing but the wire.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/lean_channel.py``
(mpi4py, uvloop, msgpack, torch). It prints a ping-pong of an 8-byte tensor against
raw ``Send``/``Recv``, and 64 small dicts sent one after the other (in packets of 16)
against mpi4py's pickle ``send``/``recv``. A message is msgpack ``[tag, seq, payload]``;
a packet, a list of them in one MPI message, found by a loop callback with ``Improbe``,
received with a matched ``Recv`` and decoded in one ``unpackb``; a message goes straight
to the waiting receiver's future. It has no credit, no sequence checks, no validation
of hostile frames, no dead-peer probes, no per-channel mailboxes: the floor under
asyncomm's small messages (see docs/benchmarks.md, "Channels").
"""

import asyncio
import collections
import time

import msgpack
import torch
import uvloop
from baselines import pickled, raw_ping_pong
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
peer = 1 - rank
TAG = 5


class Lane:
    """Messages to and from the peer: packets sent at once, received by a loop callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.box: collections.deque[list] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.status = MPI.Status()
        self.sends: list = []
        loop.call_soon(self.poll)

    def poll(self) -> None:
        self.pump()
        self.loop.call_soon(self.poll)

    def pump(self) -> bool:
        found = False
        while True:
            message = comm.Improbe(MPI.ANY_SOURCE, TAG, self.status)
            if message is None:
                return found
            packet = bytearray(self.status.Get_count(MPI.BYTE))
            message.Recv([packet, MPI.BYTE])
            found = True
            for item in msgpack.unpackb(packet):
                waiter = self.waiter
                if waiter is not None and not waiter.done() and not self.box:
                    self.waiter = None
                    waiter.set_result(item)
                else:
                    self.box.append(item)

    def send(self, items: list) -> None:
        request = comm.Isend([msgpack.packb(items), MPI.BYTE], peer, TAG)
        if not request.Test():
            self.sends.append(request)

    async def recv(self) -> list:
        if self.box:
            return self.box.popleft()
        for _ in range(32):
            if self.pump() and self.box:
                return self.box.popleft()
        self.waiter = self.loop.create_future()
        return await self.waiter


def encode(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def decode(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.float32)


async def ping_pong(lane: Lane, n: int) -> float:
    t = torch.zeros(2)
    comm.Barrier()
    start = time.perf_counter()
    for i in range(n):
        if rank == 0:
            lane.send([[1, i, encode(t)]])
            decode((await lane.recv())[2])
        else:
            decode((await lane.recv())[2])
            lane.send([[1, i, encode(t)]])
    return time.perf_counter() - start


MESSAGE = {"step": 0, "loss": 0.5, "ids": [1, 2, 3]}


async def dicts(lane: Lane, rounds: int, per_round: int) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            packet = []
            for i in range(per_round):  # each message "sent" on its own, 16 to a packet
                packet.append([3, i, MESSAGE])
                if len(packet) == 16:
                    lane.send(packet)
                    packet = []
            if packet:
                lane.send(packet)
            await lane.recv()  # the ack
        else:
            for _ in range(per_round):
                await lane.recv()
            lane.send([[4, 0, 0]])
    return time.perf_counter() - start


async def main() -> None:
    lane = Lane(asyncio.get_running_loop())
    n = 20000
    await ping_pong(lane, n)  # warm-up
    ours, raw = await ping_pong(lane, n), raw_ping_pong(comm, rank, peer, n)
    rounds, per_round = 300, 64
    ours_dicts = await dicts(lane, rounds, per_round)
    pickle_dicts = pickled(comm, rank, peer, MESSAGE, rounds, per_round)
    if rank == 0:
        print(f"ping-pong 8 B: {ours / n / 2 * 1e6:.2f} us one way, raw "
              f"{raw / n / 2 * 1e6:.2f} us: {ours / raw:.2f}x")
        count = rounds * per_round
        print(f"dicts: {count / ours_dicts / 1e3:.0f} k msg/s, pickle "
              f"{count / pickle_dicts / 1e3:.0f} k msg/s: {pickle_dicts / ours_dicts:.2f}x")


uvloop.run(main())
