"""Channels: two ranks bounce a tensor back and forth and time the round trip.

``comm.channel(tag)`` is a stream of messages between ranks: ``await ch.send(obj,
dst)`` and ``msg = await ch.recv(src)``, where ``msg.data`` is what was sent
(tensors travel as raw bytes, no pickle) and ``msg.src`` who sent it. Unlike
``comm.recv`` there is no buffer to preallocate: the message says its own shape.

Rank 0 sends a tensor to rank 1, which adds one and sends it back, ``ROUNDS``
times; rank 0 prints the mean round-trip time. Ranks beyond 1 have nothing to do
and just close the channel.

    asyncomm run -n 2 examples/channel_pingpong.py
    asyncomm run -n 2 --backend mpi examples/channel_pingpong.py
"""

import time

import torch

import asyncomm

ROUNDS = 100


async def main(comm: asyncomm.Comm) -> None:
    if comm.size < 2:
        print("channel_pingpong needs at least 2 ranks: "
              "asyncomm run -n 2 examples/channel_pingpong.py")
        return
    ch = comm.channel(1)
    if comm.rank == 0:
        ball = torch.zeros(4)
        await ch.send(ball, 1)  # one warm-up round trip
        ball = (await ch.recv(1)).data
        start = time.perf_counter()
        for _ in range(ROUNDS):
            await ch.send(ball, 1)
            ball = (await ch.recv(1)).data
        elapsed = time.perf_counter() - start
        print(f"ping-pong: {ROUNDS + 1} round trips, ball = {ball[0].item():g}")
        print(f"round trip: {elapsed / ROUNDS * 1e6:.0f} us")
    elif comm.rank == 1:
        for _ in range(ROUNDS + 1):
            msg = await ch.recv(0)
            await ch.send(msg.data + 1, msg.src)
    await ch.close()


if __name__ == "__main__":
    asyncomm.run(main)
