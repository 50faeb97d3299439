"""Point-to-point: ``send`` and ``recv`` between two specific ranks.

1. Rank 0 sends a tensor to every other rank: it issues all the sends, then
   awaits them together; rank r prints ``Rank r received tensor: 10r from rank 0``.
2. A ring: every rank sends to its right neighbour and receives from its left.
   With blocking send/recv every rank would wait in its send for a receive that
   is never posted; here both operations are issued before either is awaited,
   so there is no deadlock. Rank r prints ``Rank r ring: got r-1 from rank r-1``
   (mod size).

Needs at least 2 ranks:

    asyncomm run -n 4 examples/send_recv.py
    asyncomm run -n 4 --backend mpi examples/send_recv.py
"""

import asyncio

import torch

import asyncomm


async def main(comm: asyncomm.Comm) -> None:
    if comm.size < 2:
        print("send_recv needs at least 2 ranks: asyncomm run -n 4 examples/send_recv.py")
        return

    # 1. One to many: rank 0 has all sends in flight at once.
    if comm.rank == 0:
        payloads = {dst: torch.tensor([10.0 * dst]) for dst in range(1, comm.size)}
        await asyncio.gather(*(comm.send(t, dst) for dst, t in payloads.items()))
        print(f"Rank 0 sent tensors to ranks {list(payloads)}")
    else:
        tensor = torch.zeros(1)
        src = await comm.recv(tensor, src=0)
        print(f"Rank {comm.rank} received tensor: {tensor.item()} from rank {src}")

    # 2. Ring exchange: issue the receive and the send, then await both.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    outgoing, incoming = torch.tensor([float(comm.rank)]), torch.zeros(1)
    received = comm.recv(incoming, src=left, tag=1)
    sent = comm.send(outgoing, dst=right, tag=1)
    await asyncio.gather(sent, received)
    print(f"Rank {comm.rank} ring: got {incoming.item()} from rank {left}")


if __name__ == "__main__":
    asyncomm.run(main)
