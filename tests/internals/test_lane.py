"""gloo's data lane on its own: two lanes in one process, real sockets and shared memory.
(Internals on purpose: ``_backends/gloo_lane.py``'s ``Lane``, its handshake and its ways
out, driven directly.)

Every byte arrives in order into the buffers asked for, through a ring of shared
memory (peers on one host) or the socket alone; a peer that goes mid-buffer fails
that buffer and those behind it with a ``PeerFailedError``; a stranger's connection
is turned away without harm; no shared-memory file outlives its handshake.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import asyncomm
from asyncomm._backends import gloo_lane
from asyncomm._backends.gloo_lane import Lane

Outcome = queue.SimpleQueue[BaseException | None]


@pytest.fixture(params=[(True, True), (True, False), (False, False)],
                ids=["direct", "ring", "socket"])
def lanes(request: pytest.FixtureRequest) -> Iterator[tuple[Lane, Lane]]:
    store = dist.HashStore()  # type: ignore[attr-defined]
    made = (Lane(0, store, "lane/t", "127.0.0.1", *request.param),
            Lane(1, store, "lane/t", "127.0.0.1", *request.param))
    yield made
    for lane in made:
        lane.close()
    for lane in made:
        lane.join(60.0)


def _rings() -> set[str]:
    """The ring files of this process's lanes (named for the writer's process: those of
    other processes, other tests' or other jobs', come and go as they please)."""
    mine = f"asyncomm-lane-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(mine)}


def _send(lane: Lane, dst: int, tensor: torch.Tensor) -> Outcome:
    outcome: Outcome = queue.SimpleQueue()
    lane.send(dst, tensor, outcome.put)
    return outcome


def _recv(lane: Lane, src: int, buffers: list[torch.Tensor]) -> Outcome:
    outcome: Outcome = queue.SimpleQueue()
    lane.recv(src, lambda: buffers, outcome.put)
    return outcome


def _across(a: Lane, b: Lane, sent: torch.Tensor, got: torch.Tensor) -> None:
    """``sent`` from ``a`` (rank 0) into ``got`` on ``b`` (rank 1); both done well."""
    outcomes = _send(a, 1, sent), _recv(b, 0, [got])
    for outcome in outcomes:
        assert outcome.get(timeout=30) is None


def test_every_byte_arrives_in_order(lanes: tuple[Lane, Lane]) -> None:
    a, b = lanes
    before = _rings()
    gen = torch.Generator().manual_seed(0)
    # sizes around and beyond the ring (and its chunk), several dtypes, an empty buffer
    ring = gloo_lane.RING_BYTES
    sent = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
            for n in (1, 0, 4099, ring // 2 + 3, ring, 2 * ring + 5, 1 << 20)]
    sent += [torch.randn(1000, 33, generator=gen), torch.randn(7, dtype=torch.float64)
             .to(torch.bfloat16), torch.arange(10, dtype=torch.int64)]
    outs = [_send(a, 1, t) for t in sent]
    # asked for in two frames, the first before anything was written
    got = [torch.empty_like(t) for t in sent]
    first, second = _recv(b, 0, got[:3]), _recv(b, 0, got[3:])
    back = torch.arange(5, dtype=torch.int32)  # and the other way at once
    answer = torch.zeros(5, dtype=torch.int32)
    back_out, back_in = _send(b, 0, back), _recv(a, 1, [answer])
    for outcome in (*outs, first, second, back_out, back_in):
        assert outcome.get(timeout=30) is None
    for mine, theirs in zip(sent, got, strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(back, answer)
    assert _rings() == before  # every ring's file went with its handshake


def test_a_peer_that_goes_mid_buffer_fails_it_and_those_behind(
        lanes: tuple[Lane, Lane]) -> None:
    a, b = lanes
    _across(a, b, torch.ones(10), torch.empty(10))  # connected
    half = _recv(b, 0, [torch.empty(1 << 20)])
    behind = _recv(b, 0, [torch.empty(10)])
    a.send(1, torch.ones(100), lambda _: None)  # a part of what b waits for
    a.close()  # the writer ends after what it was given: the connection closes
    a.join(60.0)  # (a direct writer's answers end too: b's reader closed as it failed)
    assert not [t.name for t in a._threads if t.is_alive()]
    for outcome in (half, behind):
        error = outcome.get(timeout=30)
        assert isinstance(error, asyncomm.PeerFailedError), error
        assert "rank 1: data from rank 0 lost" in str(error)


def test_a_stranger_is_turned_away(lanes: tuple[Lane, Lane]) -> None:
    a, b = lanes
    host, port = b._server.getsockname()[:2]
    for hello in (b"", b"\x00\x00", gloo_lane._HELLO.pack(0, 9) + b"../passwd"):
        with socket.create_connection((host, port)) as stranger:
            stranger.sendall(hello)
    got = torch.empty(3000)
    _across(a, b, torch.full((3000,), 2.0), got)
    assert bool(torch.all(got == 2.0))


def test_threads_end_when_closed() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    a, b = Lane(0, store, "lane/c", "127.0.0.1"), Lane(1, store, "lane/c", "127.0.0.1")
    _across(a, b, torch.ones(5), torch.empty(5))
    for lane in (a, b):
        lane.close()
    for lane in (a, b):
        lane.join(60.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncomm-lane")]


def _stream_across(a: Lane, b: Lane) -> None:
    data = torch.arange(300_000, dtype=torch.float32)
    got = torch.empty_like(data)
    _across(a, b, data, got)
    assert torch.equal(data, got)


@pytest.mark.parametrize(("refused", "carrier"), [
    (("direct-reader",), "_RingOut"),  # a reader that may not read the writer's process
    (("direct-reader", "ring-writer"), "_TcpOut"),  # ... and no /dev/shm (or a full one)
    (("direct-reader", "ring-reader"), "_TcpOut"),  # ... and another container's /dev/shm
    (("no-readv",), "_RingOut"),  # no process_vm_readv at all (not Linux)
])
def test_each_way_falls_back_to_the_next(monkeypatch: pytest.MonkeyPatch,
                                         refused: tuple[str, ...], carrier: str) -> None:
    def unavailable(*_: object) -> None:
        raise OSError("not here")

    for what in refused:
        target, name = {"direct-reader": (gloo_lane._DirectIn, "accept"),
                        "ring-writer": (gloo_lane.shm, "reserved_file"),
                        "ring-reader": (gloo_lane._RingIn, "accept"),
                        "no-readv": (gloo_lane, "_READV")}[what]
        monkeypatch.setattr(target, name, None if what == "no-readv" else unavailable)
    through: list[str] = []
    for stream in (gloo_lane._TcpOut, gloo_lane._RingOut, gloo_lane._DirectOut):
        def write(self: Any, tensor: torch.Tensor, done: Any, _write: Any = stream.write,
                  _name: str = stream.__name__) -> None:
            through.append(_name)
            _write(self, tensor, done)

        monkeypatch.setattr(stream, "write", write)
    store = dist.HashStore()  # type: ignore[attr-defined]
    before = _rings()
    a, b = Lane(0, store, "lane/f", "127.0.0.1"), Lane(1, store, "lane/f", "127.0.0.1")
    try:
        _stream_across(a, b)
        _stream_across(a, b)
        assert through == [carrier] * 2
        assert _rings() == before
    finally:
        for lane in (a, b):
            lane.close()
            lane.join(60.0)


def test_a_direct_buffer_is_done_once_its_reader_took_it() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    a, b = Lane(0, store, "lane/d", "127.0.0.1"), Lane(1, store, "lane/d", "127.0.0.1")
    try:
        _across(a, b, torch.ones(5), torch.empty(5))  # connected
        assert isinstance(a._writers[1], gloo_lane._Queue)
        data = torch.arange(1 << 18, dtype=torch.float32)
        sent = _send(a, 1, data)
        with pytest.raises(queue.Empty):  # its bytes are still only in the writer's buffer
            sent.get(timeout=0.3)
        got = torch.empty_like(data)
        assert _recv(b, 0, [got]).get(timeout=30) is None
        assert sent.get(timeout=30) is None
        assert torch.equal(got, data)
        # a reader that goes fails what it did not take, and what is written after
        waiting = _send(a, 1, data)
        b.close()
        b.join(60.0)
        for outcome in (waiting, _send(a, 1, data)):
            error = outcome.get(timeout=30)
            assert isinstance(error, asyncomm.PeerFailedError), error
            assert "rank 0: data to rank 1 lost" in str(error)
    finally:
        for lane in (a, b):
            lane.close()
            lane.join(60.0)


def test_a_direct_offer_of_another_process_is_declined(lanes: tuple[Lane, Lane]) -> None:
    _, b = lanes
    host, port = b._server.getsockname()[:2]
    kept = bytes(16)  # the token is not where the offer says (another process's pid)
    for pid in (os.getpid(), 1 << 22):
        with socket.create_connection((host, port)) as stranger:
            name = f"direct {pid} {id(kept)} {'ab' * 16}".encode()
            stranger.sendall(gloo_lane._HELLO.pack(7, len(name)) + name)
            assert stranger.recv(1) == gloo_lane._DECLINED


def test_a_ring_of_another_size_is_declined(lanes: tuple[Lane, Lane]) -> None:
    _, b = lanes
    path = "/dev/shm/asyncomm-lane-test-small"
    with open(path, "wb") as small:
        small.write(b"\0" * 4096)  # mapped as a ring, a copy past it would be a SIGBUS
    try:
        host, port = b._server.getsockname()[:2]
        with socket.create_connection((host, port)) as stranger:
            name = os.path.basename(path).encode()
            stranger.sendall(gloo_lane._HELLO.pack(7, len(name)) + name)
            assert stranger.recv(1) == gloo_lane._DECLINED
    finally:
        os.unlink(path)
