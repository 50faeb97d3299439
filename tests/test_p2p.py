"""Point-to-point: every dtype, tags, any source, many in flight, no head-of-line blocking."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_collectives import DTYPES, MOVED_ONLY, value

from asyncomm import Comm, CommClosedError, MismatchError
from asyncomm.testing import World


async def check_every_dtype(comm: Comm) -> None:
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    moved = [*DTYPES, *MOVED_ONLY, torch.complex64, torch.complex128]
    for i, dtype in enumerate(moved):
        got = torch.zeros(5, dtype=dtype)
        receiving = comm.recv(got, left, tag=i)  # posted before the matching send
        await comm.send(value(comm.rank, dtype), right, tag=i)
        assert await receiving == left
        assert torch.equal(got, value(left, dtype)), dtype
    # empty, and a view with an offset: the same bytes arrive
    sent = torch.arange(12.0) + comm.rank
    theirs = torch.arange(12.0) + left
    for j, (buf, out, expected) in enumerate([(torch.zeros(0), sent[:0], theirs[:0]),
                                              (torch.zeros(3), sent[5:8], theirs[5:8])]):
        receiving = comm.recv(buf, left, tag=len(moved) + j)
        await comm.send(out, right, tag=len(moved) + j)
        assert await receiving == left
        assert torch.equal(buf, expected), (j, buf, expected)
    # a conjugate or negative view's memory does not hold its values: refused, not sent
    # as its memory (its peer got the unconjugated values)
    # (a real tensor can be a negative view too, and its memory is contiguous)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for view in (z.conj(), torch._neg_view(z), torch._neg_view(torch.ones(2))):
        with pytest.raises(ValueError, match="view"):
            comm.send(view, right, tag=99)
        with pytest.raises(ValueError, match="view"):
            comm.recv(view, left, tag=99)
        with pytest.raises(ValueError, match="view"):
            comm.all_reduce(view)


def test_ring_every_dtype(world: World) -> None:
    world.run(check_every_dtype)


async def check_any_source(comm: Comm) -> None:
    if comm.rank == 0:
        seen = []
        for _ in range(2 * (comm.size - 1)):
            buf = torch.zeros(1, dtype=torch.int64)
            src = await comm.recv(buf, tag=5)
            assert buf.item() == src * 100, (src, buf)
            seen.append(src)
        assert sorted(seen) == sorted(list(range(1, comm.size)) * 2)
    else:
        for _ in range(2):
            await comm.send(torch.tensor([comm.rank * 100]), 0, tag=5)


def test_any_source_resolves_to_the_sender(world: World) -> None:
    world.run(check_any_source)


async def check_tags_out_of_order(comm: Comm) -> None:
    n = 40
    if comm.rank == 0:
        bufs = [torch.zeros(3) for _ in range(n)]
        handles = [comm.recv(b, 1, tag=t) for t, b in enumerate(bufs)]  # all in flight
        assert await asyncio.gather(*handles) == [1] * n
        assert all(b[0].item() == t for t, b in enumerate(bufs))
    elif comm.rank == 1:
        sends = [comm.send(torch.full((3,), float(t)), 0, tag=t) for t in reversed(range(n))]
        await asyncio.gather(*sends)


def test_many_receives_in_flight_matched_by_tag(world2: World) -> None:
    world2.run(check_tags_out_of_order)


async def check_no_head_of_line_blocking(comm: Comm) -> None:
    # Rank 0's receive is issued first and completes last; its sends must not
    # wait behind it, or rank 1 never gets what it needs to answer.
    if comm.rank == 0:
        answer = torch.zeros(1)
        pending = comm.recv(answer, 1, tag=9)
        await comm.send(torch.tensor([1.0]), 1, tag=1)
        await comm.send(torch.tensor([2.0]), 1, tag=2)
        assert await pending == 1
        assert answer.item() == 3.0
    else:
        x, y = torch.zeros(1), torch.zeros(1)
        await comm.recv(x, 0, tag=1)
        await comm.recv(y, 0, tag=2)
        await comm.send(x + y, 0, tag=9)


def test_no_head_of_line_blocking(world2: World) -> None:
    world2.run(check_no_head_of_line_blocking)


async def check_large_messages(comm: Comm) -> None:
    n = 4 << 20  # 16 MiB of float32, both directions at once
    out = torch.arange(n, dtype=torch.float32) + comm.rank
    got = torch.empty(n)
    peer = 1 - comm.rank
    await asyncio.gather(comm.send(out, peer, tag=1), comm.recv(got, peer, tag=1))
    assert torch.equal(got, torch.arange(n, dtype=torch.float32) + peer)  # every element


def test_large_messages_both_ways(world2: World) -> None:
    world2.run(check_large_messages)


async def check_send_buffer_reusable_once_done(comm: Comm) -> None:
    # A send's handle completes when its buffer may be reused: overwriting it
    # afterwards must not change what the receiver gets, small or large.
    for n in (2, 1 << 10, 1 << 16, 1 << 20):
        if comm.rank == 0:
            t = torch.arange(n, dtype=torch.float32)
            sent = comm.send(t, 1, tag=n % 30000)
            await comm.send(torch.zeros(1), 1, tag=7)  # "issued": the receive comes after
            await sent
            t.fill_(-1.0)
            await comm.recv(torch.zeros(1), 1, tag=1)  # the receiver is done
        else:
            await comm.recv(torch.zeros(1), 0, tag=7)  # post the receive late
            got = torch.zeros(n)
            await comm.recv(got, 0, tag=n % 30000)
            assert torch.equal(got, torch.arange(n, dtype=torch.float32)), n
            await comm.send(torch.zeros(1), 0, tag=1)


def test_send_buffer_reusable_once_done(world2: World) -> None:
    world2.run(check_send_buffer_reusable_once_done)


async def check_eager_sends_are_bounded(comm: Comm) -> tuple[int, list[float]]:
    # gloo: a small CPU send completes at once (a copy is sent), at most 64 in flight;
    # the 65th and later complete only when received. MPI: its own eager protocol.
    n = 100
    if comm.rank == 0:
        sent = [comm.send(torch.full((2,), float(i)), 1, tag=3) for i in range(n)]
        await asyncio.sleep(0)  # the loop turns once: whatever completed at once has
        done_before = sum(h.done() for h in sent)
        await comm.send(torch.zeros(1), 1, tag=4)  # rank 1 starts receiving only now
        await asyncio.gather(*sent)
        return done_before, []
    await comm.recv(torch.zeros(1), 0, tag=4)
    got = []
    for _ in range(n):
        t = torch.zeros(2)
        await comm.recv(t, 0, tag=3)
        got.append(t[0].item())
    return 0, got


def test_eager_sends_are_bounded(world2: World) -> None:
    (done_before, _), (_, got) = world2.run(check_eager_sends_are_bounded)
    assert got == [float(i) for i in range(100)]  # in order, nothing lost
    if world2.backend == "gloo":
        assert done_before == 64
    else:  # MPI sends small messages eagerly too, bounded by its own buffers
        assert done_before > 0


async def check_posted_from_threads(comm: Comm) -> None:
    """``post_send``/``post_recv``: checked like ``send``/``recv``; used and waited on a thread."""
    peer = 1 - comm.rank
    for bad, kind in ((lambda: comm.post_send("x", peer), TypeError),  # type: ignore[arg-type]
                      (lambda: comm.post_send(torch.zeros(1), comm.rank), ValueError),
                      (lambda: comm.post_recv(torch.zeros(1), 5), ValueError),
                      (lambda: comm.post_recv(torch.zeros(1), peer, tag=-1), ValueError)):
        with pytest.raises(kind, match=f"rank {comm.rank}: (send|recv)"):
            bad()

    def exchange() -> list[float]:  # a thread of the program's own: no loop here
        bufs = [torch.zeros(3) for _ in range(4)]
        receives = [comm.post_recv(b, peer, tag=10 + i) for i, b in enumerate(bufs)]
        sends = [comm.post_send(torch.full((3,), 10.0 * comm.rank + i), peer, tag=13 - i)
                 for i in range(4)]  # sent in the other order: matched by tag
        for posted in receives + sends:
            posted.wait()
        return [b[0].item() for b in bufs]

    got = await asyncio.to_thread(exchange)
    assert got == [10.0 * peer + 3 - i for i in range(4)], got
    sub = await comm.group([0, 1])
    assert sub is not None
    await sub.close()
    with pytest.raises(CommClosedError, match="closed"):
        sub.post_send(torch.zeros(1), peer)


async def check_posted_receive_cancelled(comm: Comm) -> None:
    """A thread blocked in a posted receive returns when it is cancelled (MPI)."""
    if comm.rank == 0:
        posted = comm.post_recv(torch.zeros(2), 1, tag=21)
        waiting = asyncio.ensure_future(asyncio.to_thread(posted.wait))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        posted.cancel()
        with pytest.raises(CommClosedError, match=r"rank 0: recv peer 1 tag 21: cancelled"):
            await asyncio.wait_for(waiting, 10)
    await comm.barrier()


def test_posted_from_threads(world2: World) -> None:
    world2.run(check_posted_from_threads)
    if world2.backend == "mpi":  # gloo cannot cancel a receive (see ``Posted.cancel``)
        world2.run(check_posted_receive_cancelled)


BIG = 300 << 10  # beyond the 64 KiB a gloo message carries in its first piece


async def check_too_small_a_buffer(comm: Comm) -> list[str]:
    # A message larger than its receive's buffer fails that receive with MismatchError (on
    # gloo it used to abort the receiving process, SIGABRT from gloo's own thread), is
    # dropped whole, and the pair goes on: the next message on the same tag is received.
    seen = []
    for size in (100, BIG, 4):
        if comm.rank == 0:
            await comm.send(torch.arange(size // 4, dtype=torch.float32), 1, tag=7)
            await comm.send(torch.tensor([float(size)]), 1, tag=7)
        elif comm.rank == 1:
            small = torch.full((2,), -1.0)
            try:
                await comm.recv(small, 0, tag=7)
                seen.append(f"{size}: {small.tolist()}")
            except MismatchError as exc:
                assert "rank 1: recv #" in str(exc) and "peer 0 tag 7" in str(exc), exc
                sizes = f"rank 0 sent {size} bytes, more than the 8 of the buffer"
                assert sizes in str(exc) or (  # (MPICH's large, not probed: no sizes said)
                    comm.backend == "mpi" and size == BIG and "larger than the buffer" in str(exc)
                ), exc
                seen.append(f"{size}: refused")
            after = torch.zeros(1)
            await comm.recv(after, 0, tag=7)
            seen.append(f"next {after.item():g}")
    t = torch.ones(1)
    await comm.all_reduce(t)  # the world is whole
    assert t.item() == comm.size
    return seen


def test_a_buffer_too_small_is_refused_and_the_pair_goes_on(world: World) -> None:
    seen = world.run(check_too_small_a_buffer)[1]
    assert seen == ["100: refused", "next 100", f"{BIG}: refused", f"next {BIG}",
                    "4: [0.0, -1.0]", "next 4"], seen  # a shorter message fills the beginning


async def check_posted_too_small(comm: Comm) -> str:
    def exchange() -> str:
        if comm.rank == 0:
            comm.post_send(torch.zeros(BIG // 4), 1, tag=11).wait()
            comm.post_send(torch.ones(3), 1, tag=11).wait()
            return ""
        try:
            comm.post_recv(torch.zeros(2), 0, tag=11).wait()
            return "received"
        except MismatchError:
            after = torch.zeros(3)
            comm.post_recv(after, 0, tag=11).wait()
            return f"refused, then {after.tolist()}"

    return await asyncio.to_thread(exchange)


def test_a_posted_receive_too_small_is_refused(world2: World) -> None:
    assert world2.run(check_posted_too_small)[1] == "refused, then [1.0, 1.0, 1.0]"
