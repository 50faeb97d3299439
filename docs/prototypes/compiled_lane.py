"""The floor under a channel's tensor ping-pong with its duties compiled, for measuring only.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/compiled_lane.py``
(mpi4py, uvloop, torch, ninja, a C++ compiler, and MPI's header and library under the
Python prefix, as the ``mpich`` wheel puts them): it builds ``compiled_lane.cpp`` first
(torch's C++ extension loader, ~1 minute the first time). The duties of
``lean_tensor.py`` and ``lean_semantics.py``, the per-message ones in C++
(``compiled_lane.cpp``: the tensor checked and its bytes copied, or the object packed
with msgpack and checked for extensions; the head, sequence numbers, the window and
credit, records in packets of up to 16, finding a packet in a receive kept posted, a
fresh tensor or object made for each record), the rest in Python as there: a mailbox per
channel, ``send`` and ``recv`` coroutines, a ``recv`` that flushes what this rank issued
and then looks for its message a while before it parks. No timeouts, dead peers,
tracing, closing or fairness. It prints its 8-byte ping-pong against raw
``Send``/``Recv``, and its rate of small dicts (64 one after the other, then an ack)
against mpi4py's pickle ``send``/``recv``; the pure-Python floors are ``lean_tensor.py``
and ``lean_semantics.py``'s own runs.
"""

import asyncio
import collections
import os
import statistics
import sys
import time
from typing import Any

import msgpack
import torch
import uvloop
from baselines import Message, Poll, channel_ping_pong, looked, park, pickled, raw_ping_pong
from mpi4py import MPI
from torch.utils import cpp_extension

comm = MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
peer = 1 - rank
TAG = 5
MESSAGE = {"step": 0, "loss": 0.5, "ids": [1, 2, 3]}


def build() -> Any:
    """Build (rank 0 first, the others then load what it built) and load the C++ half."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled_lane.cpp")

    def load() -> Any:
        return cpp_extension.load(
            name="compiled_lane", sources=[source], extra_cflags=["-O2"],
            extra_include_paths=[os.path.join(sys.prefix, "include")],
            extra_ldflags=[f"-L{sys.prefix}/lib", "-lmpi", f"-Wl,-rpath,{sys.prefix}/lib"])

    if rank == 0:
        module = load()
    comm.Barrier()
    if rank != 0:
        module = load()
    return module


class Box:
    __slots__ = ("frames", "waiters")

    def __init__(self) -> None:
        self.frames: collections.deque[Message] = collections.deque()
        self.waiters: list[asyncio.Future[None]] = []


class Receiver:
    """The lane's messages, into their channels' mailboxes: taken by ``pump`` (one loop
    callback for the lane, and every ``recv`` that looks)."""

    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.boxes: dict[int, Box] = {}
        self.loop = asyncio.get_running_loop()
        self.poll = Poll(self.loop, self.pump)

    def pump(self) -> bool:
        found = self.lane.pump()
        if found is None:
            return False
        boxes = self.boxes
        for message in found:
            box = boxes[message[1]]
            box.frames.append(tuple.__new__(Message, message))
            if box.waiters and not box.waiters[0].done():
                box.waiters[0].set_result(None)
        return True


class Channel:
    def __init__(self, receiver: Receiver, tag: int) -> None:
        self.receiver, self.lane, self.tag = receiver, receiver.lane, tag
        self.box = receiver.boxes.setdefault(tag, Box())
        self.pump, self.loop = receiver.pump, receiver.loop

    async def send(self, obj: object, dst: int) -> None:
        if type(obj) is torch.Tensor:
            self.lane.send(obj, dst, self.tag)
        else:
            self.lane.send_object(obj, dst, self.tag)

    async def recv(self, src: int | None = None) -> Message:
        box, lane = self.box, self.lane
        while True:
            frames = box.frames
            if frames and (src is None or frames[0][0] == src):
                message = frames.popleft()
                lane.took(message[0], self.tag)
                return message
            if lane.waiting():
                lane.flush()
            if not looked(self.pump, frames):
                await park(self.loop, box.waiters)


async def ping_pong(ch: Channel, n: int) -> float:
    return await channel_ping_pong(comm, rank, peer, n, ch.send, ch.recv, ch.lane.flush,
                                   torch.zeros(2))


async def dicts(small: Channel, ack: Channel, rounds: int, per_round: int) -> float:
    small.lane.flush()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            for _ in range(per_round):
                await small.send(MESSAGE, peer)
            await ack.recv(peer)
        else:
            for _ in range(per_round):
                await small.recv(peer)
            await ack.send(0, peer)
    small.lane.flush()
    return time.perf_counter() - start


async def main(module: Any) -> None:
    pack = msgpack.Packer(use_bin_type=True, strict_types=True).pack
    def unpackb(data: memoryview) -> object:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, timestamp=1)

    lane = module.Lane(comm.py2f(), TAG, pack, unpackb)
    receiver = Receiver(lane)
    ch, small, ack = Channel(receiver, 3), Channel(receiver, 4), Channel(receiver, 6)
    n = 20000
    await ping_pong(ch, 2000)
    for _ in range(3):
        ours, raw = await ping_pong(ch, n), raw_ping_pong(comm, rank, peer, n)
        if rank == 0:
            print(f"ping-pong 8 B (compiled duties): {ours / n / 2 * 1e6:.2f} us one way, raw "
                  f"{raw / n / 2 * 1e6:.2f} us: {ours / raw:.2f}x", flush=True)
    await dicts(small, ack, 50, 64)
    mine, theirs = [], []
    for _ in range(5):
        mine.append(await dicts(small, ack, 300, 64))
        theirs.append(pickled(comm, rank, peer, MESSAGE, 300, 64))
    if rank == 0:
        o, p = statistics.median(mine), statistics.median(theirs)
        print(f"small dicts (compiled duties): {o / 300 / 64 * 1e6:.2f} us a message, pickle "
              f"{p / 300 / 64 * 1e6:.2f}: {p / o:.2f}x pickle's rate", flush=True)
    comm.Barrier()
    receiver.poll.stop()
    lane.close()


uvloop.run(main(build()))
