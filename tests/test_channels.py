"""Channels on real gloo and MPI worlds, through the public API: delivery, fairness,
cancellation, flow control, safety. (Checks that read or forge the messaging layer's
insides are in internals/test_channel_protocol.py.)

Every check runs on the ranks of a shared world, whose communicator lives
from test to test: each test uses channel tags of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncomm
from asyncomm import Channel, Comm
from asyncomm.testing import World, fresh

MiB = 1 << 20
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.uint16, torch.uint32, torch.uint64]
WINDOW = 64  # the router's default window, in messages per (sender, channel)


# -- helpers -----------------------------------------------------------------------


async def until(condition: Any, what: str, limit: float = 30.0) -> None:
    """Wait until ``condition()`` holds (each loop turn, then every ms): an event, not a nap."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {limit:g} s")
        await asyncio.sleep(0.001)


def digest(obj: object) -> str:
    """Return a checksum of ``obj`` that sees types (tuple/list, tensor/array, int/float/bool)."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: object) -> None:
    if isinstance(obj, torch.Tensor):
        flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        h.update(f"tensor {obj.dtype} {tuple(obj.shape)};".encode())
        h.update(flat.numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("="))
        h.update(f"ndarray {a.dtype.str} {a.shape};".encode())
        h.update(a.tobytes())
    elif isinstance(obj, bytes):
        h.update(f"bytes {len(obj)};".encode())
        h.update(obj)
    elif isinstance(obj, str):
        h.update(f"str {len(obj)};".encode())
        h.update(obj.encode())
    elif obj is None or isinstance(obj, (bool, int, float)):
        h.update(f"{type(obj).__name__} {obj!r};".encode())
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__} {len(obj)};".encode())
        for item in obj:
            _feed(h, item)
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)};".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    else:
        raise TypeError(f"no digest for {type(obj).__name__}")


def rand(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Return random bits of ``dtype`` (bools 0/1), reproducible from ``g``."""
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().reshape(shape)
    bits = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return bits.view(dtype).reshape(shape)


def rand_bytes(n: int, g: torch.Generator) -> bytes:
    return rand((n,), torch.uint8, g).numpy().tobytes()


def _kinds() -> list[Callable[[torch.Generator], object]]:
    """Every kind of message the default codec carries, each made from a generator."""
    kinds: list[Callable[[torch.Generator], object]] = [
        lambda g: torch.empty(0),
        lambda g: torch.empty(3, 0, 2, dtype=torch.int64),
        lambda g: rand((2, 3, 4), torch.float32, g),
        lambda g: rand((5, 6), torch.float64, g).t(),  # not contiguous
        lambda g: rand((10,), torch.int16, g)[::3],
        lambda g: rand((4,), torch.complex64, g).conj(),
        lambda g: rand((3, 4), torch.float64, g).numpy(),
        lambda g: rand((9,), torch.int32, g).numpy(),
        lambda g: rand((2, 2), torch.bool, g).numpy(),
        lambda g: rand((), torch.int64, g).numpy(),
        lambda g: rand((2, 3), torch.float64, g).numpy().astype(">f8"),  # big-endian
        lambda g: rand((4, 6), torch.uint16, g).numpy()[:, ::2],
        lambda g: np.zeros((0, 5), np.float32),
        lambda g: rand((3,), torch.complex128, g).numpy(),
        lambda g: b"",
        lambda g: rand_bytes(100, g),
        lambda g: rand_bytes(100 << 10, g),  # > 64 KiB: travels out of band
        lambda g: rand_bytes(MiB, g),
        lambda g: "",
        lambda g: "héllo ✓ 🚀",
        lambda g: "ñ✓x" * 3_000,  # a head larger than a gloo message
        lambda g: "x" * 65_530,  # a head larger than an MPI message: it follows as data
        lambda g: "ñ✓x" * 70_000,  # a structure travelling as a buffer
        lambda g: None,
        lambda g: 42,
        lambda g: -2.5,
        lambda g: True,
        lambda g: [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, True, False, None, 0.0, -0.0,
                   1e308, math.inf, -math.inf, math.nan, 1.5],
        lambda g: {"a": [1, (2, 3.0), None], 5: {"t": rand((3,), torch.int8, g), "b": b"x"},
                   b"k": ((), [], {}), None: (rand((2,), torch.float16, g),),
                   2.5: [rand((2, 2), torch.float32, g).numpy(), "s"]},
        lambda g: [rand((i % 5,), DTYPES[i % len(DTYPES)], g) for i in range(300)],
        lambda g: (rand((2,), torch.bfloat16, g), rand((2,), torch.int64, g).numpy(), b"z"),
        lambda g: _deep(40),
        lambda g: rand((1 << 10,), torch.uint8, g),
        lambda g: rand((60 << 10,), torch.uint8, g),  # the largest one-piece MPI message
        lambda g: rand((64 << 10,), torch.uint8, g),
        lambda g: rand((MiB // 4,), torch.float32, g),
        lambda g: rand((2 * MiB,), torch.uint8, g),
    ]
    kinds += [lambda g, d=d: rand((7,), d, g) for d in DTYPES]  # type: ignore[misc]
    kinds += [lambda g, d=d: rand((), d, g) for d in DTYPES]  # type: ignore[misc]
    return kinds


def _deep(n: int) -> object:
    obj: object = [n]
    for i in range(n):
        obj = [i, obj] if i % 2 else (obj,)
    return obj


KINDS = _kinds()
SOAK_TAGS = (100, 101, 102, 103)
SOAK_BIG = {(0, 1, 100, 3): (64 * MiB,), (2, 0, 101, 5): (2 * MiB,)}  # float32: 8 MiB


def soak_payload(src: int, dst: int, tag: int, seq: int) -> object:
    g = torch.Generator().manual_seed(((src * 31 + dst) * 1009 + tag) * 100_003 + seq)
    if (src, dst, tag, seq) in SOAK_BIG:
        shape = SOAK_BIG[src, dst, tag, seq]
        return rand(shape, torch.uint8 if shape[0] == 64 * MiB else torch.float32, g)
    return KINDS[(seq + src + tag) % len(KINDS)](g)


async def expect_nothing(ch: Channel, src: int | None = None) -> None:
    """Assert that nothing more arrives on ``ch`` (from ``src``) for a short while."""
    with pytest.raises(asyncomm.CommTimeoutError):
        msg = await ch.recv(src, timeout=0.1)
        raise AssertionError(f"unexpected {msg}")


# -- 1. soak -----------------------------------------------------------------------


async def check_soak(comm: Comm) -> dict[str, int]:
    me, n = comm.rank, len(KINDS)
    channels = [comm.channel(tag) for tag in SOAK_TAGS]

    async def send_stream(ch: Channel, dst: int) -> None:
        for seq in range(n):
            payload = soak_payload(me, dst, ch.tag, seq)
            await ch.send((me, seq, payload, digest(payload)), dst)

    async def send_all(ch: Channel) -> None:
        await asyncio.gather(*(send_stream(ch, dst) for dst in range(comm.size) if dst != me))
        await ch.close()

    async def receive_all(ch: Channel) -> dict[int, int]:
        due = {src: 0 for src in range(comm.size) if src != me}
        async for msg in ch:
            assert msg.tag == ch.tag and isinstance(msg.data, tuple) and len(msg.data) == 4
            sender, seq, payload, sent_digest = msg.data
            assert sender == msg.src != me
            assert seq == due[sender], (ch.tag, sender, seq, due[sender])
            due[sender] += 1
            assert digest(payload) == sent_digest, (ch.tag, sender, seq, type(payload))
        return due

    sending = asyncio.gather(*(send_all(ch) for ch in channels))
    counts = await asyncio.gather(*(receive_all(ch) for ch in channels))
    await sending
    assert all(due == {src: n for src in due} for due in counts), counts
    for ch in channels:  # the end of every stream was seen, and only after its messages
        with pytest.raises(asyncomm.CommClosedError):
            await ch.recv(timeout=1.0)
    return {"received": sum(sum(due.values()) for due in counts)}


def test_soak_many_channels_every_kind_exactly_once_in_order(world: World) -> None:
    results = world.run(check_soak)
    per_rank = len(SOAK_TAGS) * (world.size - 1) * len(KINDS)
    assert results == [{"received": per_rank}] * world.size


def test_soak_payload_digests_tell_kinds_apart() -> None:
    # The soak's checksum must see what the codec must keep: types, dtypes, shapes, bytes.
    g = torch.Generator().manual_seed(0)
    t = rand((3,), torch.float32, g)
    variants = [t, t.numpy(), t.view(torch.int32), t.reshape(3, 1), [t], (t,), 1, 1.0, True,
                b"1", "1", None, [1], (1,), {1: 1}]
    assert len({digest(v) for v in variants}) == len(variants)
    m = rand((2, 3), torch.float32, g)
    assert digest(m.t()) == digest(m.t().contiguous()) != digest(m)
    a = np.arange(6, dtype=">i4")
    assert digest(a) == digest(a.astype("<i4"))


# -- 2. cancellation and receive timeouts ------------------------------------------


async def check_cancel_as_it_arrives(comm: Comm) -> None:
    # A receive woken by a message but cancelled before it runs must leave the
    # message for the next receive: a send to self is delivered without yielding.
    ch = comm.channel(302)
    got, cancelled = [], 0
    for i in range(20):
        blocked = asyncio.ensure_future(ch.recv())
        for _ in range(3):
            await asyncio.sleep(0)
        await ch.send(i, comm.rank)
        blocked.cancel()
        try:
            got.append((await blocked).data)
        except asyncio.CancelledError:
            cancelled += 1
            got.append((await ch.recv(timeout=1.0)).data)
    assert got == list(range(20))
    assert cancelled > 0, "never cancelled after the message came: the race went untested"
    await expect_nothing(ch)


def test_recv_cancelled_as_its_message_arrives(world: World) -> None:
    world.run(check_cancel_as_it_arrives)


async def check_cancel_storm(comm: Comm, n: int) -> None:
    ch = comm.channel(303)
    if comm.rank == 0:
        rng = random.Random(1)
        for i in range(n):
            await ch.send(torch.full((rng.choice([1, 100, 5000]),), i), 1)
            if i % 7 == 0:
                await asyncio.sleep(rng.choice([0, 0.001, 0.003]))
    elif comm.rank == 1:
        rng = random.Random(2)
        got: list[int] = []
        timeouts = 0
        while len(got) < n:
            limit = rng.choice([0.0, 0.0005, 0.002, 0.01])
            try:
                if rng.random() < 0.5:
                    msg = await asyncio.wait_for(ch.recv(), limit)  # cancelled on timeout
                else:
                    msg = await ch.recv(src=0, timeout=limit)
            except (TimeoutError, asyncomm.CommTimeoutError):
                timeouts += 1
                continue
            t = msg.data
            assert bool((t == t[0]).all())
            got.append(int(t[0]))
        assert got == list(range(n))
        assert timeouts > 0
        await expect_nothing(ch)


def test_receives_cancelled_at_random_lose_nothing(world: World) -> None:
    world.run(check_cancel_storm, 200)


# -- 3. flow control ---------------------------------------------------------------


async def check_credit_owed_on_two_channels(comm: Comm) -> list[str]:
    """Rank 1 takes a batch of credit's worth on each of two channels at once, and returns
    both: nothing fails on its loop, and rank 0's second round, which needs that credit on
    both channels, goes through."""
    loop, said = asyncio.get_running_loop(), []
    before = loop.get_exception_handler()  # (asyncomm's own: the world's loop outlives this)
    loop.set_exception_handler(lambda _, context: said.append(str(context.get("exception"))))
    try:
        a, b, c = (comm.channel(tag) for tag in (1510, 1511, 1512))
        batch = WINDOW // 2  # the messages that make a batch of credit
        if comm.rank == 0:
            for _ in range(2):  # the second round needs the first's credit on both channels
                for ch in (a, b):
                    for i in range(batch):
                        await ch.send(i, 1)
                await c.send("sent", 1)
                await c.recv(1)
        elif comm.rank == 1:
            for _ in range(2):
                await c.recv(0)  # (a link keeps order: a's and b's messages are here)
                for ch in (a, b):
                    for _ in range(batch):
                        await ch.recv(0)  # taken at once: both batches returned in one turn
                await asyncio.sleep(0)  # (the loop turns)
                await c.send("took", 0)
        await comm.barrier()
    finally:
        loop.set_exception_handler(before)
    return said


def test_credit_owed_on_two_channels_to_one_rank_is_paid(world: World) -> None:
    assert world.run(check_credit_owed_on_two_channels) == [[]] * world.size


async def check_large_after_small(comm: Comm) -> None:
    ch = comm.channel(404)
    big = 64 * MiB + 1  # more than the whole byte window
    if comm.rank == 0:
        for i in range(3):
            await ch.send(i, 1)
        await ch.send(torch.arange(big, dtype=torch.uint8), 1, timeout=10.0)
    elif comm.rank == 1:
        assert [(await ch.recv(src=0)).data for _ in range(3)] == [0, 1, 2]
        t = (await ch.recv(src=0, timeout=10.0)).data
        assert t.shape == (big,) and int(t[-1]) == (big - 1) % 256
        assert torch.equal(t[:1024], torch.arange(1024, dtype=torch.uint8))


def test_large_message_after_small_ones(world: World) -> None:
    # The receiver returns credit in batches, so the three small messages stay
    # charged to the sender; the large one used to wait for that credit forever.
    world.run(check_large_after_small)


async def check_window_holds_its_bytes(comm: Comm) -> None:
    # 32 messages of 2 MiB fill the 64 MiB window exactly (their heads are not charged:
    # each message's first 8 KiB are free), so all go while the receiver sleeps; a 33rd
    # waits for credit.
    ch = comm.channel(403)
    if comm.rank == 0:
        await asyncio.gather(*(ch.send(torch.full((MiB // 2,), i, dtype=torch.int32), 1,
                                       timeout=20.0) for i in range(32)))
        with pytest.raises(asyncomm.CommTimeoutError, match="channel 403 send to peer 1"):
            await ch.send(torch.zeros(MiB // 2, dtype=torch.int32), 1, timeout=0.3)
        await comm.channel(405).send("sent", 1)
    elif comm.rank == 1:
        assert (await comm.channel(405).recv(src=0, timeout=30.0)).data == "sent"
        for i in range(32):
            assert bool(((await ch.recv(src=0)).data == i).all()), i
        await expect_nothing(ch)


def test_a_window_holds_its_bytes_of_tensors(world: World) -> None:
    world.run(check_window_holds_its_bytes)


# -- 4. size limit -----------------------------------------------------------------


async def check_size_limit(comm: Comm) -> None:
    # ASYNCOMM_MAX_MESSAGE_BYTES, read when a communicator is made: a sender refuses what
    # its receivers would, before anything is sent; smaller messages go on.
    async with fresh(comm, {"ASYNCOMM_MAX_MESSAGE_BYTES": "4096"}) as sub:
        ch = sub.channel(620)
        if sub.rank == 0:
            with pytest.raises(ValueError, match="too large"):
                await ch.send(torch.zeros(4097, dtype=torch.uint8), 1)
            await ch.send(torch.ones(4000, dtype=torch.uint8), 1)
        elif sub.rank == 1:
            msg = await ch.recv(src=0, timeout=10.0)
            assert msg.data.sum().item() == 4000
            await expect_nothing(ch)
        await sub.barrier()


def test_message_size_limit_from_the_environment(world: World) -> None:
    world.run(check_size_limit)


# -- 5. pickle safety --------------------------------------------------------------


class Marker:
    """Unpickling this creates the directory ``path``: an observable side effect."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


async def check_pickle_safety(comm: Comm, marker: str) -> None:
    if comm.rank == 0:
        await comm.channel(700, codec="pickle").send(Marker(marker), 1)
        await comm.channel(701, codec="pickle").send(Marker(marker), 1)
        ch = comm.channel(702)
        with pytest.raises(TypeError, match="pickle"):
            await ch.send(object(), 1)
        with pytest.raises(TypeError, match=r"data\['a'\]\[1\]"):
            await ch.send({"a": [torch.zeros(1), {2}]}, 1)
        with pytest.raises(TypeError):
            await ch.send(Marker(marker), 1)
        await ch.send("after", 1)
    elif comm.rank == 1:
        ch = comm.channel(700)  # default codec here
        with pytest.raises(asyncomm.ProtocolError, match="channel 700"):
            await ch.recv(src=0)
        assert not os.path.exists(marker), "a pickle frame was unpickled on a default channel"
        assert (await ch.recv(src=2)).data == "still works"
        msg = await comm.channel(701, codec="pickle").recv(src=0)
        assert msg.data is None and os.path.isdir(marker)  # os.mkdir ran, on the pickle channel
        ch = comm.channel(702)
        assert (await ch.recv(src=0)).data == "after"  # the refused sends sent nothing
        await expect_nothing(ch)
    else:
        await comm.channel(700).send("still works", 1)


def test_pickle_frames_refused_on_default_channels(world: World, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    world.run(check_pickle_safety, str(marker))
    assert marker.is_dir()


# -- 6. end of stream --------------------------------------------------------------


async def check_end_of_stream(comm: Comm, n: int) -> None:
    ch = comm.channel(800)
    if comm.rank == 0:
        got: dict[int, list[Any]] = {1: [], 2: []}

        async def tell_rank_2() -> None:  # rank 1's end of stream is in
            await until(lambda: ch.over(1), "ended")
            await comm.channel(801).send("rank 1 closed", 2)

        telling = asyncio.ensure_future(tell_rank_2())
        async for msg in ch:
            got[msg.src].append(msg.data)
        await telling
        for src in (1, 2):
            assert [d if isinstance(d, int) else int(d[-1]) for d in got[src]] == list(range(n))
        for peer in (None, 1, 2):
            assert ch.over(peer)  # every receive fails at once now
            with pytest.raises(asyncomm.CommClosedError, match="channel 800"):
                await ch.recv(peer)
        async for _ in ch:
            raise AssertionError("an ended channel iterated again")
        await ch.close()
    else:
        for i in range(n - 1):
            await ch.send(i, 0)
            if comm.rank == 2 and i == n // 2:  # iteration goes on once rank 1 has closed
                await comm.channel(801).recv(src=0)
        await ch.send(torch.full((MiB,), float(n - 1)), 0)  # data messages, then the end
        await ch.close()
        with pytest.raises(asyncomm.CommClosedError):
            await ch.send(0, 0)
        await ch.close()  # idempotent


def test_iteration_ends_after_every_rank_closed(world: World) -> None:
    world.run(check_end_of_stream, 30)


async def check_known_senders(comm: Comm) -> list[Any]:
    # Producer and consumer: rank 1 sends, rank 0 iterates; rank 2 has nothing to do with
    # the channel and never closes it. Named as the only sender, rank 1's close ends the
    # iteration; close() returns at once and still lets its rank receive.
    async with fresh(comm) as sub:
        ch = sub.channel(917, senders=[1])
        got: list[Any] = []
        if sub.rank == 0:
            got = [msg.data async for msg in ch]
            with pytest.raises(asyncomm.CommClosedError):
                await ch.recv(timeout=5.0)
            await ch.send("thanks", 1)
        elif sub.rank == 1:
            for i in range(3):
                await ch.send(i, 0)
            await ch.close()  # (a half-close: what comes back is still received)
            got = [(await ch.recv(0, timeout=30.0)).data]
        with pytest.raises(ValueError, match="senders"):
            sub.channel(917, senders=[2])
        await sub.barrier()
        return got


def test_a_channel_that_knows_its_senders_ends_with_them(world: World) -> None:
    got = world.run(check_known_senders)
    assert got[:2] == [[0, 1, 2], ["thanks"]], got


# -- 7. many channels --------------------------------------------------------------


async def check_many_channels(comm: Comm, n: int) -> int:
    # Channel i carries one message, from rank i % size to the next rank.
    channels = [comm.channel(10_000 + i) for i in range(n)]
    me, size = comm.rank, comm.size
    mine = [ch for i, ch in enumerate(channels) if i % size == me]
    theirs = [ch for i, ch in enumerate(channels) if (i + 1) % size == me]
    sends = asyncio.gather(*(ch.send((ch.tag, me), (me + 1) % size) for ch in mine))
    received = await asyncio.gather(*(ch.recv() for ch in theirs))
    await sends
    left = (me - 1) % size
    for ch, msg in zip(theirs, received, strict=True):
        assert (msg.src, msg.tag, msg.data) == (left, ch.tag, (ch.tag, left))
    waits = [asyncio.ensure_future(ch.recv()) for ch in channels]  # nothing more: each came once
    await asyncio.wait(waits, timeout=0.1)
    for wait in waits:
        wait.cancel()  # (a cancelled receive takes nothing)
    more = await asyncio.gather(*waits, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in more), more
    return len(received)


def test_a_thousand_channels(world: World) -> None:
    assert sum(world.run(check_many_channels, 1000)) == 1000


# -- 8. bad arguments --------------------------------------------------------------


async def check_bad_arguments(comm: Comm) -> None:
    for tag, error in [(-1, ValueError), (1 << 62, ValueError),
                       ("7", TypeError), (1.0, TypeError), (True, TypeError), (None, TypeError)]:
        with pytest.raises(error):
            comm.channel(tag)  # type: ignore[arg-type]
    assert comm.channel((1 << 62) - 1).tag == (1 << 62) - 1  # the largest
    with pytest.raises(ValueError, match="codec"):
        comm.channel(900, codec="json")
    ch = comm.channel(np.int64(900))  # type: ignore[arg-type]
    assert comm.channel(900) is ch
    with pytest.raises(ValueError, match="codec"):
        comm.channel(900, codec="pickle")
    for dst in (-1, comm.size, True, "1", None, 1.0):
        with pytest.raises((ValueError, TypeError)):
            await ch.send("x", dst)  # type: ignore[arg-type]
    for src in (-1, comm.size, True, "1", 1.0):
        with pytest.raises((ValueError, TypeError)):
            await ch.recv(src)  # type: ignore[arg-type]
    right = (comm.rank + 1) % comm.size
    for refused in (object(), {"a": [1, object()]}):  # before anything is sent, named
        with pytest.raises(TypeError, match=f"^rank {comm.rank}: channel 900 send to "
                                            f"{right}: the default codec cannot carry"):
            await ch.send(refused, right)
    # The communicator and the channel still work.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    await ch.send(comm.rank, right)
    msg = await ch.recv(timeout=5.0)
    assert (msg.src, msg.data) == (left, left)
    await expect_nothing(ch)
    t = torch.ones(1)
    await comm.all_reduce(t)
    assert t.item() == comm.size


def test_bad_arguments_raise_and_change_nothing(world: World) -> None:
    world.run(check_bad_arguments)


# -- 9. send to self ---------------------------------------------------------------


async def check_send_to_self(comm: Comm, n: int) -> None:
    me, right = comm.rank, (comm.rank + 1) % comm.size
    left = (comm.rank - 1) % comm.size
    ch = comm.channel(1000)

    async def produce() -> None:
        for i in range(n):  # beyond one window: the consumer's credit lets it go on
            t = torch.full((3,), i)
            await ch.send({"i": i, "t": t}, me)
            t.fill_(-1)  # the message is a private copy
            if i % 4 == 0:
                await ch.send(i, right)

    async def consume() -> None:
        for i in range(n):
            msg = await ch.recv(src=me)
            assert msg.src == me and msg.data["i"] == i
            assert torch.equal(msg.data["t"], torch.full((3,), i))
        assert [(await ch.recv(src=left)).data for _ in range(0, n, 4)] == list(range(0, n, 4))

    await asyncio.gather(produce(), consume())
    await expect_nothing(ch)


def test_send_to_self_keeps_order(world: World) -> None:
    world.run(check_send_to_self, 200)


# -- 10. small messages travel together --------------------------------------------


def _raw_exchange(comm: Comm, t: torch.Tensor, peer: int) -> None:
    """A blocking exchange on ``comm.raw``: the loop stands still meanwhile."""
    if comm.backend == "mpi":
        def send() -> None:
            comm.raw.Send(t.numpy(), peer, 5)

        def recv() -> None:
            comm.raw.Recv(t.numpy(), peer, 5)
    else:
        def send() -> None:
            comm.raw.send([t], peer, 5).wait()

        def recv() -> None:
            comm.raw.recv([t], peer, 5).wait()
    for step in (send, recv) if comm.rank == 0 else (recv, send):
        step()


async def check_sent_before_the_loop_blocks(comm: Comm, rounds: int) -> list[int]:
    # A message whose send returned has left, though the sender then blocks the loop in a
    # raw call its peer answers only once it has the message: a channel ping-pong and a
    # raw one taking turns, as a benchmark beside the raw backend does. A burst's later
    # messages need ``comm.flush()`` first.
    async with fresh(comm) as sub:
        ch, t, got = sub.channel(902), torch.zeros(2), []
        peer = 1 - sub.rank
        if sub.rank > 1:
            return got
        for i in range(rounds):
            if sub.rank == 0:
                await ch.send(i, peer)
                got.append((await ch.recv(peer)).data)
            else:
                got.append((await ch.recv(peer)).data)
                await ch.send(i, peer)
            if i % 2:  # a burst, flushed
                for j in range(3):
                    await ch.send(j, peer)
                sub.flush()
                got.extend([(await ch.recv(peer)).data for _ in range(3)])
            _raw_exchange(sub, t, peer)
        return got


def test_a_sent_message_has_left_when_the_loop_blocks(world: World) -> None:
    rounds = 40
    burst = [0, 1, 2]
    want = [x for i in range(rounds) for x in ([i, *burst] if i % 2 else [i])]
    assert world.run(check_sent_before_the_loop_blocks, rounds, timeout=120)[:2] == [want, want]


async def check_a_bursts_credit_is_back_with_its_acknowledgement(comm: Comm) -> None:
    # A receiver returns each batch of credit as it takes it, as the next small frame to the
    # sender: on the link before the acknowledgement it sends after taking a window's worth.
    # So the sender can send a whole window again at once, never waiting for credit (a send
    # with timeout=0 that had to wait would raise CommTimeoutError).
    async with fresh(comm) as sub:
        ch, ack = sub.channel(916), sub.channel(917)
        for _ in range(3):
            if sub.rank == 0:
                for i in range(WINDOW):
                    await ch.send(i, 1, timeout=0)
                assert (await ack.recv(1, timeout=10.0)).data == "took"
            elif sub.rank == 1:
                assert [(await ch.recv(0)).data for _ in range(WINDOW)] == list(range(WINDOW))
                await ack.send("took", 0)
        await sub.barrier()


def test_a_bursts_credit_is_back_with_its_acknowledgement(world: World) -> None:
    world.run(check_a_bursts_credit_is_back_with_its_acknowledgement)


async def check_flush_before_blocking(comm: Comm) -> None:
    # A small message waits for the loop iteration's end; comm.flush() sends it now, so a
    # rank may then block its loop in a raw call that its peer joins only once it has it.
    async with fresh(comm) as sub:
        ch = sub.channel(920)
        if sub.rank == 0:
            await ch.send("before the barrier", 1)
            sub.flush()
        elif sub.rank == 1:
            assert (await ch.recv(0, timeout=10.0)).data == "before the barrier"
        if sub.backend == "mpi":
            sub.raw.Barrier()  # blocks the loop: without the flush, rank 1 never gets here
        else:
            sub.raw.barrier().wait()
        await sub.barrier()


def test_flush_sends_small_messages_before_the_loop_blocks(world: World) -> None:
    world.run(check_flush_before_blocking)
