"""The floor under a channel's tensor ping-pong, for measuring only: no msgpack, a few duties.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/lean_tensor.py
[probe|posted]`` (mpi4py, uvloop, torch). A channel message of a tensor is one MPI
message: a fixed binary head (kind, dtype code, tag, sequence number, bytes) then the
tensor's bytes, copied from its memory when it is sent. Messages are found either by
matched probe (``Improbe``, a receive sized from it: ``probe``) or by one persistent
any-source receive kept started (``posted``, the default). What it does per message
of asyncomm's duties: the destination and the tensor checked (a plain CPU tensor, laid
out as it lies), a sequence number per (channel, destination) sent and checked per
(source, channel), a window of 64 messages per destination with credit returned every
16 taken, a mailbox per channel, a ``recv`` that flushes what this rank issued and then
looks for its message a while before it parks, a fresh tensor per message received. It
has no timeouts, no dead-peer probes, no tracing, no closing, no other kinds of message
and no fairness towards other tasks. It prints its ping-pong against raw
``Send``/``Recv`` (see docs/benchmarks.md, "Channels").
"""

import asyncio
import collections
import ctypes
import struct
import sys
from typing import Any

import torch
import uvloop
from baselines import Message, Poll, Taker, channel_ping_pong, looked, park, raw_ping_pong
from mpi4py import MPI

comm = MPI.COMM_WORLD.Dup()
rank, size = comm.Get_rank(), comm.Get_size()
peer = 1 - rank
TAG = 5
POSTED = (sys.argv[1] if len(sys.argv) > 1 else "posted") == "posted"
HEAD = struct.Struct("<BBQQI")  # kind (1 data, 2 credit), dtype code, tag, seq, bytes
MESSAGE, CREDIT = 1, 2
CODES = {torch.float32: 1, torch.float64: 2, torch.int64: 3}
DTYPES = {code: (dtype, torch.empty(0, dtype=dtype).element_size())
          for dtype, code in CODES.items()}
MAX_BYTES = 8 << 10
WINDOW, BATCH = 64, 16


class Box:
    __slots__ = ("frames", "seqs", "taken", "waiters")

    def __init__(self) -> None:
        self.frames: collections.deque[Message] = collections.deque()
        self.waiters: list[asyncio.Future[None]] = []
        self.seqs: dict[int, int] = {}
        self.taken: dict[int, int] = {}


class Window:
    __slots__ = ("out", "seq")

    def __init__(self) -> None:
        self.seq = self.out = 0


class Lane:
    """This rank's messages: sent when a receiver waits, found by a loop callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.boxes: dict[int, Box] = {}
        self.windows: dict[tuple[int, int], Window] = {}
        self.pending: list[tuple[bytes, int]] = []
        self.taker = Taker(comm, TAG, POSTED, MAX_BYTES + HEAD.size)
        self.poll = Poll(loop, self.pump)

    def box(self, tag: int) -> Box:
        box = self.boxes.get(tag)
        if box is None:
            box = self.boxes[tag] = Box()
        return box

    def pump(self) -> bool:
        found = False
        while (taken := self.taker.take()) is not None:
            src, data = taken
            found = True
            kind, code, tag, seq, nbytes = HEAD.unpack_from(data)
            if kind == CREDIT:
                self.windows[(tag, src)].out -= seq
                continue
            dtype = DTYPES.get(code)
            if (kind != MESSAGE or dtype is None or nbytes != len(data) - HEAD.size
                    or nbytes % dtype[1]):
                raise ValueError(f"a malformed message from rank {src}")
            box = self.boxes.get(tag) or self.box(tag)
            if seq != box.seqs.get(src, 0):
                raise ValueError(f"message {seq} from rank {src} out of sequence")
            box.seqs[src] = seq + 1
            tensor = torch.frombuffer(data, dtype=dtype[0], offset=HEAD.size,
                                      count=nbytes // dtype[1])
            box.frames.append(tuple.__new__(Message, (src, tag, tensor)))
            if box.waiters and not box.waiters[0].done():
                box.waiters[0].set_result(None)
        return found

    def flush(self) -> None:
        for message, dst in self.pending:
            request = comm.Isend([message, MPI.BYTE], dst, TAG)
            if not request.Test():
                request.Wait()
        self.pending.clear()


KNOWN: dict[tuple[torch.dtype, torch.Size], tuple[int, int, Any]] = {}


class Channel:
    def __init__(self, lane: Lane, tag: int) -> None:
        self.lane, self.tag, self.box = lane, tag, lane.box(tag)
        self.windows: dict[int, Window] = {}

    async def send(self, t: torch.Tensor, dst: int) -> None:
        window = self.windows.get(dst)
        if window is None:
            if type(dst) is not int or not 0 <= dst < size:
                raise ValueError(f"dst={dst!r}")
            window = self.windows[dst] = self.lane.windows[(self.tag, dst)] = Window()
        if type(t) is not torch.Tensor:
            raise TypeError("a tensor")
        known = KNOWN.get((t.dtype, t.shape))
        if known is None:
            known = KNOWN[(t.dtype, t.shape)] = (CODES[t.dtype], t.nbytes,
                                                 ctypes.c_char * t.nbytes)
        if not (t.layout is torch.strided and t.is_contiguous() and t.is_cpu
                and not t.is_neg()):
            raise TypeError("a plain CPU tensor, laid out as it lies")
        if window.out >= WINDOW:
            raise RuntimeError("out of credit (a real channel waits)")
        window.out += 1
        seq = window.seq
        window.seq = seq + 1
        message = (HEAD.pack(MESSAGE, known[0], self.tag, seq, known[1])
                   + known[2].from_address(t.data_ptr()).raw)
        self.lane.pending.append((message, dst))

    async def recv(self, src: int | None = None) -> Message:
        box, lane = self.box, self.lane
        while True:
            frames = box.frames
            if frames and (src is None or frames[0][0] == src):
                message = frames.popleft()
                taken = box.taken.get(message[0], 0) + 1
                if taken >= BATCH:  # credit back, with the next messages out
                    taken = 0
                    lane.pending.append((HEAD.pack(CREDIT, 0, self.tag, BATCH, 0), message[0]))
                box.taken[message[0]] = taken
                return message
            if lane.pending:
                lane.flush()
            if not looked(lane.pump, frames):
                await park(lane.loop, box.waiters)


async def ping_pong(ch: Channel, n: int) -> float:
    return await channel_ping_pong(comm, rank, peer, n, ch.send, ch.recv, ch.lane.flush,
                                   torch.zeros(2))


async def main() -> None:
    lane = Lane(asyncio.get_running_loop())
    ch = Channel(lane, 3)
    n = 20000
    await ping_pong(ch, 2000)
    for _ in range(3):
        ours, raw = await ping_pong(ch, n), raw_ping_pong(comm, rank, peer, n)
        if rank == 0:
            print(f"ping-pong 8 B ({'posted' if POSTED else 'probe'}): "
                  f"{ours / n / 2 * 1e6:.2f} us one way, raw {raw / n / 2 * 1e6:.2f} us: "
                  f"{ours / raw:.2f}x", flush=True)
    comm.Barrier()
    lane.poll.stop()
    lane.taker.close()


uvloop.run(main())
