"""Channels: messages multiplexed by tag between ranks, over the router.

``ch = comm.channel(tag)``; ``await ch.send(obj, dst)``; ``msg = await
ch.recv(src=None)``; ``async for msg in ch``. Per (sender, channel) messages
arrive exactly once and in order; flow control, dead peers and the end of a
stream are the router's (see ``router``).
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from asyncomm._core import wire
from asyncomm._core.errors import CommClosedError, CommTimeoutError, ProtocolError
from asyncomm._core.small import encode as small_encode
from asyncomm._core.wire import Codec, Kind
from asyncomm._messaging.mailbox import Encoded, Frame, size_of, wake
from asyncomm._messaging.router import Router

_CODECS = {"default": Codec.DEFAULT, "pickle": Codec.PICKLE}


class Message(NamedTuple):
    """A received message: who sent it, on which channel, and what."""

    src: int
    tag: int
    data: Any


class Channel:
    """Messages on one tag between the ranks of a communicator.

    ``await ch.send(obj, dst)`` and ``msg = await ch.recv(src=None)``;
    ``async for msg in ch`` until every other rank closed the channel.
    Per (sender, channel) messages arrive exactly once and in order.
    """

    def __init__(self, router: Router, tag: int, codec: Codec, timeout: float,
                 traced: bool = False, probe: bool = True) -> None:
        self._router = router
        self.tag = tag
        self.codec = codec
        self._timeout = timeout
        self._probe = probe  # whether a waiting recv checks its peers (see the note)
        self._box = router.mailbox(tag)
        self._closed = False
        self._traced = traced  # the user's channels are traced; the actors' own are not
        self._received = 0  # bytes of the last message opened, for the trace
        # small messages of the default codec: the most bytes of one (0: none are small)
        self._small_room = router.small_room if codec is Codec.DEFAULT else 0
        self._max_ndim = router.limits.max_ndim

    def __repr__(self) -> str:
        return f"<Channel {self.tag} rank {self._router.rank} {self.codec.name.lower()}>"

    async def send(self, obj: object, dst: int, *, timeout: float | None = None) -> None:
        """Send ``obj`` to ``dst``; return once its buffers may be reused.

        Waits for credit if ``dst`` has not consumed enough of the earlier
        messages. Raises ``TypeError`` for objects the channel's codec cannot
        carry, ``ValueError`` for a bad ``dst`` -- before anything is sent.
        """
        router = self._router
        if ((type(dst) is not int and (isinstance(dst, bool) or not isinstance(dst, int)))
                or not 0 <= dst < router.size):
            raise ValueError(f"rank {router.rank}: channel {self.tag} send: dst={dst!r} is not "
                             f"a rank in 0..{router.size - 1}")
        if self._closed:
            raise CommClosedError(f"rank {router.rank}: channel {self.tag} is closed")
        if self._small_room:  # the fast path: a small message, sent with the iteration's others
            body = small_encode(obj, self._small_room, self._max_ndim)
            if body is not None:
                if (not self._traced or router.probe.recording is None) and router.post(
                        body, self.tag, dst):
                    return
                await self._send(body, dst, timeout)
                return
        await self._send(router.frame_of(self.tag, obj, self.codec), dst, timeout)

    async def _send(self, frame: Encoded, dst: int, timeout: float | None) -> None:
        router = self._router
        limit = self._timeout if timeout is None else timeout
        trace = router.probe.recording if self._traced else None
        if trace is None:
            await router.send(frame, self.tag, dst, None if limit == math.inf else limit)
            return
        start, error = time.perf_counter(), None
        try:
            await router.send(frame, self.tag, dst, None if limit == math.inf else limit)
        except BaseException as exc:
            error = exc
            raise
        finally:
            nbytes = size_of(frame)
            trace.message("channel_send", nbytes, dst, self.tag, router.probe.id, start,
                          error)

    async def recv(self, src: int | None = None, *, timeout: float | None = None) -> Message:
        """Receive the next message (from ``src``, or any source); a cancelled call loses nothing.

        Raises ``CommClosedError`` once every other rank (or ``src``) has
        closed the channel and no message is left, ``ProtocolError`` for a
        malformed frame (the next call goes on with the next message).
        """
        router = self._router
        if src is not None and (isinstance(src, bool) or not isinstance(src, int)
                                or not 0 <= src < router.size):
            raise ValueError(f"rank {router.rank}: channel {self.tag} recv: src={src!r} is not "
                             f"a rank in 0..{router.size - 1}")
        if not self._traced or router.probe.recording is None:
            frames = self._box.frames
            if frames:
                first = frames[0]
                if src is None or first.src == src:  # the commonest: the first is the one
                    frames.popleft()
                    return self._open(first)
                frame = self._box.take(src)
                if frame is not None:
                    return self._open(frame)
            return await self._wait(src, self._timeout if timeout is None else timeout)
        trace = router.probe.recording
        start, error, message = time.perf_counter(), None, None
        try:
            message = await self._recv(src, timeout)
        except BaseException as exc:
            error = exc
            raise
        finally:
            nbytes = 0 if message is None else self._received
            peer = src if message is None else message.src
            trace.message("channel_recv", nbytes, peer, self.tag, router.probe.id, start,
                          error)
        return message

    async def _recv(self, src: int | None, timeout: float | None) -> Message:
        frame = self._box.take(src)
        if frame is not None:
            return self._open(frame)
        return await self._wait(src, self._timeout if timeout is None else timeout)

    async def _wait(self, src: int | None, limit: float) -> Message:
        """Wait for a message from ``src`` (any if ``None``) for up to ``limit`` seconds."""
        router, box = self._router, self._box
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + limit
        while True:  # ``recv`` found nothing just now: check, wait, then look again
            if box.ended and self._ended(src):
                who = "every other rank" if src is None else f"rank {src}"
                raise CommClosedError(f"rank {router.rank}: channel {self.tag}: {who} closed it")
            if router._closed:
                raise CommClosedError(f"rank {router.rank}: channel {self.tag}: the "
                                      "communicator is closed")
            gone = self._gone(src) if router.dead else None
            if gone:
                peer = "any" if src is None else src
                raise router._gone(f"channel {self.tag} recv from peer {peer}", *gone)
            now = time.monotonic()
            if now >= deadline:
                peer = "any" if src is None else src
                raise CommTimeoutError(f"rank {router.rank}: channel {self.tag} recv from peer "
                                       f"{peer} timed out after {limit:g} s")
            router.expect()  # what this rank issued leaves now: then look a while
            if router.hurry(box.has_frames if src is None else functools.partial(box.has, src)):
                frame = box.take(src)
                if frame is not None:
                    return self._open(frame)
            waiter: asyncio.Future[Frame | None] = loop.create_future()
            entry = (src, waiter)
            box.waiters.append(entry)
            left, timer = deadline - now, None
            if left <= router.probe_s or (not self._probe and left != math.inf):
                timer = loop.call_later(left, wake, waiter)  # the deadline is near
            elif self._probe:
                router.patrol()  # woken within probe_s, to check the peers
            try:
                frame = await waiter  # a frame, or woken (an end of stream, a death, a timer)
            except BaseException:
                handed = waiter.result() if waiter.done() and not waiter.cancelled() else None
                if handed is not None:
                    box.put_back(handed)  # handed over, but cancelled: lose nothing
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                if box.waiters and entry in box.waiters:
                    box.waiters.remove(entry)
            if frame is None:
                frame = box.take(src)
            if frame is not None:
                return self._open(frame)
            if self._probe and time.monotonic() < deadline:  # nothing yet: are they there?
                router.check_peers(self._expected(src))

    def _expected(self, src: int | None) -> list[int]:
        """The peers a recv from ``src`` may still get a message from."""
        router, ended = self._router, self._box.ended
        peers = range(router.size) if src is None else (src,)
        return [p for p in peers if p != router.rank and p not in ended]

    def _gone(self, src: int | None) -> list[int]:
        """The dead peers that leave a recv from ``src`` nobody to wait for (see the note)."""
        dead = self._router.dead
        if not dead:
            return []
        expected = self._expected(src)
        if expected and all(p in dead for p in expected):
            return expected
        return []

    def _ended(self, src: int | None) -> bool:
        ended = self._box.ended
        if src is not None:
            return src in ended
        return len(ended - {self._router.rank}) >= self._router.size - 1

    def _open(self, frame: Frame) -> Message:
        return Message(frame.src, self.tag, self.opened(frame))

    def opened(self, frame: Frame) -> object:
        """Count ``frame`` as taken from this channel; return its message's data.

        Raises what the frame carries (``ProtocolError`` for one refused on
        arrival, or of the wrong codec). Mailbox listeners (actors) take their
        frames so.
        """
        router = self._router
        router.consumed(frame)
        if self._traced and router.probe.recording is not None:
            self._received = max(frame.charge, 0)
        if frame.error is not None:
            raise frame.error
        if frame.head is None:  # a small frame: decoded on arrival (the default codec's)
            if not self._small_room:
                raise ProtocolError(f"rank {router.rank}: channel {self.tag}: message from "
                                    f"rank {frame.src}: frame of codec DEFAULT on a channel "
                                    f"of codec {self.codec.name}; refused")
            return frame.data
        try:
            return wire.decode(frame.head, frame.buffers, self.codec)
        except ProtocolError as exc:
            raise ProtocolError(f"rank {router.rank}: channel {self.tag}: message from "
                                f"rank {frame.src}: {exc}") from exc

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except CommClosedError:
                return

    async def close(self) -> None:
        """Close this rank's end: every other rank's iteration ends after our last message."""
        if self._closed:
            return
        self._closed = True
        router = self._router
        if router._closed:
            return
        for dst in range(router.size):
            if dst != router.rank:
                router.notify(Kind.EOS, self.tag, dst)


def codec_of(name: str) -> Codec:
    """Return the codec called ``name`` ("default" or "pickle")."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}: expected one of {', '.join(_CODECS)}") from None
