"""The layout of a distributed GFlowNet trainer: trainers, replay buffers, a coordinator.

The ranks split into three roles (as in torchgfn's distributed trainer):

- training ranks (the first ones) form a data-parallel group,
  ``train = await comm.group(trainers)``, and all-reduce their gradients in it
  (fake ones here); each streams the "trajectories" it samples (dicts of
  tensors of varying length) to its replay-buffer rank over a channel;
- replay-buffer ranks store what arrives in a ``ReplayBuffer`` actor that
  anyone can query (``size()``, ``sample(k)``);
- the coordinator (the last rank) polls every buffer's ``size()`` until
  ``TARGET`` trajectories have arrived, then tells the trainers to stop over a
  control channel, waits for the buffers to drain, checks a sample, prints a
  summary and releases the buffers.

Trainers must leave their all-reduce loop on the same step, or one would wait
forever in a collective the others never join: each step also all-reduces a
"stop" flag (max), so the group stops as soon as any trainer has heard from the
coordinator. Shutdown is clean: every rank closes its channels (a buffer's
``async for`` over the trajectory channel ends once every other rank closed
it) and exits 0.

With 4 ranks: trainers 0-1, buffer 2, coordinator 3; with 8: trainers 0-4,
buffers 5-6, coordinator 7. Any N >= 3 works (one buffer per 4 ranks):

    asyncomm run -n 4 examples/gfn_layout.py
    asyncomm run -n 8 --backend mpi examples/gfn_layout.py
"""

import asyncio
import random
from collections import deque
from dataclasses import dataclass

import torch

import asyncomm

TARGET = 64  # trajectories the coordinator waits for
TRAJECTORIES, CONTROL = 1, 2  # channel tags
STATE_DIM, PARAMS = 4, 10_000


@dataclass(frozen=True)
class Layout:
    trainers: list[int]
    buffers: list[int]
    coordinator: int

    @classmethod
    def of(cls, size: int) -> "Layout":
        n_buffers = max(1, size // 4)
        n_trainers = size - 1 - n_buffers
        return cls(list(range(n_trainers)), list(range(n_trainers, size - 1)), size - 1)

    def buffer_of(self, trainer: int) -> int:
        return self.buffers[self.trainers.index(trainer) % len(self.buffers)]

    def trainers_of(self, buffer: int) -> list[int]:
        return [t for t in self.trainers if self.buffer_of(t) == buffer]


class ReplayBuffer(asyncomm.Actor):
    def __init__(self, capacity: int = 10_000) -> None:
        self.items: deque[dict[str, torch.Tensor]] = deque(maxlen=capacity)
        self.received = 0

    def add(self, trajectory: dict[str, torch.Tensor]) -> None:
        self.items.append(trajectory)
        self.received += 1

    @asyncomm.endpoint
    async def size(self) -> int:
        return len(self.items)

    @asyncomm.endpoint
    async def sample(self, k: int) -> list[dict[str, torch.Tensor]]:
        return random.sample(list(self.items), min(k, len(self.items)))


def fake_trajectory(rank: int, step: int) -> dict[str, torch.Tensor]:
    length = random.randint(3, 8)
    return {
        "states": torch.randn(length, STATE_DIM),
        "actions": torch.randint(0, STATE_DIM, (length,)),
        "log_reward": torch.randn(()),
        "origin": torch.tensor([rank, step]),
    }


async def trainer(comm: asyncomm.Comm, layout: Layout, train: asyncomm.Comm) -> None:
    trajectories, control = comm.channel(TRAJECTORIES), comm.channel(CONTROL)
    buffer = layout.buffer_of(comm.rank)
    stop = asyncio.ensure_future(control.recv(layout.coordinator))
    grad = torch.empty(PARAMS)
    steps = 0
    while True:
        grad.normal_()  # stands in for loss.backward()
        flag = torch.tensor([float(stop.done())])
        await asyncio.gather(  # all three in flight at once
            trajectories.send(fake_trajectory(comm.rank, steps), buffer),
            train.all_reduce(grad, "avg"),
            train.all_reduce(flag, "max"),
        )
        steps += 1
        if flag.item() > 0:  # someone in the group was told to stop: all stop here
            break
    await stop  # the coordinator tells every trainer
    await trajectories.close()
    await control.close()
    print(f"trainer {comm.rank}: stopped after {steps} steps, "
          f"sent {steps} trajectories to buffer {buffer}")


async def replay_buffer(comm: asyncomm.Comm, layout: Layout, store: ReplayBuffer) -> None:
    trajectories, control = comm.channel(TRAJECTORIES), comm.channel(CONTROL)
    await trajectories.close()  # this rank only receives on it
    async for msg in trajectories:  # ends once every trainer has closed its end
        store.add(msg.data)
    await control.send(store.received, layout.coordinator)  # drained
    await control.recv(layout.coordinator)  # keep serving until the coordinator is done
    await control.close()
    print(f"buffer {comm.rank}: stored {store.received} trajectories "
          f"from trainers {layout.trainers_of(comm.rank)}")


async def coordinator(comm: asyncomm.Comm, layout: Layout) -> None:
    trajectories, control = comm.channel(TRAJECTORIES), comm.channel(CONTROL)
    await trajectories.close()  # the coordinator sends no trajectories
    buffers = [comm.actor(b, "buffer") for b in layout.buffers]
    polls = 0
    while True:
        sizes = await asyncio.gather(*(b.size() for b in buffers))
        polls += 1
        if sum(sizes) >= TARGET:
            break
        await asyncio.sleep(0.005)
    print(f"coordinator: {TARGET}+ trajectories after {polls} polls; stopping the trainers")
    await asyncio.gather(*(control.send("stop", t) for t in layout.trainers))
    drained = [(await control.recv(b)).data for b in layout.buffers]
    sample = await buffers[0].sample(4)
    assert len(sample) == 4 and all(t["states"].shape[1] == STATE_DIM for t in sample)
    await asyncio.gather(*(control.send("stop", b) for b in layout.buffers))
    await control.close()
    print(f"coordinator: {sum(drained)} trajectories in {len(layout.buffers)} buffer(s), "
          f"sample of {len(sample)} ok")


async def main(comm: asyncomm.Comm) -> None:
    if comm.size < 3:
        if comm.rank == 0:
            print("gfn_layout needs at least 3 ranks: asyncomm run -n 4 examples/gfn_layout.py")
        return
    layout = Layout.of(comm.size)
    if comm.rank == layout.coordinator:
        print(f"layout: trainers {layout.trainers}, buffers {layout.buffers}, "
              f"coordinator {layout.coordinator}")
    train = await comm.group(layout.trainers)  # every rank takes part in making it
    store = ReplayBuffer()
    if comm.rank in layout.buffers:
        comm.serve(store, name="buffer")
    await comm.barrier()  # served before the coordinator calls: a call to no actor fails
    if train is not None:
        await trainer(comm, layout, train)
    elif comm.rank in layout.buffers:
        await replay_buffer(comm, layout, store)
    else:
        await coordinator(comm, layout)


if __name__ == "__main__":
    asyncomm.run(main)
