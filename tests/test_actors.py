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


class Notes(asyncomm.Actor):
    def __init__(self) -> None:
        self.notes: list[str] = []

    @asyncomm.endpoint
    def note(self, text: str) -> None:
        self.notes.append(text)

    @asyncomm.endpoint
    def read(self) -> list[str]:
        return self.notes


async def check_tells_before_serve(comm: Comm) -> list[str] | None:
    # Tells that reach a rank before it serves their actor are kept for it, in order, and
    # handed to it once it is served (a call then would fail at once: nothing to keep).
    async with fresh(comm) as sub:
        if sub.rank == 1:
            late = sub.actor(0, "late")
            late.note.tell("first")
            late.note.tell("second")
        elif sub.rank == 0:
            start = time.monotonic()
            while sum(map(len, sub._host._unserved.values())) < 2:  # both are here, held
                assert time.monotonic() - start < 20, "the tells never came"
                await asyncio.sleep(0.01)
            sub.serve(Notes(), "late")
        await sub.barrier()
        notes = await sub.actor(0, "late").read(timeout=20) if sub.rank == 1 else None
        await sub.barrier()
        return notes


def test_tells_before_their_actor_is_served_are_kept_for_it(world2: World) -> None:
    assert world2.run(check_tells_before_serve)[1] == ["first", "second"]


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


async def check_a_malformed_actor_frame(comm: Comm) -> list[str] | None:
    # A frame refused on arrival on the actors' own channels (here out of sequence, as a
    # faulty or hostile peer could send) is said, and the actors' loops go on: a call with a
    # deadline the reply loop keeps still times out, and calls after it are answered.
    from asyncomm._core import small, tags
    from asyncomm._core.wire import Kind

    said: list[str] = []
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()

    def handler(_: object, context: dict[str, object]) -> None:
        if isinstance(context.get("exception"), asyncomm.ProtocolError):
            said.append(str(context["exception"]))

    loop.set_exception_handler(handler)  # (before the barrier: rank 1 sends once 0 is in it)
    try:
        async with fresh(comm) as sub:
            if sub.rank == 1:
                sub.serve(Ledger(), "steady")
            await sub.barrier()
            if sub.rank == 1:  # out of sequence: refused on rank 0, on the channel it came on
                link = sub._router.link
                for tag in (tags.ACTOR_REPLY, tags.ACTOR_REQUEST):
                    link.send_small(0, int(Kind.DATA), tag, 1 << 40,
                                    small.encode([0, True, None]))
                link.flush()
            await sub.barrier()
            if sub.rank == 0:
                ref = sub.actor(1, "steady")
                with pytest.raises(asyncomm.CommTimeoutError, match=r"steady\.slow on rank 1"):
                    await asyncio.wait_for(ref.slow(10.0, timeout=2.5), 30.0)
                assert await ref.double(3) == 6
                deadline = time.monotonic() + 30
                while (sum(f"frame {1 << 40} " in words for words in said) < 2
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.05)
            await sub.barrier()
    finally:
        loop.set_exception_handler(before)
    return said if comm.rank == 0 else None


def test_a_malformed_actor_frame_is_said_and_the_actors_go_on(world2: World) -> None:
    said = world2.run(check_a_malformed_actor_frame)[0]
    assert said is not None
    # each forged frame is said, on its channel (a reply after it may be refused as well:
    # its channel's sequence follows the forged frame's)
    forged = [words for words in said if f"frame {1 << 40} from rank 1" in words]
    assert len(forged) == 2 and forged[0] != forged[1], said
