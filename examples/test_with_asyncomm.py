"""Testing your own distributed code with the asyncomm pytest plugin.

With asyncomm installed, pytest loads its plugin: a coroutine test whose one
parameter is ``comm`` runs on every rank of a real world (2 gloo ranks unless a
marker says otherwise), and fails with the traceback of every rank that raised::

    pytest examples/test_with_asyncomm.py
"""

import asyncio

import pytest
import torch

import asyncomm


async def test_a_sum_on_two_ranks(comm: asyncomm.Comm) -> None:
    t = torch.tensor([comm.rank + 1.0])
    await comm.all_reduce(t)
    assert t.item() == comm.size * (comm.size + 1) / 2


@pytest.mark.asyncomm(ranks=3, backends=("gloo", "mpi"))
async def test_a_ring_on_three_ranks_of_each_backend(comm: asyncomm.Comm) -> None:
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = torch.zeros(1)
    incoming = comm.recv(got, left, tag=9)
    await asyncio.gather(comm.send(torch.tensor([float(comm.rank)]), right, tag=9), incoming)
    assert got.item() == left


class Counter(asyncomm.Actor):
    def __init__(self) -> None:
        self.total = 0

    @asyncomm.endpoint
    async def add(self, k: int) -> int:
        self.total += k
        return self.total


@pytest.mark.asyncomm(ranks=3)
async def test_an_actor_served_on_a_fresh_communicator(comm: asyncomm.Comm) -> None:
    # Pooled worlds serve many tests: a communicator of the test's own starts clean.
    async with asyncomm.testing.fresh(comm) as mine:
        if mine.rank == 0:
            mine.serve(Counter(), "counter")
        await mine.barrier()
        if mine.rank != 0:
            await mine.actor(0, "counter").add(mine.rank)
        await mine.barrier()
        if mine.rank == 0:
            assert await mine.actor(0, "counter").add(0) == sum(range(mine.size))
