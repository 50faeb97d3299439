"""Actors, reaching in on purpose: tells held for an actor not served yet (read from the
host that holds them), and forged frames sent on the actors' own channels by their link."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_actors import Ledger

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World, fresh


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
