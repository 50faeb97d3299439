"""Reduce: sum one tensor over all ranks, but only rank 0 gets the total.

Rank r contributes r + 1; on 4 ranks rank 0 prints ``Rank 0 final tensor: 10.0``
and the others ``Rank N sent tensor: N+1`` (their buffer's content afterwards is
unspecified, so they print what they contributed).

    asyncomm run -n 4 examples/reduce.py
    asyncomm run -n 4 --backend mpi examples/reduce.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    mine = comm.rank + 1.0
    tensor = torch.tensor([mine])
    await comm.reduce(tensor, dst=0, op="sum")
    if comm.rank == 0:
        print(f"Rank 0 final tensor: {tensor.item()}")
    else:
        print(f"Rank {comm.rank} sent tensor: {mine}")


if __name__ == "__main__":
    asyncomm.run(main)
