"""Spinning: a task about to wait polls for what it waits for itself, briefly and fairly.

Internals on purpose: ``Spin``, ``Ticker`` and a ``Poller`` (``_core/polling.py``) driven
directly with polls (and a ticker) made up for the test, the fairness bound changed by hand,
and the poller and bridge of a real communicator read to see a message leave before its
task spins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from asyncomm import Comm, CommTimeoutError
from asyncomm._core import polling
from asyncomm._core.polling import FAIR_S, MISSES, Spin, Ticker, due_at
from asyncomm.testing import World, fresh


class Polls:
    """A poll that finds something from its ``found``-th call on (never, if 0)."""

    def __init__(self, found: int = 0) -> None:
        self.calls, self.found = 0, found

    def __call__(self) -> bool:
        self.calls += 1
        return self.found > 0 and self.calls >= self.found


async def test_a_poll_that_finds_ends_the_spin() -> None:
    spin = Spin(asyncio.get_running_loop(), tests=8, max_s=1e-3)
    poll = Polls(found=3)
    assert spin.run(poll)
    assert poll.calls == 3
    assert spin.misses == 0


async def test_a_poll_that_finds_what_is_not_awaited_hands_over_to_then() -> None:
    spin = Spin(asyncio.get_running_loop(), tests=8, max_s=1e-3)
    poll, then = Polls(found=2), Polls(found=3)  # (the pump finds a frame; a sweep its data)
    done = iter([False, True])
    assert spin.run(poll, lambda: next(done), then)
    assert (poll.calls, then.calls) == (2, 3)


async def test_a_spin_polls_its_tests_then_for_max_s_and_gives_up() -> None:
    spin = Spin(asyncio.get_running_loop(), tests=8, max_s=0.0)
    poll = Polls()
    assert not spin.run(poll)
    assert poll.calls == 8 and spin.misses == 1  # (no max_s: the tests alone)
    await asyncio.sleep(0)  # the loop turns (see the fairness test)
    spin = Spin(asyncio.get_running_loop(), tests=8, max_s=2e-3)
    poll = Polls()
    begun = time.perf_counter()
    assert not spin.run(poll)
    assert time.perf_counter() - begun >= 2e-3  # it polled for the whole of max_s
    assert poll.calls > 8 and spin.misses == 1


async def test_no_tests_no_spin() -> None:
    spin = Spin(asyncio.get_running_loop(), tests=0, max_s=1e-3)
    poll = Polls(found=1)
    assert not spin.run(poll)
    assert poll.calls == 0
    assert not spin.allowed()


async def test_spins_that_find_nothing_in_a_row_spin_one_wait_in_misses() -> None:
    # (a blocking wait is given max_s when the wait spins, 0 when it does not: no clock)
    spin, given = Spin(asyncio.get_running_loop(), tests=1, max_s=1e-3), []

    def nothing(seconds: float) -> bool:
        given.append(seconds)
        return False

    for _ in range(3 * MISSES + 1):
        assert not spin.block(nothing)
    assert given == [1e-3] * MISSES + ([1e-3] + [0.0] * (MISSES - 1)) * 2 + [1e-3]
    assert spin.misses == 3 * MISSES + 1
    # a wait that finds what it waits for (here without spinning): the next spins again
    assert spin.block(lambda seconds: given.append(seconds) or True)
    assert spin.misses == 0 and given[-1] == 0.0
    given.clear()
    assert not spin.block(nothing)
    assert given == [1e-3]


async def test_no_spin_while_the_loop_is_kept_from_its_turn() -> None:
    # Tasks whose polls find what they wait for never yield: once the loop's turn, asked
    # for by the first spin, is overdue by FAIR_S, spins are refused until it comes.
    spin = Spin(asyncio.get_running_loop(), tests=8, max_s=1e-3)
    before = time.perf_counter()
    assert spin.run(Polls(found=1))
    after = time.perf_counter()  # the turn was asked in between: a preemption moves both
    while time.perf_counter() - after <= FAIR_S:  # the task goes on, never yielding
        assert spin.run(Polls(found=1)) or time.perf_counter() - before > FAIR_S
    poll = Polls(found=1)
    assert not spin.run(poll)
    assert poll.calls == 0 and spin.refused
    await asyncio.sleep(0)  # the loop turns
    assert spin.run(Polls(found=1))


async def test_the_spins_of_a_loop_share_its_turn() -> None:
    # Two pollers' spins on one loop (a communicator's requests, its link's messages): both
    # say that tasks hold the loop (its pollers then do not wake the ticker) while the turn
    # one asked for has not come; once it is overdue by FAIR_S, the other is refused too.
    loop = asyncio.get_running_loop()
    one, other = Spin(loop, tests=8, max_s=1e-3), Spin(loop, tests=8, max_s=1e-3)
    assert not one.holding() and not other.holding()
    assert one.run(Polls(found=1))
    after = time.perf_counter()  # (the turn was asked before this)
    assert one.holding() and other.holding()
    while time.perf_counter() - after <= FAIR_S:  # the task goes on, never yielding
        pass
    poll = Polls(found=1)
    assert not other.run(poll)
    assert poll.calls == 0 and other.refused
    await asyncio.sleep(0)  # the loop turns
    assert not one.holding() and not other.holding()
    assert other.run(Polls(found=1))
    assert one.holding()


class Ticks:
    """A ticker made up for the test: what a poller asked of it."""

    def __init__(self) -> None:
        self.wanted = 0

    def want(self, callback: Callable[[], None]) -> None:
        self.wanted += 1

    def release(self) -> None:
        pass


async def test_a_poller_backing_off_does_not_wake_the_ticker_while_tasks_hold_the_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A poller whose pump finds something at every poll, never busy after it (busy_s 0):
    # each poll backs off and, its news recent, asks the ticker; but not while a turn that
    # spinning tasks asked for (another poller's spin, here) has not come.
    monkeypatch.setenv("ASYNCOMM_BUSY_US", "0")
    loop = asyncio.get_running_loop()
    poller = polling.Poller(loop, lambda request, scratch: False, None, lambda: None,
                            lambda requests: [], lambda exc: CommTimeoutError)
    ticks = poller._ticker = Ticks()  # type: ignore[assignment]
    poller.add_pump(lambda: True)
    try:
        poller._poll()
        assert ticks.wanted == 1
        assert Spin(loop, tests=8, max_s=1e-3).run(Polls(found=1))  # a task spins
        poller._poll()
        assert ticks.wanted == 1  # held: not asked
        await asyncio.sleep(0)  # the turn comes
        poller._poll()
        assert ticks.wanted == 2
    finally:
        poller.drain()


async def test_a_spin_does_its_loops_work_due_first() -> None:
    loop, done = asyncio.get_running_loop(), []
    other = asyncio.new_event_loop()  # (another thread's loop, say)
    mine, theirs = due_at(loop), due_at(other)
    try:
        theirs.append(lambda: done.append("theirs"))
        mine.extend([lambda: done.append("first"), lambda: done.append("second")])
        assert not Spin(loop, tests=0, max_s=1e-3).run(Polls())  # (no spin: nothing done)
        assert done == [] and len(mine) == 2
        assert Spin(loop, tests=4, max_s=1e-3).run(Polls(found=1))
        assert done == ["first", "second"]  # before the poll, in the order listed
        assert not mine and len(theirs) == 1  # (another loop's work waits for that loop)
        await asyncio.sleep(0)  # the turn that spin asked for comes (the next may spin then)
        said: list[dict[str, object]] = []
        loop.set_exception_handler(lambda _, context: said.append(context))
        mine.extend([lambda: 1 / 0, lambda: done.append("first")])  # a failing work is
        assert Spin(loop, tests=4, max_s=1e-3).run(Polls(found=1))  # said, the next done
        assert done == ["first", "second", "first"] and not mine
        assert isinstance(said[0]["exception"], ZeroDivisionError), said
    finally:
        mine.clear()
        theirs.clear()
        other.close()
        loop.set_exception_handler(None)


async def check_ping_pong_lets_the_loop_turn(comm: Comm) -> int:
    # A ping-pong whose answers come within the spin never parks; a task beside it must
    # still run, at least every millisecond or so (FAIR_S): count the most exchanges
    # between two of its turns.
    async with fresh(comm) as sub:
        ch, peer, t = sub.channel(1), 1 - sub.rank, torch.zeros(2)

        async def exchange() -> None:
            if sub.rank == 0:
                await ch.send(t, peer)
                await ch.recv(peer)
            else:
                await ch.recv(peer)
                await ch.send(t, peer)

        return await longest_between_turns(exchange, 3000)


async def longest_between_turns(step: Callable[[], Awaitable[object]], times: int) -> int:
    """Await ``step()`` ``times`` times beside a task that counts its loop turns; return
    the most steps between two of its turns."""
    ticks = [0]

    async def beside() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(beside())
    await asyncio.sleep(0)
    longest, run, last = 0, 0, ticks[0]
    for _ in range(times):
        await step()
        run = 0 if ticks[0] != last else run + 1
        last, longest = ticks[0], max(longest, run)
    task.cancel()
    return longest


def test_a_spinning_ping_pong_lets_other_tasks_run(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("only MPI's point-to-point spins (gloo's sends and receives complete on "
                    "threads)")
    longest = world2.run(check_ping_pong_lets_the_loop_turn)
    # Unfair, the task beside would wait for all 3000 exchanges. FAIR_S is a time, so how
    # many exchanges fit between two turns depends on the machine (more on a faster one):
    # the bound only says that the task ran within every half of the run (an exchange is a
    # round trip, microseconds at the least, so 1500 of them outlast FAIR_S anywhere).
    assert max(longest) < 1500, longest


async def check_a_turn_given_loses_no_message(comm: Comm) -> int:
    # A recv whose spin is refused until the loop turns yields that turn and spins again;
    # what the turn brought (the poller took the message into the mailbox) is taken, not
    # waited for. Turns made due often (FAIR_S 20 us); the peers checked only every 60 s:
    # a recv that missed it would wait past its 20 s deadline (before the mailbox was
    # checked after the turn: several in 2000 exchanges).
    async with fresh(comm, env={"ASYNCOMM_PROBE_S": "60"}) as sub:
        ch, peer, t = sub.channel(1), 1 - sub.rank, torch.zeros(2)
        fair, polling.FAIR_S = polling.FAIR_S, 20e-6
        try:
            for _ in range(2000):
                if sub.rank == 0:
                    await ch.send(t, peer)
                    await ch.recv(peer, timeout=20)
                else:
                    await ch.recv(peer, timeout=20)
                    await ch.send(t, peer)
        finally:
            polling.FAIR_S = fair
        return sub.rank


def test_a_recv_that_gives_the_loop_its_turn_loses_no_message(world2: World) -> None:
    assert world2.run(check_a_turn_given_loses_no_message) == [0, 1]


async def check_awaited_collectives_let_the_loop_turn(comm: Comm) -> int:
    # Awaited all_reduces that complete while their task spins (MPI's tests, gloo's bounded
    # wait) never park; a task beside them must still run every millisecond or so.
    async with fresh(comm) as sub:
        t = torch.zeros(2)
        return await longest_between_turns(lambda: sub.all_reduce(t), 3000)


def test_awaited_collectives_let_other_tasks_run(world2: World) -> None:
    longest = world2.run(check_awaited_collectives_let_the_loop_turn)
    # FAIR_S is a time: the all_reduces between two turns are those that fit in it, fewer
    # on a slower or loaded machine (a gloo one takes far longer than an MPI one, and its
    # blocking wait up to a millisecond); the bounds leave a fast one room.
    assert max(longest) <= (100 if world2.backend == "gloo" else 1000), longest


async def check_a_message_goes_before_its_task_spins(comm: Comm) -> int:
    # A channel message waits for the loop iteration's end to leave (with the iteration's
    # others); a task that then awaits an operation the peer joins only once the message is
    # in (gloo: a collective, MPI: a receive) must send it before it spins. The sender's
    # spins are made far longer than the receiver's deadline (gloo: a blocking wait of
    # max_s; MPI: an awaited request's tests, a fraction of a microsecond each), and that
    # deadline far longer than a message takes on a loaded machine: a message held back by
    # the spin misses it at the first round, one sent first never does. (Only the sender's
    # spins: a receiver that spun as long would find the late message within its own spin.
    # Made long once the communicator is made, and short again before it closes: their
    # making and closing would spin as long, for nothing.)
    async with fresh(comm) as sub:
        backend: Any = sub._backend
        spin = backend._poller._spin if sub.backend == "mpi" else backend._bridge._spin
        short = spin.tests, spin.max_s
        if sub.rank == 1 and sub.backend == "mpi":
            spin.tests = 4 * 10**8
        elif sub.rank == 1:
            spin.tests, spin.max_s = max(spin.tests, 1), 120.0
        ch, t, rounds = sub.channel(9), torch.zeros(2), 0
        try:
            for i in range(40):
                if sub.rank == 0:
                    assert (await ch.recv(1, timeout=20.0)).data == i
                    await (sub.all_reduce(t) if sub.backend == "gloo" else sub.send(t, 1, tag=4))
                    rounds += 1
                elif sub.rank == 1:
                    await ch.send(i, 0)
                    await (sub.all_reduce(t) if sub.backend == "gloo" else sub.recv(t, 0, tag=4))
        finally:
            spin.tests, spin.max_s = short
        return rounds


def test_a_message_goes_before_its_task_spins(world2: World) -> None:
    assert world2.run(check_a_message_goes_before_its_task_spins)[0] == 40


async def check_finished_once(comm: Comm) -> list[list[int]]:
    # An int16 sum comes back from gloo as a copy of an int32 one (``finish``). A handle
    # whose callback was given (the loop turned after it was issued) and which its task
    # then finished itself must not be finished again by that callback: the copy would
    # overwrite what the task wrote since.
    async with fresh(comm) as sub:
        for _ in range(5):  # (collectives that come soon: their tasks spin)
            await sub.all_reduce(torch.ones(1))
        seen = []
        for _ in range(30):
            t = torch.full((3,), sub.rank + 1, dtype=torch.int16)
            handle = sub.all_reduce(t)
            await asyncio.sleep(0)  # the loop turns: the handle's callback is given
            await handle
            seen.append(t.tolist())
            t.fill_(-7)
            await asyncio.sleep(0.002)  # the callback's delivery comes meanwhile
            seen.append(t.tolist())
        return seen


def test_a_collective_its_task_finished_is_finished_once(world2: World) -> None:
    for seen in world2.run(check_finished_once):
        assert seen == [[3, 3, 3], [-7, -7, -7]] * 30, seen


async def check_unawaited_requests_complete_and_expire(comm: Comm) -> list[str]:
    # A request its task may finish in ``await`` joins the polled ones (and its deadline
    # the queues) only when the loop iteration that issued it ends: one never awaited
    # must still complete, and one that never can must still time out (by its own deadline,
    # not the communicator's default of minutes).
    seen = []
    async with fresh(comm) as sub:
        peer = 1 - sub.rank
        for round_ in range(20):  # (a request left alone by a task that never yields)
            got = torch.zeros(1)
            late = sub.recv(torch.zeros(1), peer, tag=99, timeout=0.05)
            handle = sub.recv(got, peer, tag=round_ + 1)
            sent = sub.send(torch.ones(1) * round_, peer, tag=round_ + 1)
            # (a request never polled, or a deadline never queued, never ends: the bound
            # only keeps such a failure from hanging the world)
            start = time.monotonic()
            while not (handle.done() and sent.done() and late.done()):
                await asyncio.sleep(0.001)
                assert time.monotonic() - start < 30, "an unawaited request was never polled"
            try:
                late.result()
                failed = "nothing"
            except CommTimeoutError as exc:
                failed = type(exc).__name__
            seen.append(f"{got.item():g} {failed}")
            await sub.barrier()
    return seen


def test_requests_never_awaited_complete_and_expire(world2: World) -> None:
    for seen in world2.run(check_unawaited_requests_complete_and_expire):
        assert seen == [f"{i} CommTimeoutError" for i in range(20)], seen


async def test_the_ticker_calls_back_once_per_want_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    tick = Ticker(loop, 200e-6)
    calls: list[int] = []
    on_loop = []

    def callback() -> None:
        calls.append(1)
        on_loop.append(asyncio.get_running_loop() is loop)

    for _ in range(3):
        tick.want(callback)
        tick.want(callback)  # asked twice before the tick: called once
        while len(calls) < _ + 1:
            await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert calls == [1, 1, 1] and all(on_loop)


def test_the_ticker_thread_ends_with_its_loop_and_when_unwanted() -> None:
    loop = asyncio.new_event_loop()
    tick = Ticker(loop, 200e-6)
    tick.want(lambda: None)
    thread = tick._thread
    assert thread is not None
    loop.run_until_complete(asyncio.sleep(0.01))
    thread.join(30)  # unwanted for a second: it ends (a later want starts another)
    assert not thread.is_alive() and tick._thread is None
    tick.want(lambda: None)  # ... and one that finds the loop closed ends too, quietly
    thread = tick._thread
    assert thread is not None
    loop.close()
    thread.join(30)
    assert not thread.is_alive()
