"""Actors on real gloo and MPI worlds: calls, tells, errors, ordering, deadlines, closing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World, fresh, run_script


class Ledger(asyncomm.Actor):
    """Records calls; one at a time, or ``overlaps`` would count."""

    def __init__(self) -> None:
        self.entries: list[list[int]] = []
        self.busy = False
        self.overlaps = 0

    @asyncomm.endpoint
    async def record(self, src: int, i: int) -> int:
        if self.busy:
            self.overlaps += 1
        self.busy = True
        await asyncio.sleep(0.001)  # give another call the chance to overlap
        self.entries.append([src, i])
        self.busy = False
        return len(self.entries)

    @asyncomm.endpoint
    def summary(self) -> dict[str, object]:
        return {"entries": self.entries, "overlaps": self.overlaps}

    @asyncomm.endpoint
    def double(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    @asyncomm.endpoint
    def fail(self, text: str) -> None:
        raise KeyError(text)

    @asyncomm.endpoint
    async def slow(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"

    def private(self) -> int:
        return 1


async def check_calls_and_tells(comm: Comm) -> None:
    name = "ledger"
    if comm.rank == 0:
        comm.serve(Ledger(), name)
        with pytest.raises(ValueError, match=r"already|served"):
            comm.serve(Ledger(), name)
        with pytest.raises(TypeError):
            comm.serve(object(), "x")  # type: ignore[arg-type]
    await comm.barrier()
    ref = comm.actor(0, name)
    for i in range(10):  # tells and calls from one rank keep their order
        ref.record.tell(comm.rank, i)
    assert await ref.record(comm.rank, 10) >= 11
    doubled = await ref.double(torch.arange(4.0))
    assert doubled.tolist() == [0.0, 2.0, 4.0, 6.0]
    await comm.barrier()
    summary = await ref.summary()
    assert summary["overlaps"] == 0  # one call at a time
    mine = [i for src, i in summary["entries"] if src == comm.rank]
    assert mine == list(range(11))
    assert len(summary["entries"]) == 11 * comm.size
    await comm.barrier()


def test_calls_and_tells(world: World) -> None:
    world.run(check_calls_and_tells)


async def check_errors(comm: Comm) -> None:
    if comm.rank == 1:
        comm.serve(Ledger(), "errors")
    await comm.barrier()
    ref = comm.actor(1, "errors")
    with pytest.raises(asyncomm.RemoteError) as info:
        await ref.fail("no such key")
    assert info.value.rank == 1
    assert "KeyError" in str(info.value) and "no such key" in str(info.value)
    assert "raise KeyError" in info.value.remote_traceback
    with pytest.raises(asyncomm.RemoteError, match="no endpoint 'private'"):
        await ref.private()
    with pytest.raises(asyncomm.RemoteError, match="no actor named 'nobody'"):
        await comm.actor(1, "nobody").anything()
    with pytest.raises(asyncomm.CommTimeoutError, match=r"errors\.slow on rank 1"):
        await ref.slow(1.0, timeout=0.3)  # (every rank calls: served one after the other)
    with pytest.raises(ValueError):
        comm.actor(comm.size, "errors")
    with pytest.raises(TypeError, match="default codec cannot carry"):
        await ref.double(object())
    with pytest.raises(TypeError, match="default codec cannot carry"):
        ref.double.tell({1, 2})
    assert await ref.double(torch.ones(1)) is not None  # still serving
    await comm.barrier()


def test_remote_errors_and_deadlines(world: World) -> None:
    world.run(check_errors)


async def check_closed_rank(comm: Comm) -> None:
    sub = await comm.group(range(comm.size))
    assert sub is not None
    if sub.rank == 0:
        sub.serve(Ledger(), "leaving")
    await sub.barrier()
    if sub.rank == 0:
        await sub.close()  # waits until every other rank closed too
    else:
        ref = sub.actor(0, "leaving")
        deadline = time.monotonic() + 60  # (bounded: a goodbye never said fails the test)
        with pytest.raises(asyncomm.CommClosedError, match="rank 0"):
            while time.monotonic() < deadline:  # until rank 0's goodbye arrives
                await ref.record(sub.rank, 0, timeout=30)
                await asyncio.sleep(0.02)
        await sub.close()
    await comm.barrier()


def test_call_to_a_closed_rank_raises(world: World) -> None:
    world.run(check_closed_rank)


TELL_THEN_EXIT = """
import asyncio, asyncomm

class Box(asyncomm.Actor):
    def __init__(self):
        self.done = asyncio.Event()

    @asyncomm.endpoint
    async def release(self):
        self.done.set()

async def main(comm):
    if comm.rank == 0:
        box = Box()
        comm.serve(box, name="box")
        await asyncio.wait_for(box.done.wait(), 20)
        print("released", flush=True)
    else:
        comm.actor(0, "box").release.tell()  # and return at once: close must send it

asyncomm.run(main)
"""


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_tell_just_before_closing_is_delivered(tmp_path: Path, backend: str) -> None:
    proc = run_script(TELL_THEN_EXIT, tmp_path, 2, backend)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "released" in proc.stdout



async def check_not_served_yet(comm: Comm) -> None:
    # Every rank answers a call to an actor it does not serve (yet) in the same way.
    with pytest.raises(asyncomm.RemoteError, match="no actor named 'later'"):
        await comm.actor((comm.rank + 1) % comm.size, "later").ping(timeout=10)
    await comm.barrier()


def test_an_actor_not_served_yet_is_a_lookup_error(world: World) -> None:
    world.run(check_not_served_yet)


async def check_long_timeout(comm: Comm) -> float | None:
    # A call's timeout beyond a couple of seconds has no timer of its own: the reply loop
    # expires it (it looks every quarter second), not before its deadline and long before
    # the reply comes: the timeout error itself says it expired before the reply.
    async with fresh(comm) as sub:
        if sub.rank == 1:
            sub.serve(Ledger(), "patient")
        await sub.barrier()
        elapsed = None
        if sub.rank == 0:
            ref = sub.actor(1, "patient")
            start = time.monotonic()
            with pytest.raises(asyncomm.CommTimeoutError, match=r"patient\.slow on rank 1 timed "
                               r"out after 2\.1 s"):
                await ref.slow(3.0, timeout=2.1)
            elapsed = time.monotonic() - start
            assert await ref.double(2) == 4  # still serving, the late reply dropped
        await sub.barrier()
        return elapsed


def test_a_long_call_timeout_fires_without_a_timer_of_its_own(world: World) -> None:
    elapsed = world.run(check_long_timeout)[0]
    assert elapsed is not None and elapsed >= 2.1, elapsed
