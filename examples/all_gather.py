"""All-gather: like gather, but every rank gets the list of all ranks' tensors.

On 4 ranks every rank prints ``Rank N gathered list: [1.0, 2.0, 3.0, 4.0]``.

    asyncomm run -n 4 examples/all_gather.py
    asyncomm run -n 4 --backend mpi examples/all_gather.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    my_tensor = torch.tensor([comm.rank + 1.0])
    gathered = await comm.all_gather(my_tensor)  # size tensors, in rank order
    print(f"Rank {comm.rank} gathered list: {[t.item() for t in gathered]}")


if __name__ == "__main__":
    asyncomm.run(main)
