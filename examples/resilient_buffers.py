"""Trainers and replay buffers that survive a dead buffer: actor meshes, shrink, go on.

The ranks split in two: trainers (the first half; rank 0 also coordinates)
all-reduce their gradients in a group of their own, and replay buffers (the
rest) are one actor mesh, ``buffers = await comm.spawn(ReplayBuffer, ...)``.

- Each trainer step stores one trajectory in every live buffer at once
  (``buffers.alive().add.call(t)``: one message per buffer, one round trip)
  and counts it acknowledged once they all have it. A buffer that dies fails
  the calls to it with ``PeerFailedError``; the trainer stores the trajectory
  again in the buffers that are left, and training goes on.
- At the end every surviving rank calls ``comm.shrink()`` (gloo; MPI cannot go
  on without a rank and keeps ``comm``), the coordinator gathers what each
  trainer had acknowledged and checks that every live buffer holds all of it.

With ``--kill-after K`` the last buffer kills itself (SIGKILL) as its K-th
trajectory arrives, mid-run. Keep the others running with ``--keep-going``:

    asyncomm run -n 4 examples/resilient_buffers.py
    asyncomm run -n 4 --keep-going examples/resilient_buffers.py --kill-after 5
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal

import torch

import asyncomm

STEPS, PARAMS = 20, 10_000


class ReplayBuffer(asyncomm.Actor):
    def __init__(self, kill_after: int = 0) -> None:
        self.items: dict[tuple[int, int], torch.Tensor] = {}
        self.kill_after = kill_after

    @asyncomm.endpoint
    def add(self, key: tuple[int, int], states: torch.Tensor) -> None:
        if len(self.items) + 1 == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # dies before it acknowledges this one
        self.items[tuple(key)] = states  # type: ignore[index]

    @asyncomm.endpoint
    def keys(self) -> list[tuple[int, int]]:
        return sorted(self.items)


async def store(buffers: asyncomm.Mesh, key: tuple[int, int], states: torch.Tensor) -> None:
    """Store one trajectory in every live buffer; return once all of them have it."""
    while True:
        live = buffers.alive()
        if not live.ranks:
            raise RuntimeError("every replay buffer is gone")
        try:
            await live.add.call(key, states)
            return
        except asyncomm.PeerFailedError:  # a buffer died: the others are tried again
            continue


async def survivors(comm: asyncomm.Comm) -> asyncomm.Comm:
    """The communicator of the ranks still alive (``comm`` itself where it cannot shrink)."""
    try:
        return await comm.shrink()
    except NotImplementedError:
        return comm


async def main(comm: asyncomm.Comm, args: argparse.Namespace | None = None) -> None:
    kill_after = 0 if args is None else args.kill_after
    trainers = list(range(comm.size // 2))
    buffer_ranks = list(range(len(trainers), comm.size))
    train = await comm.group(trainers)
    mine = kill_after if comm.rank == buffer_ranks[-1] else 0
    buffers = await comm.spawn(ReplayBuffer, mine, name="buffers", ranks=buffer_ranks)
    acknowledged: list[tuple[int, int]] = []
    if train is not None:
        grad = torch.empty(PARAMS)
        for step in range(STEPS):
            grad.normal_()  # stands in for loss.backward()
            key = (comm.rank, step)
            await asyncio.gather(store(buffers, key, torch.randn(5, 4)),
                                 train.all_reduce(grad, "avg"))
            acknowledged.append(key)
        print(f"trainer {comm.rank}: {STEPS} steps, {len(acknowledged)} trajectories "
              "acknowledged")
    final = await survivors(comm)
    everyone = await final.all_gather_object(acknowledged)
    if comm.rank == 0:
        wanted = sorted(key for keys in everyone for key in keys)
        live = buffers.alive()
        held = await live.keys.call()
        assert all(keys == wanted for keys in held), "an acknowledged trajectory was lost"
        print(f"coordinator: {len(wanted)} acknowledged trajectories, all in each of "
              f"{len(live.ranks)} live buffer(s); buffers lost: {sorted(comm.failed)}")
    await final.barrier()  # the buffers serve until the coordinator has checked them
    if final is not comm:
        await final.close()


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-after", type=int, default=0, metavar="K",
                        help="the last buffer dies as its K-th trajectory arrives")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncomm.run(functools.partial(main, args=options()))
