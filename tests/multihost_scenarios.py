"""What every rank of a multi-host world checks (run by tests/test_hosts.py, 4 ranks on 2 hosts).

Collectives, the tutorial's examples (and those of channels and actors), any-source
point-to-point, channels, an actor, GradSync against a local reference, and a
pipeline step; then a 4 MiB message from each host to
the other (so the test can see traffic cross the link). Prints
``scenarios ok RANK HOSTNAME`` at the end. Arguments: a backend name (else
the automatic choice), ``--one-host`` where all ranks share one host (Slurm's test: collectives,
point-to-point, channels and an actor only).
"""
# ruff: noqa: E402  (see the first statement)

import faulthandler
import signal

# A test that finds the ranks stuck asks for their stacks, from here on: imports too.
faulthandler.register(signal.SIGUSR1, all_threads=True)

import contextlib
import importlib.util
import io
import socket
import sys
from pathlib import Path

import torch
from torch import nn

import asyncomm
from asyncomm import pipeline

HOSTS = 1 if "--one-host" in sys.argv else 2  # how many hosts the ranks are on


class Counter(asyncomm.Actor):
    def __init__(self) -> None:
        self.n = 0

    @asyncomm.endpoint
    async def add(self, k: int) -> int:
        self.n += k
        return self.n


async def collectives(comm: asyncomm.Comm) -> None:
    t = torch.tensor([comm.rank + 1.0])
    await comm.all_reduce(t)
    assert t.item() == sum(range(1, comm.size + 1)), t
    b = torch.tensor([float(comm.rank)])
    await comm.broadcast(b, comm.size - 1)
    assert b.item() == comm.size - 1
    gathered = await comm.all_gather(torch.tensor([comm.rank]))
    assert [int(g) for g in gathered] == list(range(comm.size))
    names = await comm.all_gather_object(socket.gethostname())
    assert len(set(names)) == HOSTS, names


async def point_to_point(comm: asyncomm.Comm) -> None:
    if comm.rank == 0:  # any source: a message from every other rank
        got = torch.empty(1)
        sources = sorted([await comm.recv(got, None, tag=3) for _ in range(comm.size - 1)])
        assert sources == list(range(1, comm.size)), sources
    else:
        await comm.send(torch.tensor([float(comm.rank)]), 0, tag=3)


async def channels(comm: asyncomm.Comm) -> None:
    ch = comm.channel(7)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for i in range(20):
        await ch.send({"i": i, "t": torch.full((3,), float(comm.rank))}, right)
    for i in range(20):
        msg = await ch.recv(left)
        assert msg.data["i"] == i and msg.data["t"][0].item() == left


async def actors(comm: asyncomm.Comm) -> None:
    if comm.rank == comm.size - 1:
        comm.serve(Counter(), name="counter")
    await comm.barrier()
    ref = comm.actor(comm.size - 1, "counter")
    await ref.add(comm.rank + 1)
    await comm.barrier()
    total = await ref.add(0)
    assert total == sum(range(1, comm.size + 1)), total


async def gradsync(comm: asyncomm.Comm) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(comm.size * 4, 8, generator=torch.Generator().manual_seed(1))
    sync = asyncomm.GradSync(model, comm, bucket_mb=0.0005)
    model(x[comm.rank * 4:(comm.rank + 1) * 4]).sum().backward()
    await sync.wait()
    reference(x).sum().backward()  # one process, the whole batch: the sum over ranks
    for mine, whole in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.grad is not None and whole.grad is not None
        torch.testing.assert_close(mine.grad * comm.size, whole.grad, rtol=1e-4, atol=1e-5)


async def pipeline_step(comm: asyncomm.Comm) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(comm.size)))
    schedule = pipeline.get("1f1b", comm.size, 4)
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(model, schedule.n_stages),
                             nn.functional.mse_loss)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss = await pipe.step(x if pipe.first else None, y if pipe.last_stage else None)
    if pipe.last_stage:
        assert loss is not None and loss > 0


async def across(comm: asyncomm.Comm) -> None:
    """4 MiB from rank 0 (first host) to the last rank (second host), and back."""
    big = torch.ones(1 << 20)
    ch = comm.channel(9)
    if comm.rank == 0:
        await ch.send(big, comm.size - 1)
        assert (await ch.recv(comm.size - 1)).data.sum().item() == big.numel()
    elif comm.rank == comm.size - 1:
        got = (await ch.recv(0)).data
        await ch.send(got, 0)


TUTORIAL = ("broadcast", "all_reduce", "reduce", "scatter", "gather", "all_gather",
            "send_recv", "nonblocking_all_reduce", "channel_pingpong", "parameter_server")


async def tutorial(comm: asyncomm.Comm) -> None:
    """The examples of the torch.distributed tutorial, and of channels and actors, in turn."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    for name in TUTORIAL:
        spec = importlib.util.spec_from_file_location(f"example_{name}", examples / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(io.StringIO()):  # their words: checked by test_examples
            await module.main(comm)
        await comm.barrier()


async def main(comm: asyncomm.Comm) -> None:
    scenarios = [collectives, tutorial, point_to_point, channels, actors, gradsync,
                 pipeline_step, across]
    if HOSTS == 1:  # Slurm's one node: what reaches the world, not what the hosts' tests do
        scenarios = [collectives, point_to_point, channels, actors]
    for scenario in scenarios:
        await scenario(comm)
        await comm.barrier()
    print(f"scenarios ok {comm.rank} {socket.gethostname()}", flush=True)


if __name__ == "__main__":
    asyncomm.run(main, backend=next((a for a in sys.argv[1:] if not a.startswith("-")), None))
