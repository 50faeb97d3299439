"""All-reduce: sum one tensor over all ranks; every rank gets the total.

Rank r contributes r + 1, so on 4 ranks every rank ends with 1 + 2 + 3 + 4 = 10:
prints ``Rank N initial tensor: N+1`` then ``Rank N final tensor: 10.0``.

    asyncomm run -n 4 examples/all_reduce.py
    asyncomm run -n 4 --backend mpi examples/all_reduce.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    tensor = torch.tensor([comm.rank + 1], dtype=torch.float32)
    print(f"Rank {comm.rank} initial tensor: {tensor.item()}")
    await comm.all_reduce(tensor, op="sum")  # in place, on every rank
    print(f"Rank {comm.rank} final tensor: {tensor.item()}")


if __name__ == "__main__":
    asyncomm.run(main)
