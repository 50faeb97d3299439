"""Gather: every rank sends its tensor to rank 0, which gets them in rank order.

On 4 ranks rank 0 prints ``Rank 0 gathered list: [1.0, 2.0, 3.0, 4.0]`` and the
others ``Rank N sent tensor: N+1``.

    asyncomm run -n 4 examples/gather.py
    asyncomm run -n 4 --backend mpi examples/gather.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    my_tensor = torch.tensor([comm.rank + 1.0])
    gathered = await comm.gather(my_tensor, dst=0)  # the list on rank 0, None elsewhere
    if gathered is not None:
        print(f"Rank 0 gathered list: {[t.item() for t in gathered]}")
    else:
        print(f"Rank {comm.rank} sent tensor: {my_tensor.item()}")


if __name__ == "__main__":
    asyncomm.run(main)
