"""Broadcast: rank 0 sends a tensor to every other rank.

Every rank starts with a zero; after ``await comm.broadcast(tensor, src=0)`` each
holds rank 0's value. Prints ``Rank N has data: 1.0`` on every rank.

    asyncomm run -n 4 examples/broadcast.py
    asyncomm run -n 4 --backend mpi examples/broadcast.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    tensor = torch.zeros(1)
    if comm.rank == 0:
        tensor += 1  # the source rank creates the data
    await comm.broadcast(tensor, src=0)
    print(f"Rank {comm.rank} has data: {tensor.item()}")


if __name__ == "__main__":
    asyncomm.run(main)
