"""``asyncomm bench soak``: a randomised mix of traffic, every result checked.

Each round, every rank draws the same operations from a shared seed --
collectives of random sizes and dtypes, a ring of sends and receives, channel
messages to every other rank, actor calls -- issues them all at once, then
checks each result against what arithmetic says it must be. Rank 0 decides
when time is up (a broadcast each round). Any wrong result, error or hang
(every await has a deadline) fails the run with a non-zero exit.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import asyncomm
from asyncomm import Comm

KINDS = ("all_reduce", "broadcast", "all_gather", "ring", "channel", "actor")
DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
DEADLINE_S = 60.0
MAX_OPS = 8  # issued at once in a round
CHANNEL_TAG = RING_TAG = 7_000  # plus the index of the operation in its round

Check = Callable[[], None]


class Adder(asyncomm.Actor):
    """The soak's actor: answers with the sum of its arguments."""

    @asyncomm.endpoint
    async def add(self, a: int, b: int) -> int:
        return a + b


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"soak: wrong result: {what}")


def _size(rng: random.Random) -> int:
    return rng.choice((1, 7, 64, 1000, rng.randrange(1, 1 << 16)))


def _issue(comm: Comm, kind: str, rng: random.Random, step: int, index: int,
           ch: asyncomm.Channel, waits: list[Awaitable[Any]], checks: list[Check]) -> None:
    """Issue the ``index``-th operation of a round; queue what to await and how to check it.

    Operations of one round that match by tag (ring, channel) use tags of their own.
    """
    me, n = comm.rank, comm.size
    if kind == "all_reduce":
        dtype, size = rng.choice(DTYPES), _size(rng)
        t = torch.full((size,), me + 1 + step % 5, dtype=dtype)
        waits.append(comm.all_reduce(t, timeout=DEADLINE_S))
        want = n * (n + 1) // 2 + n * (step % 5)
        checks.append(lambda: _expect(bool((t == want).all()), f"all_reduce {dtype} {size}"))
    elif kind == "broadcast":
        root, dtype, size = rng.randrange(n), rng.choice(DTYPES), _size(rng)
        t = torch.full((size,), root * 7 + step if me == root else -1, dtype=dtype)
        waits.append(comm.broadcast(t, root, timeout=DEADLINE_S))
        checks.append(lambda: _expect(bool((t == root * 7 + step).all()), f"broadcast {root}"))
    elif kind == "all_gather":
        size = _size(rng)
        handle = comm.all_gather(torch.full((size,), me * 3 + step), timeout=DEADLINE_S)
        waits.append(handle)
        checks.append(lambda: _expect(
            all(bool((part == r * 3 + step).all()) for r, part in enumerate(handle.result())),
            f"all_gather {size}"))
    elif kind == "ring":
        size = _size(rng)
        out, into = torch.full((size,), me + step, dtype=torch.int64), torch.empty(size,
                                                                                    dtype=torch.int64)
        left, right = (me - 1) % n, (me + 1) % n
        waits += [comm.send(out, right, RING_TAG + index, timeout=DEADLINE_S),
                  comm.recv(into, left, RING_TAG + index, timeout=DEADLINE_S)]
        checks.append(lambda: _expect(bool((into == left + step).all()), f"ring {size}"))
    elif kind == "channel":
        size = _size(rng)
        for dst in range(n):
            if dst != me:
                waits.append(ch.send({"src": me, "step": step, "t": torch.full((size,), me)},
                                     dst, timeout=DEADLINE_S))
        got: list[Any] = []

        async def receive() -> None:
            # From each source in turn: a peer that finished this round may already have
            # sent on this channel for the next, and only per-source order tells them apart.
            for src in order:
                got.append(await ch.recv(src, timeout=DEADLINE_S))

        order = [r for r in range(n) if r != me]
        rng.shuffle(order)
        waits.append(receive())
        checks.append(lambda: _expect(
            all(m.data["src"] == m.src and m.data["step"] == step
                and bool((m.data["t"] == m.src).all()) for m in got)
            and sorted(m.src for m in got) == sorted(order), "channel messages"))
    else:  # actor
        ref = comm.actor((me + 1) % n, "soak-adder")
        answer: list[int] = []

        async def call() -> None:
            answer.append(await ref.add(step, me, timeout=DEADLINE_S))

        waits.append(call())
        checks.append(lambda: _expect(answer == [step + me], "actor call"))


async def soak(comm: Comm, seconds: float, seed: int) -> dict[str, Any]:
    """Run rounds for ``seconds``; return this rank's counts (raises on a wrong result)."""
    rng = random.Random(seed)
    channels = [comm.channel(CHANNEL_TAG + i) for i in range(MAX_OPS)]  # one per op of a round
    comm.serve(Adder(), "soak-adder")
    await comm.barrier(timeout=DEADLINE_S)
    counts: collections.Counter[str] = collections.Counter()
    start, rounds, step = time.monotonic(), 0, 0
    go = torch.zeros(1, dtype=torch.int64)
    while True:
        go.fill_(int(time.monotonic() - start < seconds))
        await comm.broadcast(go, 0, timeout=DEADLINE_S)
        if not go.item():
            break
        rounds += 1
        waits: list[Awaitable[Any]] = []
        checks: list[Check] = []
        for i in range(rng.randint(1, MAX_OPS)):
            kind = rng.choice(KINDS)
            step += 1
            counts[kind] += 1
            _issue(comm, kind, rng, step, i, channels[i], waits, checks)
        await asyncio.gather(*waits)
        for check in checks:
            check()
    await comm.barrier(timeout=DEADLINE_S)
    return {"rounds": rounds, "ops": dict(counts), "seconds": time.monotonic() - start}


def run(seconds: float) -> int:
    """Every rank's part of ``asyncomm bench soak``: soak, then rank 0 reports."""
    async def main(comm: Comm) -> tuple[int, dict[str, Any]]:
        return comm.rank, await soak(comm, seconds, seed=0)

    rank, result = asyncomm.run(main)
    if rank == 0:
        ops = ", ".join(f"{kind} {count}" for kind, count in sorted(result["ops"].items()))
        print(f"soak: {result['rounds']} rounds in {result['seconds']:.1f} s, every result "
              f"checked, no errors; operations per rank: {ops}", flush=True)
    return 0
