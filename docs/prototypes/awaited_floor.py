"""The floor under an awaited MPI all_reduce, for measuring only.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/awaited_floor.py``
(mpi4py, uvloop, torch). It prints, per round, the blocking ``Allreduce`` of 8 bytes
(raw), the bridge people write by hand (``Iallreduce``, then ``while not req.Test():
await asyncio.sleep(0)``) and the floor of an awaitable: a slotted object whose
``__await__`` tests the request 32 times and then parks on a future that one loop
callback settles. No argument checks, no deadline, no error wording, no tracing: what
any awaitable request must cost (see docs/benchmarks.md, "What these say").
"""

import asyncio

import torch
import uvloop
from awaited_rounds import rounds
from mpi4py import MPI

comm = MPI.COMM_WORLD
TESTS = 32


class Awaited:
    """One request: tested inline first, then by the loop callback ``poll``."""

    __slots__ = ("future", "loop", "request")

    def __init__(self, request: MPI.Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request, self.loop, self.future = request, loop, None

    def __await__(self):  # type: ignore[no-untyped-def]
        request = self.request
        for _ in range(TESTS):
            if request.Test():
                return None
        self.future = self.loop.create_future()
        pending.append(self)
        if len(pending) == 1:
            self.loop.call_soon(poll)
        yield from self.future


pending: list[Awaited] = []


def poll() -> None:
    for done in [p for p in pending if p.request.Test()]:
        pending.remove(done)
        done.future.set_result(None)  # type: ignore[union-attr]
    if pending:
        asyncio.get_running_loop().call_soon(poll)


async def main() -> None:
    loop = asyncio.get_running_loop()

    def issue(t: torch.Tensor) -> Awaited:
        if type(t) is not torch.Tensor or not t.is_contiguous() or t.is_cuda:
            raise TypeError("a contiguous CPU tensor")
        spec = [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), MPI.FLOAT]
        return Awaited(comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM), loop)

    await rounds("floor", issue)


uvloop.run(main())
