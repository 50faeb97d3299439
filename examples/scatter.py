"""Scatter: rank 0 hands chunk i of its list to rank i (itself included).

On 4 ranks rank 0 prints ``Rank 0 scatter list: [1.0, 2.0, 3.0, 4.0]`` and every
rank prints ``Rank N received tensor: N+1``.

    asyncomm run -n 4 examples/scatter.py
    asyncomm run -n 4 --backend mpi examples/scatter.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    my_tensor = torch.zeros(1)
    scatter_list: list[torch.Tensor] | None = None
    if comm.rank == 0:  # only the source prepares the chunks
        scatter_list = [torch.tensor([i + 1.0]) for i in range(comm.size)]
        print(f"Rank 0 scatter list: {[t.item() for t in scatter_list]}")
    await comm.scatter(my_tensor, scatter_list, src=0)
    print(f"Rank {comm.rank} received tensor: {my_tensor.item()}")


if __name__ == "__main__":
    asyncomm.run(main)
