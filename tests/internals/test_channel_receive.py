"""A channel's receive is a coroutine that takes nothing until it runs, and a closed
communicator's link and router are collected: real worlds, both backends.

Internals on purpose: what is collected is the router and its link, and "nothing taken"
is read from the mailbox."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World, fresh


async def check_closed_links_are_collected(comm: Comm) -> list[bool]:
    # The link, the router and the poller refer to each other: cycles, which the
    # collector must be able to break once the communicator is closed (else every closed
    # communicator's link lived on).
    refs = []
    for _ in range(3):
        async with fresh(comm) as sub:
            ch = sub.channel(5)
            await ch.send("hello", (sub.rank + 1) % sub.size)
            assert (await ch.recv()).data == "hello"
            refs.append(weakref.ref(sub._router.link))
            refs.append(weakref.ref(sub._router))
            del ch
        del sub
    gc.collect()
    return [ref() is None for ref in refs]


def test_closed_communicators_links_are_collected(world2: World) -> None:
    for collected in world2.run(check_closed_links_are_collected):
        assert all(collected), collected


async def check_a_receive_takes_nothing_until_it_runs(comm: Comm) -> list[Any]:
    # ``recv`` returns a coroutine: it takes nothing until it runs. Closed, thrown into or
    # cancelled as a task before it ran, the message stays for the next receive; awaited
    # twice, it says so.
    async with fresh(comm) as sub:
        ch, peer = sub.channel(4), 1 - sub.rank
        if sub.rank == 0:
            for i in range(7):
                await ch.send(i, peer)
            assert (await ch.recv(peer)).data == "end"
            return []
        first = ch.recv(peer)
        assert asyncio.iscoroutine(first)
        first.close()
        never = asyncio.create_task(ch.recv(peer))
        never.cancel()
        try:
            await never
        except asyncio.CancelledError:
            pass
        thrown = ch.recv(peer)
        try:
            thrown.throw(KeyError("thrown"))
        except KeyError:
            pass
        else:
            raise AssertionError("throw into a fresh receive did not raise")
        got = [(await ch.recv(peer)).data,
               (await asyncio.create_task(ch.recv(peer))).data,
               (await asyncio.wait_for(ch.recv(peer), 60)).data]
        got.extend(m.data for m in await asyncio.gather(ch.recv(peer), ch.recv(peer)))
        while len(sub._router.mailbox(4).frames) < 1:  # (then it needs no look: no yield)
            await asyncio.sleep(0.001)
        stepped = ch.recv(peer)
        try:
            stepped.send(None)  # (as Python 3.12's await steps it: a StopIteration's value)
        except StopIteration as stop:
            assert type(stop.value) is asyncomm.Message, stop.value
            got.append(stop.value.data)
        else:
            raise AssertionError("a receive whose message was there did not end at once")
        again = ch.recv(peer)
        got.append((await again).data)
        try:
            await again
        except RuntimeError as exc:
            assert "reuse" in str(exc), exc
        else:
            raise AssertionError("a receive awaited twice did not say so")
        await ch.send("end", peer)
        return got


def test_a_receive_takes_nothing_until_it_runs(world2: World) -> None:
    _, got = world2.run(check_a_receive_takes_nothing_until_it_runs)
    assert got == list(range(7))
