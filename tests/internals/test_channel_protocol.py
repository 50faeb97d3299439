"""Channels on real gloo and MPI worlds, reaching into the messaging layer on purpose.

Flow control is read where it lives (a sender waiting for credit in its window, frames
held in a mailbox); the link's messages are counted, held back or forged (heads, packets,
runs, batches, oversized messages) to see each refused for its own channel or source
alone; large frames' buffers are read to see them lent again. Some checks make a
``Channel`` on the router directly (no peer checks), put an MPI link of the other kind in,
or read the gloo lane's readers and writers and the communicator's unopened channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from test_channels import WINDOW, MiB, expect_nothing, until

import asyncomm
from asyncomm import Channel, Comm
from asyncomm._core import small, tags, wire
from asyncomm._core.messages import BATCH, PACKET, PREAMBLE
from asyncomm._core.wire import Kind
from asyncomm._messaging.router import frame_limits
from asyncomm.testing import World, fresh


def waiting_for_credit(comm: Comm, dst: int, tag: int) -> bool:
    """Whether a send of this rank to ``dst`` on channel ``tag`` waits for credit (private)."""
    window = comm._router._windows.get((dst, tag))
    return window is not None and bool(window.waiters)


def arrived(comm: Comm, tag: int) -> int:
    """How many frames of channel ``tag`` wait in this rank's mailbox (private)."""
    box = comm._router._mailboxes.get(tag)
    return 0 if box is None else len(box.frames)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def check_fairness(comm: Comm, n: int) -> list[int] | None:
    ch, note = comm.channel(200), comm.channel(201)
    await comm.barrier()
    if comm.rank == 0:
        for _ in range(2):  # both senders have filled their windows: they wait for credit
            await note.recv()
        order = []
        for _ in range(2 * n):
            msg = await ch.recv()
            order.append(msg.src)
        return order
    sending = asyncio.ensure_future(_send_all(ch, n))
    await until(lambda: waiting_for_credit(comm, 0, 200) or sending.done(), "waiting for credit")
    assert not sending.done(), "every message went without credit"
    await note.send("window full", 0)
    await sending
    return None


async def _send_all(ch: Channel, n: int) -> None:
    for i in range(n):
        await ch.send(i, 0)


def test_any_source_recv_serves_every_sender(world: World) -> None:
    n = 300
    order = world.run(check_fairness, n)[0]
    assert sorted(order) == [1] * n + [2] * n
    first_half = order[:n]
    # Each of the two senders must hold a share of the first half: both windows were
    # full when the receiver began, so each sender had 64 messages waiting, and credit
    # came back to both as the receiver took them in arrival order.
    for src in (1, 2):
        assert first_half.count(src) >= WINDOW, (src, first_half.count(src), order)


async def check_cancelled_recv(comm: Comm) -> None:
    ch, go = comm.channel(300), comm.channel(301)
    if comm.rank == 1:
        blocked = asyncio.ensure_future(ch.recv(src=0))
        await asyncio.sleep(0.1)
        assert not blocked.done()
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await go.send("send now", 0)
        msg = await ch.recv()
        assert (msg.src, msg.tag, msg.data) == (0, 300, "first")
        with pytest.raises(asyncomm.CommTimeoutError, match="channel 300"):
            await ch.recv(timeout=0.2)
        await go.send("timed out", 0)
        # rank 0 sends "late", then "sent": frames from one rank arrive in order, so
        # "late" is here, between two receives, once "sent" is.
        assert (await go.recv(src=0)).data == "sent"
        assert arrived(comm, 300) == 1
        msg = await ch.recv(timeout=5.0)
        assert (msg.src, msg.data) == (0, "late")
        await expect_nothing(ch)
    elif comm.rank == 0:
        assert (await go.recv(src=1)).data == "send now"
        await ch.send("first", 1)
        assert (await go.recv(src=1)).data == "timed out"
        await ch.send("late", 1)
        await go.send("sent", 1)


def test_cancelled_recv_loses_nothing_and_timeout_names_the_channel(world: World) -> None:
    world.run(check_cancelled_recv)


async def check_woken_then_cancelled(comm: Comm) -> None:
    # Two receives wait; a message wakes the first, which is cancelled before it runs:
    # the second must be woken in its place (no patrol here to wake it later: probe off).
    ch = Channel(comm._router, 303, wire.Codec.DEFAULT, math.inf)
    for i in range(10):
        first, second = asyncio.ensure_future(ch.recv()), asyncio.ensure_future(ch.recv())
        for _ in range(3):
            await asyncio.sleep(0)
        await ch.send(i, comm.rank)  # kept in the mailbox, wakes the first receive
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert (await asyncio.wait_for(second, 10.0)).data == i
    await expect_nothing(ch)


def test_a_woken_receive_cancelled_passes_its_wake_on(world: World) -> None:
    world.run(check_woken_then_cancelled)


async def check_flow_control(comm: Comm, n: int) -> dict[str, Any] | None:
    ch = comm.channel(400)
    await comm.barrier()
    if comm.rank == 0:
        done_at: list[float] = []

        async def produce() -> None:
            for i in range(n):
                await ch.send(torch.full((MiB // 4,), i, dtype=torch.int32), 1)
                done_at.append(time.monotonic())

        producing = asyncio.ensure_future(produce())
        await until(lambda: waiting_for_credit(comm, 1, 400) or producing.done(),
                    "waiting for credit")
        assert not producing.done(), "300 MiB went without waiting for credit"
        await comm.channel(402).send("waiting for credit", 1)
        await producing
        return {"done_at": done_at}
    if comm.rank == 1:
        base = peak = rss_bytes()
        assert (await comm.channel(402).recv(src=0)).data == "waiting for credit"
        router = comm._router
        assert router is not None
        held, waiting = len(router._mailboxes[400].frames), rss_bytes() - base
        started = time.monotonic()
        for i in range(n):
            msg = await ch.recv(src=0)
            t = msg.data
            assert t.dtype == torch.int32 and t.shape == (MiB // 4,)
            assert int(t[0]) == i and bool((t == i).all()), f"message {i} holds {int(t[0])}"
            del msg, t
            if i % 8 == 0:
                peak = max(peak, rss_bytes())
        return {"started": started, "held": held, "waiting": waiting, "growth": peak - base}
    return None


def test_flow_control_blocks_a_fast_producer(world: World) -> None:
    n = 300  # 300 MiB: far beyond the window of 64 messages / 64 MiB
    producer, consumer, _ = world.run(check_flow_control, n)
    before = sum(t < consumer["started"] for t in producer["done_at"])
    assert 1 <= before <= WINDOW + 2, f"{before} sends completed before the receiver consumed"
    assert consumer["held"] <= WINDOW, consumer
    # Without flow control the receiver would hold all 300 MiB while it sleeps. (While
    # it consumes, its RSS may rise further: freed buffers are not all returned at once.)
    assert consumer["waiting"] < 150 * MiB, f"the receiver's RSS grew {consumer['waiting']}"
    assert consumer["growth"] < 300 * MiB, f"the receiver's RSS grew {consumer['growth']}"


async def check_send_credit_timeout(comm: Comm) -> list[int] | None:
    ch = comm.channel(401)
    if comm.rank == 0:
        for i in range(WINDOW):
            await ch.send(i, 1)
        with pytest.raises(asyncomm.CommTimeoutError, match="channel 401 send to peer 1"):
            await ch.send(-1, 1, timeout=0.2)  # no credit: never sent
        blocked = asyncio.ensure_future(ch.send(-2, 1))
        await until(lambda: waiting_for_credit(comm, 1, 401), "waiting for credit")
        assert not blocked.done()
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await comm.channel(402).send("go", 1)
        for i in range(WINDOW, 2 * WINDOW):  # waits for credit, then goes on
            await ch.send(i, 1)
        assert (await comm.channel(402).recv(src=1)).data == "all consumed"
        window = comm._router._windows[1, 401]  # type: ignore[union-attr]
        return [window.messages_out, window.bytes_out]  # every credit came back
    if comm.rank == 1:
        assert (await comm.channel(402).recv(src=0)).data == "go"
        got = [(await ch.recv(src=0)).data for _ in range(2 * WINDOW)]
        assert got == list(range(2 * WINDOW))  # no gap where the failed sends were
        await expect_nothing(ch)
        await comm.channel(402).send("all consumed", 0)
    return None


def test_send_that_timed_out_or_was_cancelled_leaves_no_gap(world: World) -> None:
    # Both used to leave a hole in the sequence numbers: the receiver then refused
    # the next message with "frame N+1 where N was due". And the byte credit
    # returned was smaller than the one taken, so windows shrank for good.
    assert world.run(check_send_credit_timeout)[0] == [0, 0]


async def check_close_wakes_blocked(comm: Comm) -> None:
    sub = await comm.group(range(comm.size))
    assert sub is not None
    ch = sub.channel(403)
    if sub.rank == 0:
        for i in range(WINDOW):
            await ch.send(i, 1)
        blocked = [asyncio.ensure_future(ch.send(i, 1)) for i in range(2)]
        receiving = asyncio.ensure_future(ch.recv(src=2))
        await until(lambda: waiting_for_credit(sub, 1, 403), "waiting for credit")
        await sub.close()
        done, _ = await asyncio.wait([*blocked, receiving], timeout=5.0)
        assert len(done) == 3, "a send or receive blocked in a channel outlived its communicator"
        for task in done:
            assert isinstance(task.exception(), asyncomm.CommClosedError), task.exception()
    else:
        await sub.close()  # waits for rank 0's goodbye: rank 0 closes with work blocked


def test_closing_the_communicator_wakes_blocked_sends_and_receives(world: World) -> None:
    world.run(check_close_wakes_blocked)


async def check_unopened(comm: Comm, n: int) -> int | None:
    note = comm.channel(500)
    if comm.rank == 0:
        ch = comm.channel(501)
        sending = asyncio.ensure_future(_send_numbered(ch, n))
        await until(lambda: waiting_for_credit(comm, 1, 501) or sending.done(),
                    "waiting for credit")
        assert not sending.done(), "every message went without credit"
        await note.send("window full", 1)
        await sending
    elif comm.rank == 1:
        assert (await note.recv(src=0)).data == "window full"  # frames before it are here
        router = comm._router
        assert router is not None and 501 not in comm._channels
        held = len(router._mailboxes[501].frames)  # kept, but not beyond one window
        ch = comm.channel(501)
        for i in range(n):
            msg = await ch.recv()
            assert msg.src == 0 and msg.data[0] == i and torch.equal(msg.data[1],
                                                                     torch.full((i,), i))
        await expect_nothing(ch)
        return held
    return None


async def _send_numbered(ch: Channel, n: int) -> None:
    for i in range(n):
        await ch.send((i, torch.full((i,), i)), 1)


def test_messages_for_an_unopened_channel_wait_for_it(world: World) -> None:
    held = world.run(check_unopened, 150)[1]
    assert held == WINDOW  # kept, but not beyond one window


async def check_unopened_fresh(comm: Comm) -> None:
    # A fresh communicator: the receiver has no router yet when the message comes.
    async with fresh(comm) as sub:
        if sub.rank == 1:
            sub.channel(505)  # closing waits for a goodbye from every rank's router
        if sub.rank == 0:
            await sub.channel(504).send("early", 2)
        elif sub.rank == 2:
            await until(lambda: arrived(sub, 504) == 1, "arrived")  # before any channel
            assert not sub._channels
            msg = await sub.channel(504).recv(timeout=5.0)
            assert (msg.src, msg.data) == (0, "early")
        await sub.barrier()


def test_message_before_the_receiver_opened_any_channel(world: World) -> None:
    world.run(check_unopened_fresh)


def forged_heads(tag: int) -> dict[str, bytes]:
    good, _ = wire.encode(Kind.DATA, tag, 0, "fine")
    # One descriptor, of a flat uint8 buffer, right after the prefix: u8 dtype, u8 kind,
    # u8 ndim, u64 shape, u64 nbytes. Make it claim more than Limits.max_message_bytes.
    real, _ = wire.encode(Kind.DATA, tag, 0, torch.zeros(4, dtype=torch.uint8))
    at, huge = wire.PREFIX_BYTES + 3, 1 << 31
    oversized = real[:at] + struct.pack("<QQ", huge, huge) + real[at + 16:]
    tensor, _ = wire.encode(Kind.DATA, tag, 0, torch.zeros(2))
    return {
        "garbage": b"JUNK\x07\x07\x07\x07" + struct.pack("<Q", tag) + bytes(range(40)),
        "oversized": oversized,
        "version": good[:4] + bytes([wire.VERSION + 1]) + good[5:],
        "inline mismatch": tensor,  # declares an 8-byte buffer, the message carries none
    }


async def check_corrupt_frames(comm: Comm) -> None:
    ch, other = comm.channel(600), comm.channel(601)
    heads = forged_heads(600)
    if comm.rank == 0:
        await ch.send("v0", 1)
        await other.send("o0", 1)
        for i, head in enumerate(heads.values()):
            for handle in comm._router.link.send(1, head, []):  # as it is, no buffers
                await handle
            await ch.send(f"v{i + 1}", 1)
            await other.send(f"o{i + 1}", 1)
    elif comm.rank == 1:
        for i, what in enumerate(heads):
            assert (await ch.recv(src=0)).data == f"v{i}"
            with pytest.raises(asyncomm.ProtocolError, match="channel 600") as refused:
                await ch.recv(src=0)
            assert "rank 0" in str(refused.value), what
        assert (await ch.recv(src=0)).data == f"v{len(heads)}"
        assert [(await other.recv(src=0)).data for _ in range(len(heads) + 1)] == [
            f"o{i}" for i in range(len(heads) + 1)]
        assert (await ch.recv(src=2)).data == "from 2"
        await expect_nothing(ch)
        await expect_nothing(other)
    else:
        await ch.send("from 2", 1)


def test_corrupt_frames_fail_their_channel_only(world: World) -> None:
    world.run(check_corrupt_frames)


@contextlib.contextmanager
def probing_link(probing: bool) -> Iterator[None]:
    """Communicators made meanwhile on MPI find link messages by probe (``ProbeLink``, as
    on Open MPI) or keep a receive posted for them (``PostedLink``, as on MPICH)."""
    from asyncomm._backends import mpi_backend

    saved, mpi_backend.PROBE_FIRST = mpi_backend.PROBE_FIRST, probing
    try:
        yield
    finally:
        mpi_backend.PROBE_FIRST = saved


async def check_oversized_message(comm: Comm, probing: bool) -> None:
    # A link message beyond the most an MPI message may hold: refused (a probing link
    # allocates nothing for it; a posted receive is cut short by MPI), and the stream from
    # its source ends, since what follows it can't be trusted; other sources go on.
    from asyncomm._backends.mpi_link import MESSAGE_BYTES, PostedLink, ProbeLink
    from asyncomm._core import tags

    with probing_link(probing):
        async with fresh(comm) as sub:
            link = sub._router.link
            assert type(link) is (ProbeLink if probing else PostedLink)
            ch = sub.channel(610)
            if sub.rank == 0:
                await ch.send("before", 1)
                link.flush()  # "before" goes first (it waits for the loop iteration's end)
                handle = link._post(bytearray(MESSAGE_BYTES + 1), 1, tags.LINK_MESSAGE)
                if handle is not None:
                    await handle
            elif sub.rank == 1:
                assert (await ch.recv(src=0)).data == "before"
                with pytest.raises(asyncomm.ProtocolError, match="stream from rank 0 broken"):
                    await ch.recv(src=0, timeout=10.0)
                assert (await ch.recv(src=2, timeout=10.0)).data == "from 2"
            else:
                await ch.send("from 2", 1)
            await sub.barrier()


@pytest.mark.parametrize("probing", [True, False], ids=["probing", "posted"])
def test_oversized_mpi_message_ends_its_source_stream(world: World, probing: bool) -> None:
    if world.backend != "mpi":
        pytest.skip("gloo receives have a fixed size: a larger message is never taken")
    from asyncomm._backends import mpi_backend

    if not probing and mpi_backend.PROBE_FIRST:
        pytest.skip("Open MPI's truncated receive crashes the process: its link probes")
    world.run(check_oversized_message, probing)


def test_size_limit_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOMM_MAX_MESSAGE_BYTES", "0")
    with pytest.raises(ValueError, match="ASYNCOMM_MAX_MESSAGE_BYTES"):
        frame_limits()
    monkeypatch.setenv("ASYNCOMM_MAX_MESSAGE_BYTES", "1000")
    assert frame_limits().max_message_bytes == 1000


async def check_pending_messages_keep_order(comm: Comm) -> None:
    # A link message not received at once holds back the later messages of its source
    # until it is in. Open MPI's shared-memory eager limit (4 KiB) makes most link messages
    # such; MPICH's never (measured: its probe matches only whole messages below 1 MiB,
    # shared memory or TCP, and link messages are at most 64 KiB and a head). So one is
    # stood in for 0.3 s: the order under test is the link's, whatever keeps the message.
    # (Where the link keeps a receive posted, MPICH, every message is whole when found: it
    # probes here, as on Open MPI.)
    with probing_link(True):
        async with fresh(comm) as sub:
            ch = sub.channel(630)
            if sub.rank == 1:
                link = sub._router.link
                link._behind[0] = asyncio.ensure_future(asyncio.sleep(0.3))
            await sub.barrier()
            if sub.rank == 0:
                for i in range(20):
                    await ch.send([i, torch.full((i * 1000,), i, dtype=torch.int32)], 1)
            elif sub.rank == 1:
                for i in range(20):
                    n, t = (await ch.recv(src=0, timeout=10.0)).data
                    assert n == i and t.numel() == i * 1000 and bool((t == i).all())
                await until(lambda: not link._behind, "done holding messages back")
            await sub.barrier()


def test_pending_mpi_messages_keep_their_order(world: World) -> None:
    if world.backend != "mpi":
        pytest.skip("only the MPI link receives messages of unknown size")
    world.run(check_pending_messages_keep_order)


def test_forged_heads_are_what_they_claim() -> None:
    heads = forged_heads(600)
    with pytest.raises(asyncomm.ProtocolError, match="magic"):
        wire.decode_head(heads["garbage"])
    with pytest.raises(asyncomm.ProtocolError, match="limit"):
        wire.decode_head(heads["oversized"])
    with pytest.raises(asyncomm.ProtocolError, match="version"):
        wire.decode_head(heads["version"])
    assert wire.decode_head(heads["inline mismatch"]).payload_bytes == 8
    assert struct.unpack_from("<Q", heads["garbage"], 8)[0] == 600  # where the router reads it


def count_packets(comm: Comm) -> list[int]:
    """Record the destination of every link message this rank posts (private)."""
    link = comm._router.link
    posted: list[int] = []
    post = link._post

    def counting(buffer: Any, dst: int, tag: int) -> Any:
        if tag == tags.LINK_MESSAGE:
            posted.append(dst)
        return post(buffer, dst, tag)

    link._post = counting  # type: ignore[method-assign]
    return posted


async def check_burst_is_one_message(comm: Comm, n: int) -> None:
    async with fresh(comm) as sub:
        ch = sub.channel(900)
        n = min(n, sub._router.link._outbox.packet_frames // 2)  # 2 frames a turn, in one packet
        if sub.rank == 0:
            posted = count_packets(sub)
            await ch.send("first", 1)  # the first of a burst leaves at once
            assert posted == [1], posted
            for i in range(n):  # the rest, issued within one loop iteration, travel together
                await ch.send(torch.full((2,), float(i)), 1)
                await ch.send({"i": i}, 1)
            assert posted == [1], "a small message after the first left before the iteration ended"
            await asyncio.sleep(0)  # the iteration ends: one packet leaves
            assert posted == [1, 1], posted
            await ch.send("lone", 1)  # a lone message waits for nothing
            assert posted == [1, 1, 1], posted
            await ch.send("asked", 1)
            reply = asyncio.ensure_future(ch.recv(1))
            await asyncio.sleep(0)  # its receive began waiting: the question left at once
            assert posted == [1, 1, 1, 1], posted
            assert (await reply).data == "answer"
        elif sub.rank == 1:
            assert (await ch.recv(0)).data == "first"
            for i in range(n):
                assert torch.equal((await ch.recv(0)).data, torch.full((2,), float(i)))
                assert (await ch.recv(0)).data == {"i": i}
            assert (await ch.recv(0)).data == "lone"
            assert (await ch.recv(0)).data == "asked"
            await ch.send("answer", 0)
        await sub.barrier()


def test_a_burst_of_small_messages_travels_as_one_message(world: World) -> None:
    world.run(check_burst_is_one_message, WINDOW // 4)  # within one window: no credit wait


async def check_long_burst_in_packets(comm: Comm) -> None:
    # A burst longer than a packet's frames leaves packet by packet as it is issued (the
    # receiver decodes the first while the rest are issued); what is left, when the loop
    # iteration ends. Order and content are kept across packets.
    async with fresh(comm) as sub:
        ch = sub.channel(901)
        frames = sub._router.link._outbox.packet_frames
        n = min(frames + 3, WINDOW // 2)  # within one window: no credit wait
        if sub.rank == 0:
            posted = count_packets(sub)
            await ch.send("first", 1)  # (leaves at once: the first of a burst)
            for i in range(n):
                await ch.send({"i": i}, 1)
            assert posted == [1] * (1 + (n - 1) // frames), (posted, frames)  # the full ones
            await asyncio.sleep(0)
            assert posted == [1] * (1 + -(-n // frames)), (posted, frames)
        elif sub.rank == 1:
            assert (await ch.recv(0)).data == "first"
            assert [(await ch.recv(0)).data["i"] for _ in range(n)] == list(range(n))
        await sub.barrier()


def test_a_long_burst_leaves_in_packets_as_it_is_issued(world: World) -> None:
    world.run(check_long_burst_in_packets)


async def check_large_envelopes_share_messages(comm: Comm) -> None:
    # Large messages issued within one loop iteration: on gloo their envelopes travel
    # together, when the iteration ends (the data moves from each tensor's own memory);
    # small and medium messages issued between them keep their place in the order.
    async with fresh(comm) as sub:
        ch = sub.channel(905)
        kinds = ["large", "small", "large", "large", "medium", "large", "small", "large",
                 "large", "small"]

        room = sub._router.link.room  # a large message does not fit one link message
        big = room // 4 + 64

        def item(i: int) -> list[Any]:
            n = {"large": big, "medium": 256, "small": 1}[kinds[i]]  # float32s
            return [i, torch.full((n,), float(i))]

        if sub.rank == 0:
            posted = count_packets(sub)
            await asyncio.gather(*(ch.send(item(i), 1) for i in range(len(kinds))))
            batches = sub._router.link.batching  # gloo's: MPI sends an envelope a frame
            # batch 0 | small | batch 2-3 | medium | batch 5 | small | batch 7-8 | small
            assert len(posted) == (8 if batches else 10), posted
            del posted[:]
            await asyncio.gather(*(ch.send(torch.full((big,), float(i)), 1)
                                   for i in range(40)))
            assert posted == [1] * (1 if batches else 40), posted
        elif sub.rank == 1:
            for i in range(len(kinds)):
                got: Any = (await ch.recv(0)).data
                assert got[0] == i and torch.equal(got[1], item(i)[1]), (i, got[0])
            for i in range(40):
                assert bool(torch.all((await ch.recv(0)).data == i)), i
        await sub.barrier()


def test_large_messages_issued_together_share_envelopes_and_keep_order(world: World) -> None:
    world.run(check_large_envelopes_share_messages)


async def check_late_data(comm: Comm) -> None:
    # The data of large frames leaves a while after their envelopes: each frame is
    # received once its data is in (on MPI, not at once as commonly: the receive is
    # watched), and a small message sent after them still comes after them.
    async with fresh(comm) as sub:
        ch, checked = sub.channel(906), sub.channel(907)
        big = sub._router.link.room // 4 + 64  # float32s: more than a link message holds
        if sub.rank == 0:
            link = sub._router.link
            post, data = link._post, []

            def late(buffer: Any, dst: int, tag: int) -> Any:
                if tag != tags.LINK_DATA:
                    return post(buffer, dst, tag)
                data.append((buffer, dst, tag))  # held until rank 1 has looked
                return None  # (the send counts as done: its tensor is left as it is)

            link._post = late  # type: ignore[method-assign]
            for i in range(3):
                await ch.send(torch.full((big,), float(i)), 1)
            await ch.send("after", 1)
            assert (await checked.recv(1)).data == "checked"
            link._post = post  # type: ignore[method-assign]
            for held in data:  # now the data leaves
                post(*held)
        elif sub.rank == 1:
            await asyncio.sleep(0.15)  # the envelopes and the small message are in, likely
            assert arrived(sub, 906) == 0  # none is whole: "after" waits behind them
            await checked.send("checked", 0)
            for i in range(3):
                assert bool(torch.all((await ch.recv(0)).data == i)), i
            assert (await ch.recv(0)).data == "after"
        await sub.barrier()


def test_frames_whose_data_comes_late_are_received_in_order(world: World) -> None:
    world.run(check_late_data)


async def check_small_beside_a_stream(comm: Comm) -> None:
    # Small messages both ways while large frames stream keep their order, exactly once.
    # On gloo the frames' data goes on the link's own lane, never through gloo's pairs.
    async with fresh(comm) as sub:
        link: Any = sub._router.link
        gloo = sub.backend == "gloo"
        data_through_gloo = 0
        if gloo:
            endpoint = link._endpoint
            send = endpoint.send_raw

            def watched(sink: Any, tensor: torch.Tensor, dst: int, tag: int) -> None:
                nonlocal data_through_gloo
                data_through_gloo += tag != tags.LINK_MESSAGE
                send(sink, tensor, dst, tag)

            endpoint.send_raw = watched
        big, small, back = sub.channel(908), sub.channel(909), sub.channel(910)
        frames, n = 48, (256 << 10) // 4
        if sub.rank == 0:
            async def stream() -> None:
                for i in range(frames):
                    await big.send(torch.full((n,), float(i)), 1)
                    if i % 4 == 3:
                        await small.send({"after": i}, 1)

            async def answers() -> None:
                for j in range(100):
                    assert (await back.recv(1)).data == {"j": j}

            await asyncio.gather(stream(), answers())
            if gloo:
                assert 1 in link._lane._writers  # the data went on the lane
        elif sub.rank == 1:
            async def take() -> None:
                for i in range(frames):
                    got = (await big.recv(0)).data
                    assert got.shape == (n,) and bool(torch.all(got == i)), i
                    if i % 4 == 3:
                        assert (await small.recv(0)).data == {"after": i}

            async def talk() -> None:
                for j in range(100):
                    await back.send({"j": j}, 0)
                    if j % 10 == 9:
                        await asyncio.sleep(0.001)

            await asyncio.gather(take(), talk())
        assert data_through_gloo == 0
        await sub.barrier()


def test_small_messages_beside_a_stream(world: World) -> None:
    world.run(check_small_beside_a_stream)


async def check_messages_not_held_behind_data(comm: Comm) -> None:
    # On gloo, a link message sent while a data message is out goes at once, whatever the
    # data waits for: here rank 0's lane writer is held after its first data message until
    # rank 1 has answered messages sent after that data. (MPI: the same traffic, nothing
    # held.)
    async with fresh(comm) as sub:
        big, small = sub.channel(911), sub.channel(912)
        release = threading.Event()
        if sub.rank == 0:
            if sub.backend == "gloo":  # (rank 0's only data here: its send's)
                from asyncomm._backends import gloo_lane

                streams = (gloo_lane._DirectOut, gloo_lane._RingOut, gloo_lane._TcpOut)
                writes = [stream.write for stream in streams]

                def held(write: Any) -> Any:  # (its bytes go; its done waits for release)
                    def written(self: Any, tensor: torch.Tensor, done: Any) -> None:
                        write(self, tensor, lambda failure: (release.wait(30.0), done(failure)))
                    return written

                for stream, write in zip(streams, writes, strict=True):
                    stream.write = held(write)  # type: ignore[method-assign]
            sent = asyncio.ensure_future(big.send(torch.ones(1 << 18), 1))
            await asyncio.sleep(0)
            for i in range(3):
                await small.send(i, 1)
            assert (await small.recv(1, timeout=20.0)).data == "got"
            assert not release.is_set() and (sub.backend != "gloo" or not sent.done())
            release.set()
            await sent
            if sub.backend == "gloo":
                for stream, write in zip(streams, writes, strict=True):
                    stream.write = write  # type: ignore[method-assign]
        elif sub.rank == 1:
            assert bool(torch.all((await big.recv(0)).data == 1))
            assert [(await small.recv(0)).data for _ in range(3)] == [0, 1, 2]
            await small.send("got", 0)
        await sub.barrier()


def test_link_messages_not_held_behind_data(world: World) -> None:
    world.run(check_messages_not_held_behind_data)


async def check_padded_link_messages(comm: Comm) -> list[int]:
    # Where gloo's transport reads as many bytes as a receive holds (libuv: macOS,
    # Windows), every link message is padded to the receives' size; the same traffic
    # as above goes through, in order.
    from asyncomm._backends import gloo_link

    short, most = gloo_link.SHORT, gloo_link.ENVELOPE_BYTES
    gloo_link.SHORT, gloo_link.ENVELOPE_BYTES = False, 4 << 10  # as there
    try:
        lengths: list[int] = []
        async with fresh(comm) as sub:
            endpoint: Any = sub._router.link._endpoint  # type: ignore[attr-defined]
            send = endpoint.send_raw

            def measured(sink: Any, tensor: torch.Tensor, dst: int, tag: int) -> None:
                lengths.append(tensor.numel())
                send(sink, tensor, dst, tag)

            endpoint.send_raw = measured
            await check_large_envelopes_share_messages(sub)
        return lengths
    finally:
        gloo_link.SHORT, gloo_link.ENVELOPE_BYTES = short, most


def test_padded_gloo_link_messages(world: World) -> None:
    if world.backend != "gloo":
        pytest.skip("only gloo's receives must know their size")
    lengths = world.run(check_padded_link_messages)[0]
    assert len(lengths) >= 8 and set(lengths) == {4096}, lengths


def as_packet(body: bytes) -> bytearray:
    """Return the link message that carries ``body`` as a packet of small frames."""
    return bytearray(PREAMBLE.pack(0, len(body), 0, PACKET) + body)


def forged_batches() -> dict[str, bytes]:
    """Link messages that claim to hold envelopes of large frames, but do not."""
    def batch(*entries: bytes) -> bytes:
        body = b"".join(entries)
        return PREAMBLE.pack(0, len(body), 0, BATCH) + body

    head, _ = wire.encode(Kind.DATA, 940, 0, torch.zeros(1 << 20, dtype=torch.uint8))
    junk = b"JUNK" + bytes(60)
    return {
        "inline": batch(PREAMBLE.pack(len(head), 5, 1, 0) + head),
        "no data": batch(PREAMBLE.pack(len(head), 0, 0, 0) + head),
        "cut short": batch(PREAMBLE.pack(len(head) + 10, 0, 1, 0) + head),
        "junk head": batch(PREAMBLE.pack(len(junk), 0, 1, 0) + junk),
        "wrong count": batch(PREAMBLE.pack(len(head), 0, 2, 0) + head),
        "stray bytes": batch(b"\x01\x02"),
    }


async def check_forged_batches(comm: Comm) -> dict[str, str]:
    # A forged batch is refused before anything is allocated for it, and ends the stream
    # from its source (the data messages it announces cannot be skipped); others go on.
    refusals: dict[str, str] = {}
    for what, message in forged_batches().items():
        async with fresh(comm) as sub:
            ch = sub.channel(940)
            if sub.rank == 0:
                await ch.send("before", 1)
                link = sub._router.link
                link.flush()
                handle = link._post(bytearray(message), 1, tags.LINK_MESSAGE)
                if handle is not None:
                    await handle
            elif sub.rank == 1:
                assert (await ch.recv(src=0)).data == "before"
                with pytest.raises(asyncomm.ProtocolError, match="stream from rank 0 broken"
                                   ) as refused:
                    await ch.recv(src=0, timeout=10.0)
                refusals[what] = str(refused.value)
                assert (await ch.recv(src=2, timeout=10.0)).data == "from 2"
                assert sub._router.link._buffers._kept == 0  # nothing was allocated
                if sub.backend == "gloo":  # nor is any data expected (asked of the lane)
                    assert 0 not in sub._router.link._lane._readers  # type: ignore[attr-defined]
            else:
                await ch.send("from 2", 1)
            await sub.barrier()
    return refusals


def test_forged_batches_end_their_source_stream(world: World) -> None:
    refusals = world.run(check_forged_batches)[1]
    for what, fragment in [("inline", "inline 5"), ("no data", "inline 0"),
                           ("cut short", "declares a head"), ("junk head", "magic"),
                           ("wrong count", "count does not match"),
                           ("stray bytes", "cut short")]:
        assert fragment in refusals[what], (what, refusals[what])


async def check_corrupt_small_frames(comm: Comm) -> None:
    # Forged small frames: a malformed body fails its own channel (the next message goes on),
    # a frame of an unknown kind too, and a packet cut short ends its source's stream.
    async with fresh(comm) as sub:
        ch, other = sub.channel(910), sub.channel(911)
        link = sub._router.link
        if sub.rank == 0:
            await ch.send("v0", 1)
            link.send_small(1, Kind.DATA, 910, 1, bytes([0xc7, 1, 3, 99]))  # truncated tensor
            link.send_small(1, Kind.REPLY, 910, 2, b"\xc0")  # not a kind a small frame has
            sub._router._windows[(1, 910)].seq = 2
            await ch.send("v1", 1)
            await other.send("o0", 1)
            await asyncio.sleep(0)
            await sub.barrier()
            await sub.barrier()
        elif sub.rank == 1:
            assert (await ch.recv(0)).data == "v0"
            with pytest.raises(asyncomm.ProtocolError, match="channel 910: frame from rank 0"):
                await ch.recv(0)
            with pytest.raises(asyncomm.ProtocolError, match="small frame of kind 5"):
                await ch.recv(0)
            assert (await ch.recv(0)).data == "v1"
            assert (await other.recv(0)).data == "o0"
            await sub.barrier()
            head = small.HEAD.pack(small.FRAME_BYTE, 1, small.U64_BYTE, 911, small.U64_BYTE, 1)
            cut = small.PACKET_HEAD.pack(small.ARRAY_BYTE, 1) + head[:-3]  # a frame's head, cut
            link._arrive(0, as_packet(cut))  # as if sent
            with pytest.raises(asyncomm.ProtocolError, match="stream from rank 0 broken"):
                await other.recv(0, timeout=10.0)
            await sub.barrier()
        else:
            await sub.barrier()
            await sub.barrier()


def test_corrupt_small_frames_fail_their_channel_only(world: World) -> None:
    world.run(check_corrupt_small_frames)


async def check_forged_packet_items(comm: Comm) -> None:
    # A packet that decodes but whose items are not frames (a tag that is not an int, an
    # item that is not a list of four) ends its source's stream, after the good frames
    # before it; in a packet of its own, a malformed message fails its channel only.
    async with fresh(comm) as sub:
        ch = sub.channel(912)
        link = sub._router.link
        if sub.rank == 1:
            for forged, channel_only in ((msgpack.packb([[1, 912, 0, "ok"],
                                                         [1, 912, 1, msgpack.ExtType(3, b"")]]),
                                          True),
                                         (msgpack.packb([[1, 912, 2, "ok"], [1, "912", 3, 0]]),
                                          False)):
                link._arrive(0, as_packet(forged))
                assert (await ch.recv(0, timeout=10.0)).data == "ok"
                error = "frame from rank 0 refused" if channel_only else "stream from rank 0"
                with pytest.raises(asyncomm.ProtocolError, match=error):
                    await ch.recv(0, timeout=10.0)
        await sub.barrier()


def test_forged_packet_items_end_their_source_stream(world: World) -> None:
    world.run(check_forged_packet_items)


async def check_forged_runs(comm: Comm) -> None:
    # A run out of sequence is refused on its channel (its first message; the stream goes
    # on from there, as after a lone frame out of sequence); one whose messages are not an
    # array ends its source's stream.
    async with fresh(comm) as sub:
        ch = sub.channel(913)
        link = sub._router.link
        if sub.rank == 1:
            for forged in (msgpack.packb([[small.RUN, 913, 0, ["a", "b"]],
                                          [small.RUN, 913, 5, ["c", "d"]]]),
                           msgpack.packb([[small.RUN, 913, 7, "e"]])):
                link._arrive(0, as_packet(forged))
            assert [(await ch.recv(0, timeout=10.0)).data for _ in range(2)] == ["a", "b"]
            with pytest.raises(asyncomm.ProtocolError, match="frame 5 from rank 0 where 2 "
                               "was due"):
                await ch.recv(0, timeout=10.0)
            assert (await ch.recv(0, timeout=10.0)).data == "d"
            with pytest.raises(asyncomm.ProtocolError, match="stream from rank 0 broken"):
                await ch.recv(0, timeout=10.0)
        await sub.barrier()


def test_forged_runs_are_refused(world: World) -> None:
    world.run(check_forged_runs)


async def check_bursts_travel_as_runs(comm: Comm) -> None:
    # Messages issued in one iteration to one rank travel in one packet, those of a channel
    # one after the other as one run; receivers waiting before they come get them in order.
    async with fresh(comm) as sub:
        ch, other = sub.channel(914), sub.channel(915)
        if sub.rank == 0:
            for c in (ch, other):  # each channel's first message checks its rank
                await c.send("first", 1)
            packets = sub._router.link._outbox._packets

            def counts(dst: int) -> tuple[int, int]:  # (items, frames) of a packet waiting
                return packets[dst].items, packets[dst].frames

            await sub.barrier()  # the receivers wait
            for i in range(5):  # (the first leaves at once, the rest wait)
                await ch.send({"i": i}, 1)
            assert counts(1) == (1, 4)  # one run
            await other.send(torch.arange(3), 1)  # another channel: a run of its own
            await ch.send({"i": 5}, 1)  # and the first again: a third
            assert counts(1) == (3, 6)
        elif sub.rank == 1:
            assert (await ch.recv(0)).data == (await other.recv(0)).data == "first"
            waiting = asyncio.gather(*(ch.recv(0, timeout=10.0) for _ in range(6)),
                                     other.recv(0, timeout=10.0))
            await asyncio.sleep(0.01)
            await sub.barrier()
            *got, tensor = await waiting
            assert [m.data for m in got] == [{"i": i} for i in range(6)]
            assert tensor.data.tolist() == [0, 1, 2]
        else:
            await sub.barrier()
        await sub.barrier()


def test_bursts_travel_as_runs(world: World) -> None:
    world.run(check_bursts_travel_as_runs)


async def check_large_messages_keep_their_memory(comm: Comm) -> None:
    # The buffers of large messages are lent again once nothing refers to them: the
    # messages a receiver keeps (whole, or a view) stay intact while later ones arrive
    # into recycled memory, and the dropped ones' memory is used again.
    # Each message waits for the one before to be taken (acknowledged): the receiving
    # link never runs ahead of the receiver (gloo's listener allocates as frames come),
    # so a dropped message's buffer is free before a later one needs one.
    async with fresh(comm) as sub:
        ch, ack, n, count = sub.channel(930), sub.channel(931), 1 << 18, 24  # 1 MiB each
        if sub.rank == 0:
            for i in range(count):
                await ch.send(torch.full((n,), float(i)), 1)
                await ack.recv(1)
        elif sub.rank == 1:
            kept: dict[int, torch.Tensor] = {}
            for i in range(count):
                t = (await ch.recv(0)).data
                assert bool(torch.all(t == i)), i
                if i % 3 == 0:
                    kept[i] = t
                elif i % 3 == 1:
                    kept[i] = t[100:200]
                await ack.send(i, 0)
            for i, t in kept.items():
                assert bool(torch.all(t == i)), i
            assert 0 < sub._router.link._buffers._kept < count * n * 4
        await sub.barrier()


def test_large_messages_kept_are_intact_and_the_dropped_ones_memory_is_reused(
        world: World) -> None:
    world.run(check_large_messages_keep_their_memory)
