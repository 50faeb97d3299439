"""The compiled hot path of small messages: a channel's post in one call (both backends),
and on MPI the lane's look (``small.cpp``'s ``Lane``): real worlds, counted, not timed."""

from __future__ import annotations

import asyncio
import collections
import gc
import inspect
import sys
import weakref
from typing import Any

import pytest
import torch

import asyncomm
from asyncomm import Comm
from asyncomm._core import small
from asyncomm.testing import World, fresh

compiled = pytest.mark.skipif(small.NATIVE is None, reason="the compiled part is not built")


def counted_looks(comm: Comm) -> collections.Counter[int]:
    """Count what the link's ``look`` answers (1 there, 0 not, -1 the Python way) for the
    channels made from now on and the communicator's actors (private: they bind it)."""
    link, host = comm._router.link, comm._host
    look, answers = link.look, collections.Counter[int]()
    assert look is not None

    def counting(frames: Any, src: int | None) -> int:
        found = look(frames, src)
        answers[found] += 1
        return found

    link.look = host._look = counting
    host.calling = host._calling()  # (the compiled call binds the look it is made with)
    return answers


async def check_looks_in_one_call(comm: Comm) -> tuple[dict[int, int], dict[int, int]]:
    # A ping-pong, then bursts of 64 small dicts each answered by an ack: a receiver about
    # to wait flushes, pays the credit it owes and looks in one compiled call; the Python
    # path (``Router.flush``, then ``Link.hurry``) only where the state is not the
    # commonest. Before the look paid credit itself, three looks in four of the bursts
    # went the Python way (a batch of credit held back was owed most of the time).
    async with fresh(comm) as sub:
        answers = counted_looks(sub)
        ch, small_ch, ack = sub.channel(1), sub.channel(2), sub.channel(3)
        peer, t = 1 - sub.rank, torch.zeros(2)
        for _ in range(500):
            if sub.rank == 0:
                await ch.send(t, peer)
                assert torch.equal((await ch.recv(peer)).data, t)
            else:
                await ch.send((await ch.recv(peer)).data, peer)
        pingpong = dict(answers)
        answers.clear()
        for i in range(20):
            if sub.rank == 0:
                for j in range(64):
                    await small_ch.send({"i": i, "j": j}, peer)
                assert (await ack.recv(peer)).data == i
            else:
                assert [(await small_ch.recv(peer)).data["j"] for _ in range(64)] == list(
                    range(64))
                await ack.send(i, peer)
        await sub.barrier()
        return pingpong, dict(answers)


@compiled
def test_a_receiver_looks_in_one_compiled_call(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("the lane is MPI's (a link polled from the loop)")
    for pingpong, bursts in world2.run(check_looks_in_one_call):
        looks = sum(pingpong.values())
        assert looks >= 400, pingpong  # (the rest found their message without looking)
        assert pingpong.get(-1, 0) <= looks // 10, pingpong
        assert sum(bursts.values()) >= 20 and bursts.get(-1, 0) <= 4, bursts


async def check_actor_calls_look(comm: Comm) -> dict[int, int]:
    async with fresh(comm) as sub:
        answers = counted_looks(sub)

        class Echo(asyncomm.Actor):
            @asyncomm.endpoint
            def echo(self, x: object) -> object:
                return x

        sub.serve(Echo(), "echo")
        await sub.barrier()
        if sub.rank == 0:
            ref = sub.actor(1, "echo")
            for i in range(300):
                assert await ref.echo(i) == i
        await sub.barrier()
        return dict(answers)


@compiled
def test_actor_calls_and_actors_look_in_one_compiled_call(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("the lane is MPI's (a link polled from the loop)")
    caller, server = world2.run(check_actor_calls_look)
    for answers in (caller, server):
        assert sum(answers.values()) >= 250, answers
        assert answers.get(-1, 0) <= sum(answers.values()) // 10, answers


async def check_closed_links_are_collected(comm: Comm) -> list[bool]:
    # The compiled outbox refers to its link's flush, the lane to the link, the router
    # and the poller: cycles, which the collector must be able to break once the
    # communicator is closed (else every closed communicator's link lived on).
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


@compiled
def test_the_compiled_calls_refuse_what_they_cannot_use() -> None:
    native = small.NATIVE
    assert native is not None
    box = native.Outbox(1 << 16, lambda obj, room, max_ndim: None)

    class Window:
        __slots__ = ("messages_out", "open", "seq", "waiters")

    class NoSlots:
        pass

    with pytest.raises(TypeError, match="not attached"):
        box.post(Window(), 1, 5, "x", 100, 8, 64)
    with pytest.raises(TypeError, match="list"):
        box.attach((), (None, None), print, print, Window)
    with pytest.raises(TypeError, match="not a slot"):
        box.attach([], (None, None), print, print, NoSlots)
    box.attach([], (None, None), print, print, Window)
    with pytest.raises(TypeError, match="not a window"):
        box.post(object(), 1, 5, "x", 100, 8, 64)
    with pytest.raises(AttributeError, match="slot is not set"):
        box.post(Window(), 1, 5, "x", 100, 8, 64)
    with pytest.raises(TypeError):
        native.Lane(box)  # (too few)
    with pytest.raises(TypeError):
        native.Lane(*[None] * 21)  # (no capsule)


@compiled
def test_the_lane_keeps_the_loops_fairness_rule() -> None:
    from asyncomm._core import hurry

    assert small.NATIVE is not None
    assert small.NATIVE.FAIR_S == hurry.FAIR_S  # (the compiled look's copy of the rule)


@compiled
def test_a_post_counts_in_its_window_and_asks_for_one_flush() -> None:
    native = small.NATIVE
    assert native is not None
    box = native.Outbox(1 << 16, lambda obj, room, max_ndim: None)
    due: list[Any] = []
    asked: list[Any] = []

    class Window:
        __slots__ = ("messages_out", "open", "seq", "waiters")

    entry = (None, "flush")
    box.attach(due, entry, asked.append, "flush soon", Window)
    window = Window()
    window.open, window.messages_out, window.seq, window.waiters = True, 0, 7, ()
    assert box.post(window, 1, 5, {"a": 1}, 200, 8, 2) == 1  # a new packet
    assert box.post(window, 1, 5, [2], 200, 8, 2) == 0
    assert (window.messages_out, window.seq) == (2, 9)
    assert box.post(window, 1, 5, "third", 200, 8, 2) == -3  # the window is full
    assert (window.messages_out, window.seq) == (2, 9)
    assert due == [entry] and asked == ["flush soon"] and box.waiting and box.flush_due
    window.messages_out, window.waiters = 0, (object(),)
    assert box.post(window, 1, 5, "x", 200, 8, 2) == -3  # a sender waits for credit
    window.waiters, window.open = (), False
    assert box.post(window, 1, 5, "x", 200, 8, 2) == -3  # closed, or to itself
    window.open = True
    assert box.post(window, 1, 5, object(), 200, 8, 2) == -2  # not a small message
    assert box.counts(1) == (1, 2)  # one run of two messages


async def check_a_receive_takes_nothing_until_it_runs(comm: Comm) -> list[Any]:
    # ``recv`` returns a coroutine (the compiled part's own, where built): like an ``async
    # def``'s, it takes nothing until it runs. Closed, thrown into or cancelled as a task
    # before it ran, the message stays for the next receive; awaited twice, it says so.
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


async def check_burst_received_without_coroutine_frames(comm: Comm) -> Any:
    # A burst of small messages: each send posts its message in the compiled sender, and,
    # all in the mailbox, each receive takes its message in the compiled receiver: no
    # Python coroutine run (an ``async def``'s, or the Python path's ``Channel._sending``
    # and ``_receive``: one each).
    coroutines = collections.Counter[str]()

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_flags & inspect.CO_COROUTINE:
            coroutines[frame.f_code.co_name] += 1

    async with fresh(comm) as sub:
        ch, ack, peer = sub.channel(6), sub.channel(7), 1 - sub.rank
        if sub.rank == 0:
            await ch.send({"i": 0}, peer)  # (the first to a rank checks it: Python's)
            sys.setprofile(count)
            try:
                for i in range(1, 64):
                    await ch.send({"i": i}, peer)
            finally:
                sys.setprofile(None)
            assert (await ack.recv(peer)).data == "all"
            return dict(coroutines)
        frames = sub._router.mailbox(6).frames
        for _ in range(10_000):  # (the poller, or gloo's reader, puts them there)
            if len(frames) == 64:
                break
            await asyncio.sleep(0.001)
        assert len(frames) == 64, len(frames)
        got = []
        sys.setprofile(count)
        try:
            for _ in range(64):  # (no comprehension: an awaiting one is a coroutine itself)
                got.append((await ch.recv(peer)).data["i"])
        finally:
            sys.setprofile(None)
        assert got == list(range(64)), got
        await ack.send("all", peer)
        return dict(coroutines)


@compiled
def test_a_burst_is_sent_and_received_without_coroutine_frames(world2: World) -> None:
    for coroutines in world2.run(check_burst_received_without_coroutine_frames):
        assert not coroutines, coroutines


async def check_calls_answered_while_looking_make_no_coroutine(comm: Comm) -> Any:
    # An actor call runs in the compiled caller: answered while its caller looks (a
    # ping-pong of calls), no Python coroutine at all (``Host._call``'s: one a call).
    async with fresh(comm) as sub:
        if sub.rank == 1:
            sub.serve(_Echo(), "echo")
        await sub.barrier()
        coroutines = collections.Counter[str]()
        if sub.rank == 0:
            echo = sub.actor(1, "echo").echo
            for i in range(50):  # (the look learns how long an answer takes)
                assert await echo(i) == i

            def count(frame: Any, event: str, arg: Any) -> None:
                if event == "call" and frame.f_code.co_flags & inspect.CO_COROUTINE:
                    coroutines[frame.f_code.co_name] += 1

            sys.setprofile(count)
            try:
                for i in range(200):
                    assert await echo(i) == i
            finally:
                sys.setprofile(None)
        await sub.barrier()
        return dict(coroutines)


class _Echo(asyncomm.Actor):
    @asyncomm.endpoint
    def echo(self, x: Any) -> Any:
        return x


@compiled
def test_an_actor_call_answered_while_looking_makes_no_coroutine(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("the look is MPI's (a link polled from the loop)")
    caller, _ = world2.run(check_calls_answered_while_looking_make_no_coroutine)
    # the caller's own coroutines: ``Host._call`` (one a call, before; none now: a callee
    # known gone or closed only), ``Host._finish`` (one a wait past the look's budget,
    # which a loaded machine makes often); others are the loop's tasks, run as a call waits
    assert caller.get("_call", 0) == 0, caller
    assert caller.get("_finish", 0) < 200, caller
