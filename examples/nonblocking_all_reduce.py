"""Non-blocking all-reduce: compute while the reduction is in flight.

``comm.all_reduce(t)`` issues the operation at once and returns a handle; the
rank goes on computing and only awaits the handle when it needs the result
(the counterpart of ``async_op=True`` and ``work.wait()``). Rank r contributes
r, so on 4 ranks every rank prints ``Rank N async all_reduce result: 6.0``.

    asyncomm run -n 4 examples/nonblocking_all_reduce.py
    asyncomm run -n 4 --backend mpi examples/nonblocking_all_reduce.py
"""

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    tensor = torch.ones(1) * comm.rank
    handle = comm.all_reduce(tensor, op="sum")  # issued now, in flight from here on
    # Other work while the communication happens (do not touch `tensor` meanwhile).
    x = torch.randn(256, 256)
    for _ in range(10):
        x = torch.tanh(x @ x.T / 256)
    await handle  # now `tensor` holds the reduced result
    print(f"Rank {comm.rank} async all_reduce result: {tensor.item()}")


if __name__ == "__main__":
    asyncomm.run(main)
