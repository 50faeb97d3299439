"""A tour of asyncomm: every rank runs an event loop and awaits its communication.

    asyncomm run -n 4 examples/quickstart.py                  # 4 local ranks, gloo
    asyncomm run -n 4 --backend mpi examples/quickstart.py    # the same on MPI
    python examples/quickstart.py                             # a world of one rank

Each rank prints one line of results; rank 0 ends with an "ok" summary.
"""

import asyncio

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    rank, size = comm.rank, comm.size

    # 1. An all-reduce: every rank contributes rank + 1 and gets the sum.
    t = torch.tensor([rank + 1.0])
    await comm.all_reduce(t)
    assert t.item() == size * (size + 1) / 2

    # 2. Several operations in flight at once: issued now, awaited together.
    grads = [torch.full((1000,), float(rank)) for _ in range(4)]
    biggest = torch.tensor([rank])
    *_, everyone = await asyncio.gather(
        *(comm.all_reduce(g, "avg") for g in grads),
        comm.all_reduce(biggest, "max"),
        comm.all_gather(torch.tensor([rank * 10])),
    )
    assert all(g[0].item() == (size - 1) / 2 for g in grads) and biggest.item() == size - 1
    assert [x.item() for x in everyone] == [r * 10 for r in range(size)]

    # 3. A ring with an any-source receive: resolves to the rank it came from.
    came_from = None
    if size > 1:
        got = torch.empty(1)
        incoming = comm.recv(got, src=None, tag=7)  # issued before the send: no deadlock
        await comm.send(torch.tensor([float(rank)]), (rank + 1) % size, tag=7)
        came_from = await incoming
        assert came_from == (rank - 1) % size == int(got.item())

    # 4. Any picklable object, from rank 0 to everyone.
    config = await comm.broadcast_object({"lr": 0.1, "steps": 3} if rank == 0 else None, src=0)

    # 5. A group of the even ranks (renumbered 0..k-1); odd ranks get None.
    evens = await comm.group(range(0, size, 2))
    even_sum = None
    if evens is not None:
        even_sum = int((await evens.all_reduce(torch.tensor([rank]))).item())

    print(
        f"rank {rank}/{size}: sum={t.item():g} max={biggest.item()} "
        f"ring<-{came_from} config={config} evens={even_sum}"
    )
    await comm.barrier()
    if rank == 0:
        print(f"ok: {size} rank(s) on {comm.backend}, all checks passed")


if __name__ == "__main__":
    asyncomm.run(main)
