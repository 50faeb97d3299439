"""Two versions of asyncomm side by side in one process: their 8-byte channel ping-pongs
(or awaited send/recv ping-pongs, or awaited all-reduces), alternated block by block, for
measuring only.

Not part of asyncomm. A change that takes a few percent off a message is lost in the
noise of separate launches on a shared machine (the same code reads 4.5x in one launch
and 5.1x in the next); alternating both versions in the same processes, each block on a
fresh communicator, shares that noise between them. Run with

    python docs/prototypes/ab_pingpong.py OLD NEW [BLOCKS [channel|awaited|all_reduce|actor|rate]]

where OLD and NEW are folders that each hold an ``asyncomm`` package (``git archive REV
asyncomm | tar -x -C OLD``; both built: ``PYTHONPATH=OLD python -m asyncomm build``). It
copies each under a name of its own, then runs 2 ranks under ``mpiexec``; rank 0 prints
both medians (one-way, µs; an all-reduce's whole time; half an actor call; a message of a
burst), their ratio and in how many blocks NEW was faster. Two copies of the same code read 0.99-1.01. uvloop runs where it
is installed, as under ``asyncomm.run``.
"""

import asyncio
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

N = 5000  # round trips a block


def renamed(source: str, name: str, into: str) -> None:
    """Copy ``source``/asyncomm to ``into``/``name``, its own imports renamed."""
    target = os.path.join(into, name)
    shutil.copytree(os.path.join(source, "asyncomm"), target)
    imports = re.compile(r"\b(from|import) asyncomm\b|[\"']asyncomm\.")
    for folder, _, files in os.walk(target):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    text = f.read()
                text = imports.sub(lambda m: m.group(0).replace("asyncomm", name), text)
                with open(path, "w") as f:
                    f.write(text)


async def one_way(comm, n: int, what: str) -> float:
    import torch

    ch, peer, t = comm.channel(1), 1 - comm.rank, torch.zeros(2)
    start = time.perf_counter()
    if what == "all_reduce":
        for _ in range(n):
            await comm.all_reduce(t)
        return (time.perf_counter() - start) / n * 1e6
    if what == "rate":  # 64 small dicts one after the other, then an ack (µs a message)
        small, ack, message = comm.channel(2), comm.channel(3), {"step": 0, "ids": [1, 2]}
        rounds = n // 64
        for _ in range(rounds):
            if comm.rank == 0:
                for _ in range(64):
                    await small.send(message, peer)
                await ack.recv(peer)
            else:
                for _ in range(64):
                    await small.recv(peer)
                await ack.send(0, peer)
        return (time.perf_counter() - start) / (rounds * 64) * 1e6
    if what == "actor":  # rank 0 calls, rank 1 serves: one call a round trip
        if comm.rank == 0:
            ref = comm.actor(1, "echo")
            for _ in range(n):
                await ref.echo(t)
        await comm.barrier()
        return (time.perf_counter() - start) / n / 2 * 1e6
    if what == "awaited":
        first, second = ((lambda: comm.send(t, peer, 5)), (lambda: comm.recv(t, peer, 5)))
    else:
        first, second = (lambda: ch.send(t, peer)), (lambda: ch.recv(peer))
    if comm.rank == 1:
        first, second = second, first
    for _ in range(n):
        await first()
        await second()
    return (time.perf_counter() - start) / n / 2 * 1e6


async def block(package, what: str) -> tuple[float, int]:
    async with package.init(backend="mpi") as comm:
        if what == "actor":
            class Echo(package.Actor):
                @package.endpoint
                def echo(self, x: object) -> object:
                    return x

            comm.serve(Echo(), "echo")
            await comm.barrier()
        await one_way(comm, 1000, what)
        return await one_way(comm, N, what), comm.rank


async def compare(blocks: int, what: str) -> None:
    old, new = importlib.import_module("asy_old"), importlib.import_module("asy_new")
    times: dict[str, list[float]] = {"old": [], "new": []}
    rank = 0
    for i in range(blocks):
        for name in (("old", "new") if i % 2 else ("new", "old")):
            value, rank = await block(old if name == "old" else new, what)
            times[name].append(value)
    if rank == 0:
        a, b = statistics.median(times["old"]), statistics.median(times["new"])
        wins = sum(y < x for x, y in zip(times["old"], times["new"], strict=True))
        print(f"old {a:.2f} us, new {b:.2f} us one way: new/old {b / a:.3f}, new faster in "
              f"{wins} of {blocks} blocks")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ranks":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(compare(int(sys.argv[2]), sys.argv[3]))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            renamed(sys.argv[1], "asy_old", scratch)
            renamed(sys.argv[2], "asy_new", scratch)
            blocks = sys.argv[3] if len(sys.argv) > 3 else "16"
            what = sys.argv[4] if len(sys.argv) > 4 else "channel"
            env = dict(os.environ, PYTHONPATH=scratch)
            subprocess.run(["mpiexec", "-n", "2", sys.executable, os.path.abspath(__file__),
                            "--ranks", blocks, what], env=env, check=True)
