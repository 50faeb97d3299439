"""What the prototypes share: their baselines, and how they take their messages.

Imported by ``lean_channel.py``, ``lean_semantics.py``, ``lean_tensor.py`` and
``compiled_lane.py`` (run from anywhere: a script's own folder is on its path).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable, Sized
from typing import Any, NamedTuple

import numpy
from mpi4py import MPI


class Message(NamedTuple):
    """What a prototype's ``recv`` returns, as asyncomm's does."""

    src: int
    tag: int
    data: Any


def pickled(comm: Any, rank: int, peer: int, message: object, rounds: int,
            per_round: int) -> float:
    """Rank 0 sends ``per_round`` messages with pickle, rank 1 receives them and acks."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            for _ in range(per_round):
                comm.send(message, peer, 11)
            comm.recv(source=peer, tag=12)
        else:
            for _ in range(per_round):
                comm.recv(source=peer, tag=11)
            comm.send(None, peer, 12)
    return time.perf_counter() - start


def raw_ping_pong(comm: Any, rank: int, peer: int, n: int) -> float:
    """``n`` round trips of 8 bytes (two floats) by blocking ``Send``/``Recv``."""
    buffer = [numpy.zeros(2, dtype=numpy.float32), MPI.FLOAT]
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            comm.Send(buffer, peer, 9)
            comm.Recv(buffer, peer, 9)
        else:
            comm.Recv(buffer, peer, 9)
            comm.Send(buffer, peer, 9)
    return time.perf_counter() - start


async def channel_ping_pong(comm: Any, rank: int, peer: int, n: int,
                            send: Callable[[Any, int], Awaitable[None]],
                            recv: Callable[[int], Awaitable[object]],
                            flush: Callable[[], None], message: object) -> float:
    """``n`` round trips of ``message`` by a prototype's ``send`` and ``recv`` coroutines
    (``flush``: what its rank issued leaves, before and after)."""
    flush()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            await send(message, peer)
            await recv(peer)
        else:
            await recv(peer)
            await send(message, peer)
    flush()
    return time.perf_counter() - start


def looked(pump: Callable[[], bool], frames: Sized) -> bool:
    """Look for a message as a prototype's ``recv`` does before it parks: ``pump()`` 32
    times, then for up to 50 µs in all, until ``frames`` holds one; return whether it does."""
    end = time.perf_counter() + 50e-6
    for _ in range(32):
        if pump() and frames:
            return True
    while time.perf_counter() < end:
        if pump() and frames:
            return True
    return False


class Poll:
    """A loop callback that calls ``pump()`` once every loop iteration until ``stop``: what
    wakes a prototype's parked ``recv``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pump: Callable[[], object]) -> None:
        self.loop, self.pump, self.open = loop, pump, True
        loop.call_soon(self)

    def __call__(self) -> None:
        if self.open:
            self.pump()
            self.loop.call_soon(self)

    def stop(self) -> None:
        self.open = False


async def park(loop: asyncio.AbstractEventLoop, waiters: list[asyncio.Future[None]]) -> None:
    """Wait until woken (a ``recv`` that looked and found nothing): a future in ``waiters``."""
    waiter = loop.create_future()
    waiters.append(waiter)
    try:
        await waiter
    finally:
        waiters.remove(waiter)


class Taker:
    """Messages on ``tag`` from any source: found by matched probe (``Improbe``, a receive
    sized from it) or, ``posted``, taken from one persistent receive kept started."""

    def __init__(self, comm: Any, tag: int, posted: bool, most: int) -> None:
        self.comm, self.tag, self.posted = comm, tag, posted
        self.status = MPI.Status()
        self.slot = bytearray(most)
        self.request = comm.Recv_init([self.slot, MPI.BYTE], MPI.ANY_SOURCE, tag)
        if posted:
            self.request.Start()

    def take(self) -> tuple[int, bytearray] | None:
        """Return the next message's source and bytes, or ``None``."""
        status = self.status
        if self.posted:
            if not self.request.Test(status):
                return None
            data = self.slot[:status.Get_count(MPI.BYTE)]
            self.request.Start()
            return status.Get_source(), data
        message = self.comm.Improbe(MPI.ANY_SOURCE, self.tag, status)
        if message is None:
            return None
        data = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([data, MPI.BYTE])
        return status.Get_source(), data

    def close(self) -> None:
        if self.posted:
            self.request.Cancel()
            self.request.Wait()
        self.request.Free()
