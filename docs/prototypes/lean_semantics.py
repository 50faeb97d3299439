"""The floor under asyncomm's small messages, for measuring only: small dicts with its semantics.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/lean_semantics.py
[N] [probe|posted]`` (mpi4py, uvloop, msgpack). Like ``lean_channel.py``, but doing what
asyncomm must do per message: each message packed when it is sent (``send`` returns
once its buffers may be reused, so it cannot be packed later with the others), its
bytes checked for msgpack extensions (a ``msgpack.ExtType`` in it must not pass for one
of asyncomm's own), a fixed-width head per frame, frames in packets of ``N`` (default
16) as one msgpack array, one ``unpackb`` per packet, a ``Message`` tuple per message
kept in a deque, sequence numbers checked, credit counted, ``send`` and ``recv``
coroutines. It has no checks of tensors, no dead-peer probes, no timeouts and no
cancellation. It prints its rate against mpi4py's pickle ``send``/``recv``, and a
ping-pong of an 8-byte tensor (its bytes packed when sent, a tensor rebuilt when
received) against raw ``Send``/``Recv`` (see docs/benchmarks.md, "Channels"). Packets
are found by matched probe (``probe``, the default: ``Improbe``, a receive sized from
it) or taken by one persistent any-source receive kept started (``posted``, as
asyncomm's MPI link does on MPICH).
"""

import asyncio
import collections
import statistics
import struct
import sys
import time
from typing import Any

import msgpack
import torch
import uvloop
from baselines import Message, Poll, Taker, pickled, raw_ping_pong
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
peer = 1 - rank
TAG = 5
HEAD = struct.Struct(">BBBQBQ")  # fixarray 4, kind, uint64 tag, uint64 seq
PACKET_FRAMES = int(sys.argv[1]) if len(sys.argv) > 1 else 16
POSTED = (sys.argv[2] if len(sys.argv) > 2 else "probe") == "posted"
EXT = bytes(1 if 0xC7 <= b <= 0xC9 or 0xD4 <= b <= 0xD8 else 0 for b in range(256))
pack = msgpack.Packer(use_bin_type=True, strict_types=True).pack
MESSAGE = {"step": 0, "loss": 0.5, "ids": [1, 2, 3]}


class Box:
    __slots__ = ("frames", "seqs", "taken", "waiter")

    def __init__(self) -> None:
        self.frames: collections.deque[Message] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.seqs: dict[int, int] = {}
        self.taken: dict[int, int] = {}


class Lane:
    """Packets to the peer, sent when the iteration ends; packets found by a loop callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.boxes: dict[int, Box] = {}
        self.pieces: list[bytes] | None = None
        self.frames = 0
        self.seq: dict[int, int] = {}
        self.flush_due = False
        self.taker = Taker(comm, TAG, POSTED, 1 << 16)
        self.poll = Poll(loop, self.pump)

    def box(self, tag: int) -> Box:
        return self.boxes.get(tag) or self.boxes.setdefault(tag, Box())

    def pump(self) -> bool:
        found = False
        while (taken := self.taker.take()) is not None:
            src, data = taken
            found = True
            last, due = None, 0
            box: Any = None
            for item in msgpack.unpackb(data, raw=False, strict_map_key=False, timestamp=1):
                if type(item) is not list or len(item) != 4:
                    raise ValueError("malformed frame")
                kind, tag, seq, obj = item
                if kind != 1:
                    raise ValueError("not a message")
                if tag != last:
                    box, last = self.box(tag), tag
                    due = box.seqs.get(src, 0)
                if seq != due:
                    raise ValueError("sequence")
                due += 1
                box.seqs[src] = due
                box.frames.append(tuple.__new__(Message, (src, tag, obj)))
                if box.waiter is not None and not box.waiter.done():
                    box.waiter.set_result(None)
        return found

    def send(self, obj: object, tag: int, dst: int) -> None:
        if type(dst) is not int or not 0 <= dst < 2:
            raise ValueError(dst)
        body = pack(obj)
        if body.translate(EXT).find(1) >= 0:
            raise TypeError("an extension: asyncomm lowers it instead")
        seq = self.seq.get(tag, 0)
        self.seq[tag] = seq + 1
        if self.pieces is None or self.frames >= PACKET_FRAMES:
            self.flush()
            self.pieces, self.frames = [b""], 0
            if not self.flush_due:
                self.flush_due = True
                self.loop.call_soon(self.flush_now)
        self.pieces += (HEAD.pack(0x94, 1, 0xCF, tag, 0xCF, seq), body)
        self.frames += 1

    def flush_now(self) -> None:
        self.flush_due = False
        self.flush()

    def flush(self) -> None:
        if self.pieces is not None:
            self.pieces[0] = struct.pack(">BI", 0xDD, self.frames)
            request = comm.Isend([b"".join(self.pieces), MPI.BYTE], peer, TAG)
            self.pieces = None
            if not request.Test():
                request.Wait()

    async def recv(self, tag: int, src: int) -> Message:
        box = self.box(tag)
        while True:
            if box.frames and box.frames[0][0] == src:
                message = box.frames.popleft()
                taken = box.taken.get(src, 0) + 1
                box.taken[src] = 0 if taken >= 16 else taken  # credit would go back here
                return message
            self.flush()
            for _ in range(32):
                if self.pump() and box.frames:
                    break
            else:
                box.waiter = self.loop.create_future()
                await box.waiter


async def send(lane: Lane, obj: object, dst: int) -> None:
    lane.send(obj, 3, dst)


async def dicts(lane: Lane, rounds: int, per_round: int) -> float:
    lane.flush()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            for _ in range(per_round):
                await send(lane, MESSAGE, peer)
            await lane.recv(4, peer)  # the ack
        else:
            for _ in range(per_round):
                await lane.recv(3, peer)
            lane.send(0, 4, peer)
    lane.flush()
    return time.perf_counter() - start


async def ping_pong(lane: Lane, n: int) -> float:
    """An 8-byte tensor back and forth: its bytes packed when sent, rebuilt when received."""
    t = torch.zeros(2)
    lane.flush()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            await send(lane, t.numpy().tobytes(), peer)
            lane.flush()
            torch.frombuffer(bytearray((await lane.recv(3, peer)).data), dtype=torch.float32)
        else:
            torch.frombuffer(bytearray((await lane.recv(3, peer)).data), dtype=torch.float32)
            await send(lane, t.numpy().tobytes(), peer)
            lane.flush()
    return time.perf_counter() - start


async def main() -> None:
    lane = Lane(asyncio.get_running_loop())
    n = 20000
    await ping_pong(lane, 2000)
    ours_pp, raw_pp = await ping_pong(lane, n), raw_ping_pong(comm, rank, peer, n)
    await dicts(lane, 50, 64)
    ours, theirs = [], []
    for _ in range(5):
        ours.append(await dicts(lane, 300, 64))
        theirs.append(pickled(comm, rank, peer, MESSAGE, 300, 64))
    if rank == 0:
        print(f"ping-pong 8 B: {ours_pp / n / 2 * 1e6:.2f} us one way, raw "
              f"{raw_pp / n / 2 * 1e6:.2f} us: {ours_pp / raw_pp:.2f}x")
        o, p = statistics.median(ours), statistics.median(theirs)
        print(f"packets of {PACKET_FRAMES}: {o / 300 / 64 * 1e6:.2f} us a message, pickle "
              f"{p / 300 / 64 * 1e6:.2f}: {p / o:.2f}x pickle's rate")
    comm.Barrier()
    lane.poll.stop()
    lane.taker.close()


uvloop.run(main())
