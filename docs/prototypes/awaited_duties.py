"""An awaited MPI all_reduce with asyncomm's duties per operation, for measuring only.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/awaited_duties.py``
(mpi4py, uvloop, torch). Beside ``awaited_floor.py``'s bare awaitable, this one does
what an awaited operation of asyncomm must do, in as few Python frames as it can:
check the tensor (type, contiguity, device, dtype) and look its reduction up in a
cache; refuse a closed communicator; number the operation; make a handle that names
it; ask whether tracing is on; give ``Iallreduce`` a buffer spec kept by address,
length and dtype; test the request once, and if it is pending note it (with the time)
for the deadline queues, which take the iteration's notes in one loop callback; in
``await``, test it 32 times before parking on a future a poll callback settles. It
does not ask for the loop's turn (fairness), learn how long to hurry, check a debug
fingerprint, fail fast on a lost peer or word errors: asyncomm does those too.

It prints, per round, the blocking ``Allreduce`` of 8 bytes (raw), the busy-poll bridge
and this awaitable (``awaited_rounds.py``; see docs/benchmarks.md, "What these say").
"""

import asyncio
import time
from typing import Any

import torch
import uvloop
from awaited_rounds import rounds
from mpi4py import MPI

comm = MPI.COMM_WORLD
TESTS = 32
DATATYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}
STATUS = MPI.Status()
TEST = MPI.Request.Test
_specs: dict[tuple[int, int, torch.dtype], list[Any]] = {}


def spec(t: torch.Tensor) -> list[Any]:
    key = (t.data_ptr(), t.nbytes, t.dtype)
    made = _specs.get(key)
    if made is None:
        made = _specs[key] = [MPI.buffer.fromaddress(key[0], key[1]), DATATYPES[key[2]]]
    return made


class Handle:
    __slots__ = ("keep", "loop", "request", "state", "value", "waiters", "what")

    def __init__(self, loop: asyncio.AbstractEventLoop, what: tuple[Any, ...], value: Any,
                 keep: Any) -> None:
        self.loop, self.what, self.value, self.keep = loop, what, value, keep
        self.state, self.request, self.waiters = 0, None, None

    def __await__(self):  # type: ignore[no-untyped-def]
        if self.state == 0:
            request = self.request
            for _ in range(TESTS):
                if TEST(request, STATUS):
                    self.state, self.keep = 1, None
                    return self.value
            future = self.loop.create_future()
            self.waiters = [future]
            yield from future
        return self.value


pending: list[Handle] = []
fresh: list[tuple[Handle, float]] = []  # this iteration's pending handles, for the deadlines


def enlist() -> None:
    pending.extend(h for h, _ in fresh if h.state == 0)
    fresh.clear()
    if pending:
        asyncio.get_running_loop().call_soon(poll)


def poll() -> None:
    for h in [h for h in pending if h.state == 0 and TEST(h.request, STATUS)]:
        h.state = 1
        for waiter in h.waiters or ():
            waiter.set_result(None)
    pending[:] = [h for h in pending if h.state == 0]
    if pending:
        asyncio.get_running_loop().call_soon(poll)


class Comm:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.closed, self.seq, self.trace = loop, False, 0, None
        self.rank, self.dtypes, self.cuda = comm.rank, frozenset(DATATYPES), False
        self.ops: dict[tuple[str, torch.dtype], Any] = {}

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> Handle:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("all_reduce: a tensor")
        if not tensor.is_contiguous():
            raise ValueError("all_reduce: a contiguous tensor")
        if tensor.is_cuda != self.cuda or tensor.dtype not in self.dtypes:
            raise TypeError("all_reduce: a CPU tensor of a dtype MPI moves")
        mpi_op = self.ops.get((op, tensor.dtype))
        if mpi_op is None:
            mpi_op = self.ops[(op, tensor.dtype)] = MPI.SUM
        if self.closed:
            raise RuntimeError("all_reduce: closed")
        self.seq += 1
        h = Handle(self.loop, (self.rank, "all_reduce", self.seq, None, None), tensor, tensor)
        if self.trace is not None:
            self.trace(h)
        h.request = request = comm.Iallreduce(MPI.IN_PLACE, spec(tensor), mpi_op)
        if TEST(request, STATUS):
            h.state, h.keep = 1, None
        else:
            if not fresh:
                self.loop.call_soon(enlist)
            fresh.append((h, time.monotonic()))
        return h


async def main() -> None:
    ours = Comm(asyncio.get_running_loop())
    await rounds("duties", ours.all_reduce)


uvloop.run(main())
