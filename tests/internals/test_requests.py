"""Point-to-point and collective requests, reaching into the backends on purpose: gloo's
sized messages and its bound on data tags, MPI's matched probes and kept (persistent)
requests, a receive's deadline and kept buffer, the quick and usual paths side by side, and
the poller left idle by a waiting receive."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest
import torch
from test_p2p import (
    BIG,
    check_posted_receive_cancelled,
    check_posted_too_small,
    check_too_small_a_buffer,
)

from asyncomm import Comm, CommClosedError, CommError, CommTimeoutError
from asyncomm.testing import World, fresh


async def check_sizes_mixed_on_one_tag(comm: Comm, short: bool = True) -> list[list[float]]:
    # Large and small messages on one tag, several receives posted at once: each gets a
    # message whole (a large payload travels on a tag of its own: no receive may take
    # another's), those of one source in order. Then the same to receives of any source
    # (gloo orders those only among themselves). ``short=False``: gloo's messages as where
    # its transport needs every message to fill its receive (macOS, Windows).
    from asyncomm._backends import gloo_p2p

    gloo_p2p.SHORT = short
    try:
        await comm.barrier()
        sizes = [BIG, 2, 4092 // 4, 4096 // 4, BIG // 2, 1, BIG]
        seen = []
        for source in (0, None):
            if comm.rank == 0:
                await asyncio.gather(*(comm.send(torch.full((n,), float(i)), 1, tag=9)
                                       for i, n in enumerate(sizes)))
            elif comm.rank == 1:
                bufs = [torch.full((BIG + 1,), -1.0) for _ in sizes]
                got = [comm.recv(b, source, tag=9) for b in bufs]
                assert await asyncio.gather(*got) == [0] * len(sizes)
                for b in bufs:
                    i = int(b[0].item())
                    n = sizes[i]
                    seen.append([float(i), b[n - 1].item(), b[n].item()])
            await comm.barrier()
        return seen
    finally:
        gloo_p2p.SHORT = True


async def check_sizes_mixed_padded(comm: Comm) -> list[list[float]]:
    return await check_sizes_mixed_on_one_tag(comm, short=False)


def test_large_and_small_messages_on_one_tag(world: World) -> None:
    checks = [check_sizes_mixed_on_one_tag]
    if world.backend == "gloo":
        checks.append(check_sizes_mixed_padded)
    for check in checks:
        seen = world.run(check)[1]
        assert seen[:7] == [[float(i), float(i), -1.0] for i in range(7)], seen
        assert sorted(seen[7:]) == [[float(i), float(i), -1.0] for i in range(7)], seen


async def check_data_tags_are_bounded(comm: Comm) -> list[str]:
    # gloo: a large send's data goes on one of a few reserved tags, none used again before
    # its data was received; with all in use, a send is refused before anything is sent.
    from asyncomm._core import tags

    limit = tags.GLOO_DATA_TAGS
    tags.GLOO_DATA_TAGS = 3
    try:
        said = []
        if comm.rank == 0:
            sends = [comm.send(torch.full((BIG // 4,), float(i)), 1, tag=12) for i in range(3)]
            try:
                await comm.send(torch.zeros(BIG // 4), 1, tag=12)  # (its handle fails)
            except CommError as exc:
                said.append(str(exc))
            await comm.send(torch.zeros(1), 1, tag=13)  # rank 1 receives from now on
            await asyncio.gather(*sends)
            await comm.send(torch.full((BIG // 4,), 3.0), 1, tag=12)  # the tags are free
        elif comm.rank == 1:
            await comm.recv(torch.zeros(1), 0, tag=13)
            for _ in range(4):
                t = torch.zeros(BIG // 4)
                await comm.recv(t, 0, tag=12)
                said.append(f"{t[0].item():g} {t[-1].item():g}")
        return said
    finally:
        tags.GLOO_DATA_TAGS = limit


def test_large_sends_in_flight_are_bounded_on_gloo(world2: World) -> None:
    if world2.backend != "gloo":
        pytest.skip("only gloo's large sends use tags of their own")
    first, second = world2.run(check_data_tags_are_bounded)
    assert len(first) == 1 and "3 large sends to rank 1 are in flight" in first[0], first
    assert second == ["0 0", "1 1", "2 2", "3 3"]


async def check_probed_receives(comm: Comm) -> list[object]:
    # Open MPI's receive into a buffer smaller than a large message crashes the process,
    # so there a receive finds its message by matched probe first (``PROBE_FIRST``). The
    # same checks as above, in that form (on MPICH here): refused, in order, posted ones
    # refused and cancelled, and a receive still looking when its communicator closes
    # fails as closed.
    from asyncomm._backends import mpi_backend

    saved, mpi_backend.PROBE_FIRST = mpi_backend.PROBE_FIRST, True
    try:
        async with fresh(comm) as sub:
            refused = await check_too_small_a_buffer(sub)
            mixed = await check_sizes_mixed_on_one_tag(sub)
            posted = await check_posted_too_small(sub)
            await check_posted_receive_cancelled(sub)
            timed_out = await receive_timed_out(sub)
            pinged = await ping_pong(sub)
            waiting = sub.recv(torch.zeros(1), (sub.rank + 1) % sub.size, tag=99)
            await sub.barrier()
        try:
            await waiting
            closed = "received"
        except CommClosedError:
            closed = "closed"
        return [refused, mixed, posted, closed, timed_out, pinged]
    finally:
        mpi_backend.PROBE_FIRST = saved


async def ping_pong(comm: Comm, n: int = 200) -> bool:
    """A ping-pong of ``n`` awaited exchanges (each answer the question plus one); return
    whether every message this rank received carried what its peer sent."""
    peer, t, right = 1 - comm.rank, torch.zeros(2), True
    for i in range(n):
        if comm.rank == 0:
            t.fill_(2.0 * i)
            await comm.send(t, peer, 30)
            await comm.recv(t, peer, 30)
            right = right and t.tolist() == [2.0 * i + 1] * 2
        else:
            await comm.recv(t, peer, 30)
            right = right and t.tolist() == [2.0 * i] * 2
            t += 1
            await comm.send(t, peer, 30)
    return right


def test_receives_that_probe_first(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("gloo's sends say their size (gloo_p2p)")
    ranks = world2.run(check_probed_receives)
    refused, mixed, posted, closed, timed_out, _ = ranks[1]
    assert refused == ["100: refused", "next 100", f"{BIG}: refused", f"next {BIG}",
                       "4: [0.0, -1.0]", "next 4"], refused
    assert mixed[:7] == [[float(i), float(i), -1.0] for i in range(7)], mixed
    assert sorted(mixed[7:]) == [[float(i), float(i), -1.0] for i in range(7)], mixed
    assert posted == "refused, then [1.0, 1.0, 1.0]"
    assert closed == "closed"
    assert timed_out == [True, True, 0, [3.0, 3.0]], timed_out  # (as on the quick path)
    # awaited receives that look for their message themselves: a ping-pong's every
    # message arrives, in order, on both ranks
    assert [rank[-1] for rank in ranks] == [True, True], ranks


@contextlib.contextmanager
def declines(comm: Comm) -> Iterator[list[object]]:
    """Note the quick sends and receives that leave it to the usual path (where receives
    probe first, all receives do): their peer and tag."""
    backend, declined = comm._backend, []
    names = ("quick_send",) if getattr(backend, "_probe_first", False) else (
        "quick_send", "quick_recv")
    for name in names:
        issue = getattr(backend, name)

        def noted(*args: object, _issue: object = issue) -> object:
            handle = _issue(*args)  # type: ignore[operator]
            if handle is None:
                declined.append(args[1:3])
            return handle

        setattr(backend, name, noted)
    try:
        yield declined
    finally:
        for name in names:
            delattr(backend, name)


async def check_one_buffer_again_and_again(comm: Comm) -> list[object]:
    """The same buffer, peer and tag time after time (MPI keeps a persistent request for
    them), twice in flight at once (the kept request is busy: the second has its own),
    and more buffers than are kept: every message arrives whole, in order."""
    peer, big = 1 - comm.rank, 1 << 18  # (large: on MPI in flight until it is received)
    with declines(comm) as declined:
        return [*await one_buffer_again_and_again(comm, peer, big), declined]


async def one_buffer_again_and_again(comm: Comm, peer: int, big: int) -> list[object]:
    # (MPI keeps a request for a buffer, peer and tag the second time they come: each
    # buffer below goes twice before it is in flight twice at once)
    if comm.rank == 0:
        t = torch.zeros(4)
        for i in range(40):
            t.fill_(float(i))
            await comm.send(t, peer, 9)
        large = torch.arange(big, dtype=torch.float32)
        for _ in range(2):
            await comm.send(large, peer, 10)
        first, second = comm.send(large, peer, 10), comm.send(large, peer, 10)
        pending = not first.done() if comm.backend == "mpi" else True
        await comm.send(torch.zeros(1), peer, 11)  # the receiver takes those two now
        await asyncio.gather(first, second)
        for i in range(100):  # more buffers than are kept
            await comm.send(torch.full((3,), float(i)), peer, 13)
        for _ in range(2):
            await comm.recv(torch.zeros(1), peer, 15)
            await comm.send(torch.zeros(4), peer, 12)
        await comm.recv(torch.zeros(1), peer, 14)  # its two receives of one buffer are posted
        for value in (1.0, 2.0):
            await comm.send(torch.full((4,), value), peer, 12)
        return [pending]
    t, got = torch.zeros(4), []
    for _ in range(40):
        await comm.recv(t, peer, 9)
        got.append(t[0].item())
    large, whole = torch.zeros(big), []
    for i in range(4):
        if i == 2:
            await comm.recv(torch.zeros(1), peer, 11)
        large.zero_()
        await comm.recv(large, peer, 10)
        whole.append(torch.equal(large, torch.arange(big, dtype=torch.float32)))
    kept = [torch.zeros(3) for _ in range(100)]
    for buf in kept:
        await comm.recv(buf, peer, 13)
    buf = torch.zeros(4)
    for _ in range(2):
        await comm.send(torch.zeros(1), peer, 15)  # (one buffer received into twice)
        await comm.recv(buf, peer, 12)
    first, second = comm.recv(buf, peer, 12), comm.recv(buf, peer, 12)
    await comm.send(torch.zeros(1), peer, 14)
    assert await first == peer and await second == peer
    return [got == [float(i) for i in range(40)], whole,
            [b[0].item() for b in kept] == [float(i) for i in range(100)], buf.tolist()]


def test_one_buffer_again_and_again(world2: World) -> None:
    sender, receiver = world2.run(check_one_buffer_again_and_again)
    assert sender == [True, []], sender  # the second large send went while the first waited
    # every message whole and in order; on MPI every one by the quick path (none declined:
    # a kept request in flight is not started again, which MPI refuses). The two receives
    # into one buffer both complete (which wrote last is the backend's affair).
    assert receiver[:3] == [True, [True] * 4, True] and receiver[4] == [], receiver
    assert receiver[3] in ([1.0] * 4, [2.0] * 4), receiver


async def check_a_receive_that_timed_out_keeps_its_buffer(comm: Comm) -> list[object]:
    """A receive (of a buffer MPI keeps a request for) that times out stays posted and takes
    the next message; a receive into the same buffer meanwhile takes the one after, and
    once the first is done its buffer's request serves again."""
    async with fresh(comm) as sub:
        with declines(sub) as declined:
            return [*await receive_timed_out(sub), declined]


async def receive_timed_out(sub: Comm) -> list[object]:
    peer, buf = 1 - sub.rank, torch.zeros(2)
    if sub.rank == 0:
        await sub.send(torch.full((2,), 0.0), peer, 20)
        await sub.recv(torch.zeros(1), peer, 21)  # its receive timed out
        for value in (1.0, 2.0, 3.0):
            await sub.send(torch.full((2,), value), peer, 20)
        await sub.recv(torch.zeros(1), peer, 21)
        return []
    await sub.recv(buf, peer, 20)  # the buffer seen once: kept from the next on
    sub._timeout = sub._deadlines.default = 0.3  # (the default deadline: quick receives')
    timed_out = sub.recv(buf, peer, 20)
    try:
        await timed_out
    except CommTimeoutError:
        pass
    sub._timeout = sub._deadlines.default = 30.0
    second = sub.recv(buf, peer, 20)  # the kept request is still posted: one of its own
    await sub.send(torch.zeros(1), peer, 21)
    assert await second == peer
    deadline = time.monotonic() + 30  # the timed-out receive took 1.0; the poller sees it
    while timed_out._keep is not None and time.monotonic() < deadline:  # done (in a while)
        await asyncio.sleep(0.001)
    third = await sub.recv(buf, peer, 20)
    got = buf.tolist()
    await sub.send(torch.zeros(1), peer, 21)
    return [timed_out.done(), timed_out._keep is None, third, got]


def test_a_receive_that_timed_out_keeps_its_buffer(world2: World) -> None:
    receiver = world2.run(check_a_receive_that_timed_out_keeps_its_buffer)[1]
    assert receiver == [True, True, 0, [3.0, 3.0], []], receiver  # none declined


async def check_quick_and_usual_paths(comm: Comm) -> list[tuple[object, ...]]:
    """Plain CPU tensors take the quick path where the backend has one (MPI); arrays and
    explicit deadlines the usual one. Both number their operations in turn, name the same
    things and move the same values."""
    peer, taken = 1 - comm.rank, []
    backend = comm._backend
    for name in ("quick_all_reduce", "quick_send", "quick_recv"):  # count the quick issues
        issue = getattr(backend, name)

        def counted(*args: object, _issue: object = issue, _name: str = name) -> object:
            handle = _issue(*args)  # type: ignore[operator]
            if handle is not None:  # (None: not a tensor the backend takes quickly)
                taken.append(_name)
            return handle

        setattr(backend, name, counted)
    seen: list[tuple[object, ...]] = []
    try:
        for form, timeout in ((torch.Tensor.clone, None), (torch.Tensor.clone, None),
                              (torch.Tensor.numpy, None), (torch.Tensor.clone, 30.0)):
            t = form(torch.arange(4, dtype=torch.float32) + comm.rank)
            reduced = comm.all_reduce(t, timeout=timeout)
            assert await reduced is t and torch.equal(torch.as_tensor(t),
                                                      torch.arange(4) * 2.0 + 1)
            buf = form(torch.zeros(4, dtype=torch.float32))
            moved = (comm.send(form(torch.full((4,), 7.0)), peer, 41, timeout=timeout)
                     if comm.rank == 0 else comm.recv(buf, peer, 41, timeout=timeout))
            assert await moved == (None if comm.rank == 0 else peer)
            if comm.rank == 1:
                assert torch.equal(torch.as_tensor(buf), torch.full((4,), 7.0))
            seen += [(h.op, h.seq, h.peer, h.tag) for h in (reduced, moved)]
    finally:
        for name in ("quick_all_reduce", "quick_send", "quick_recv"):
            delattr(backend, name)
    seqs = [s[1] for s in seen]
    assert seqs == list(range(seqs[0], seqs[0] + 8)), seen
    assert {s[0] for s in seen[::2]} == {"all_reduce"} and {s[2:] for s in seen[1::2]} == {
        (peer, 41)}, seen
    return [comm.backend, *taken]


def test_quick_and_usual_paths_agree(world2: World) -> None:
    for rank, result in enumerate(world2.run(check_quick_and_usual_paths)):
        backend, taken = result[0], result[1:]
        if backend != "mpi":
            assert taken == [], result
            continue
        # the plain tensors without a deadline given; an all_reduce of an (op, dtype) new
        # to the communicator takes the usual path, and makes that pair quick from then on
        assert taken.count("quick_send" if rank == 0 else "quick_recv") == 2, result
        assert taken.count("quick_all_reduce") in (1, 2) and len(taken) in (3, 4), result


async def check_a_waiting_receive_leaves_the_poller_idle(comm: Comm) -> list[list[bool]]:
    """A quick receive still waiting for its message counts as passive for MPI's poller
    (which polls at every loop turn for ``active_busy_s`` after sends and collectives,
    0.1 s, but ``busy_s`` after receives): an idle rank awaiting a message must not spend
    its wait's CPU as if its receive were active."""
    peer, seen = 1 - comm.rank, []
    for _ in range(2):  # (the second: a buffer, peer and tag seen before)
        if comm.rank == 0:
            waiting = comm.recv(torch.zeros(2), peer, 33)
            entries = comm._backend._poller._entries  # (sink, finish, active) each
            deadline = time.monotonic() + 30  # enlisted once the issuing iteration ends
            while (not any(entry[0] is waiting for entry in entries)
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.001)
            seen.append([entry[2] for entry in entries if entry[0] is waiting])
            await comm.send(torch.zeros(1), peer, 34)
            assert await waiting == peer
        else:
            await comm.recv(torch.zeros(1), peer, 34)
            await comm.send(torch.zeros(2), peer, 33)
    return seen


def test_a_waiting_receive_leaves_the_poller_idle(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("MPI's poller")
    assert world2.run(check_a_waiting_receive_leaves_the_poller_idle)[0] == [[False]] * 2


async def check_small_all_reduces_kept_in_step(comm: Comm) -> list[object]:
    """Small all-reduces (kept persistent requests on MPI, see ``_backends/mpi_reduce``):
    more of a kind in flight than it keeps requests for, among other collectives; each
    rank taking its own path (quick, usual, another tensor each time); a split after."""
    async with fresh(comm) as sub:
        reductions = getattr(sub._backend, "_reductions", None)
        held = []
        t = torch.zeros(2)
        for i in range(6):  # one tensor again and again
            t.fill_(i + sub.rank)
            assert await sub.all_reduce(t) is t
            assert t.tolist() == [2.0 * i + 1] * 2, (i, t)
        for i in range(6):  # each rank its own way: a deadline, a view, a fresh tensor
            way = (i + sub.rank) % 3
            memory = torch.full((4,), -1.0)
            x = memory[1:3] if way == 1 else torch.zeros(2)
            x.fill_(i + sub.rank)
            await sub.all_reduce(x, timeout=30.0 if way == 0 else None)
            assert x.tolist() == [2.0 * i + 1] * 2, (i, way, x)
            assert memory[0].item() == memory[3].item() == -1.0  # nothing beyond the view
        xs = [torch.full((2,), float(i + sub.rank)) for i in range(10)]
        other = torch.full((3,), float(sub.rank))
        if sub.rank == 1:  # issued once rank 0's five are: those stay in flight till then,
            await sub.recv(torch.zeros(1), 0, tag=77)  # so rank 0's fifth is held
        handles = [sub.all_reduce(x) for x in xs[:5]]  # more than a kind keeps requests for
        held.append(reductions is not None and reductions.held is not None)
        if sub.rank == 0:
            await sub.send(torch.zeros(1), 1, tag=77)
        handles += [sub.broadcast(other, src=1), sub.all_reduce(xs[5], "max"), sub.barrier()]
        handles += [sub.all_reduce(x) for x in xs[6:]]
        await asyncio.gather(*handles)
        assert [x[0].item() for x in xs[:5] + xs[6:]] == [2.0 * i + 1 for i in range(10)
                                                          if i != 5], xs
        assert xs[5].tolist() == [5.0 + 1] * 2 and other.tolist() == [1.0] * 3
        for _ in range(3):  # averages (the usual path) kept too; the last in flight
            avg = torch.full((2,), float(sub.rank))
            handle = sub.all_reduce(avg, "avg")
        await handle
        assert avg.tolist() == [0.5, 0.5]
        pair = await sub.group([0, 1])  # a collective after the kept ones
        if pair is not None:
            await pair.close()
        kept = 0 if reductions is None else len(reductions._kept)
    return [*held, kept]


def test_small_all_reduces_kept_in_step(world2: World) -> None:
    ranks = world2.run(check_small_all_reduces_kept_in_step)
    if world2.backend == "mpi":  # kept, and on rank 0 collectives were held back
        assert [kept >= 4 for _, kept in ranks] == [True, True] and ranks[0][0], ranks
