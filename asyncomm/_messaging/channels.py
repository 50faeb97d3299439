"""Channels: messages multiplexed by tag between ranks, over the router (``router`` keeps
flow control, dead peers and the end of a stream; see docs/channels-and-actors.md)."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable

from asyncomm._core import wire
from asyncomm._core.errors import CommClosedError, CommTimeoutError, ProtocolError
from asyncomm._core.small import encode as small_encode
from asyncomm._core.wire import Codec, Kind
from asyncomm._messaging.mailbox import Encoded, Entry, Frame, Message, size_of, wake
from asyncomm._messaging.router import Router, Window

__all__ = ["Channel", "Message", "codec_of"]

_CODECS = {"default": Codec.DEFAULT, "pickle": Codec.PICKLE}


class Channel:
    """Messages on one tag between the ranks of a communicator.

    ``await ch.send(obj, dst)`` and ``msg = await ch.recv(src=None)``;
    ``async for msg in ch`` until every other rank closed the channel.
    Per (sender, channel) messages arrive exactly once and in order.
    """

    def __init__(self, router: Router, tag: int, codec: Codec, timeout: float,
                 user: bool = False, senders: frozenset[int] | None = None) -> None:
        self._router = router
        # the ranks that send on it (None: every rank): a receive from any ends with them
        self.senders = senders
        self.tag = tag
        self.codec = codec
        self._timeout = timeout
        self._box = router.mailbox(tag)
        self._closed = False
        # a user's channel (``comm.channel``) is traced, says stalls and its peers' state, and
        # probes them while a recv waits; the actors' own do none of this (they do not probe:
        # every rank serves, and most wait for nothing in particular)
        self._user = user
        self._received = 0  # bytes of the last message opened, for the trace
        # small messages of the default codec: the most bytes of one (0: none are small)
        self._small_room = router.small_room if codec is Codec.DEFAULT else 0
        self._windows: dict[int, Window] = {}  # per destination, as the router keeps them
        self._window = router.window  # the most messages out per destination
        self._post = router.link.post
        self._flush = router.link.flush
        self._spin_until = router.link.spin_until
        self._polls = router.link.polls  # whether ``spin_until`` may find anything
        self._refused = router.link.refused
        self._has: dict[int, Callable[[], bool]] = {}  # per source: ``_has_from``
        self._instrument = router.instrument
        self._size = router.size
        self._max_ndim = router.limits.max_ndim

    def __repr__(self) -> str:
        return f"<Channel {self.tag} rank {self._router.rank} {self.codec.name.lower()}>"

    async def send(self, obj: object, dst: int, *, timeout: float | None = None) -> None:
        """Send ``obj`` to ``dst``; return once its buffers may be reused (waiting for credit
        first if ``dst`` has not consumed enough of the earlier messages).

        Args:
            obj: what to send: a tensor, or plain data holding tensors (the channel's codec).
            dst: the rank to send to (may be this rank).
            timeout: seconds to wait for credit (default: the communicator's timeout).

        Raises:
            TypeError: the channel's codec cannot carry ``obj`` (before anything is sent).
            ValueError: ``dst`` is not a rank (before anything is sent).
            CommClosedError: this end of the channel, or the communicator, is closed.
            CommTimeoutError: no credit came within ``timeout``.
            PeerFailedError: ``dst`` is known dead.
        """
        window = self._windows.get(dst) if type(dst) is int else None
        try:
            if window is None:  # another codec, or a rank not checked before
                await self._send_slowly(obj, dst, timeout)
            elif ((self._user and self._instrument.recording is not None)
                  or not self._post(window, dst, self.tag, obj, self._small_room,
                                    self._max_ndim, self._window)):  # (commonest: queued)
                await self._send(self._router.encode(self.tag, obj, self.codec), dst, timeout)
        except TypeError as exc:  # the codec's: say who refused it
            if str(exc).startswith("rank "):
                raise
            raise TypeError(f"rank {self._router.rank}: channel {self.tag} send to {dst}: "
                            f"{exc}") from None

    def post(self, obj: object, dst: int) -> bool:
        """Send ``obj`` now if it is a small message and ``dst``'s window has credit (no
        coroutine: actors post their messages so).

        Args:
            obj: what to send, as ``send`` takes it.
            dst: the rank to send to.

        Returns:
            Whether it went; if not, nothing was sent (``send`` it).
        """
        window = self._windows.get(dst)
        if window is None:
            if (not self._small_room or self._closed or type(dst) is not int
                    or not 0 <= dst < self._router.size):
                return False
            window = self._windows[dst] = self._router.window_to(dst, self.tag)
        # Queued by ``Link.post`` if small and the window lets it; else ``send`` waits for
        # credit, says why it cannot send, delivers to this rank itself, or traces it.
        if self._user and self._instrument.recording is not None:
            return False
        return self._post(window, dst, self.tag, obj, self._small_room, self._max_ndim,
                          self._window)

    async def _send_slowly(self, obj: object, dst: int, timeout: float | None) -> None:
        """``send`` of a message of another codec, or to a rank not checked before."""
        router = self._router
        if type(dst) is not int or not 0 <= dst < router.size:
            self._check_rank("send", "dst", dst)
        if self._closed:
            raise CommClosedError(f"rank {router.rank}: channel {self.tag} is closed")
        if self._small_room:
            self._windows[dst] = router.window_to(dst, self.tag)  # its fast path, from now on
        await self._send(router.encode(self.tag, obj, self.codec), dst, timeout)

    def _check_rank(self, op: str, name: str, rank: object) -> None:
        """Raise ``ValueError`` unless ``rank`` is a rank of the communicator (an int)."""
        router = self._router
        if (isinstance(rank, bool) or not isinstance(rank, int)
                or not 0 <= rank < router.size):
            raise ValueError(f"rank {router.rank}: channel {self.tag} {op}: {name}={rank!r} is "
                             f"not a rank in 0..{router.size - 1}")

    async def _send(self, frame: Encoded, dst: int, timeout: float | None) -> None:
        router = self._router
        sent = router.send(frame, self.tag, dst, self._timeout if timeout is None else timeout)
        if self._user and self._instrument.recording is not None:
            sent = self._instrument.traced(sent, "channel_send", size_of(frame), dst, self.tag)
        await sent

    async def recv(self, src: int | None = None, *, timeout: float | None = None) -> Message:
        """Receive the next message; a cancelled call loses nothing.

        Args:
            src: the rank to receive from; ``None``: any rank.
            timeout: seconds to wait (default: the communicator's timeout).

        Returns:
            ``Message(src, tag, data)``.

        Raises:
            ValueError: ``src`` is not a rank (before anything is taken).
            CommClosedError: every other rank (or ``src``) closed the channel and no
                message is left, or the communicator is closed.
            CommTimeoutError: nothing came within ``timeout``.
            PeerFailedError: every rank it could come from is dead.
            ProtocolError: a malformed message (the next call goes on with the next one).
        """
        spun = False
        if src is not None and (type(src) is not int or not 0 <= src < self._size):
            self._check_rank("recv", "src", src)
        if not self._user or self._instrument.recording is None:
            box = self._box
            while True:
                entry = box.take(src)
                if entry is not None:
                    return self.opened(entry)
                limit = self._timeout if timeout is None else timeout
                if spun:  # (what was found is not there: taken meanwhile)
                    return await self._wait(src, limit)
                self._flush()  # (here, not in ``_wait``: it leaves before that is made)
                if not self._polls or limit <= 0:
                    return await self._wait(src, limit)
                # Spun for here, where the link polls (MPI): found, it is taken above, no
                # ``_wait`` coroutine made
                if not self._spin_until(box.has_frames if src is None else self._has_from(src)):
                    return await self._wait(src, limit, spun=True)
                spun = True
        trace = self._instrument.recording
        assert trace is not None  # (traced: said above)
        start, error, message = time.perf_counter(), None, None
        try:
            message = await self._recv(src, timeout)
        except BaseException as exc:
            error = exc
            raise
        finally:
            nbytes = 0 if message is None else self._received
            peer = src if message is None else message.src
            trace.message("channel_recv", nbytes, peer, self.tag, self._instrument.id, start,
                          error)
        return message

    async def _recv(self, src: int | None, timeout: float | None) -> Message:
        frame = self._box.take(src)
        if frame is not None:
            return self.opened(frame)
        self._flush()
        return await self._wait(src, self._timeout if timeout is None else timeout)

    def _has_from(self, src: int) -> Callable[[], bool]:
        """What says whether a message from ``src`` is in the mailbox (made once a source)."""
        has = self._has.get(src)
        if has is None:
            has = self._has[src] = functools.partial(self._box.has, src)
        return has

    async def _wait(self, src: int | None, limit: float, spun: bool = False) -> Message:
        """Wait for a message from ``src`` (any if ``None``) for up to ``limit`` seconds; the
        caller sent what this rank issued first (``Link.flush``: it may be answered).
        ``spun``: the caller spun for it already (``recv``), and found none."""
        router, box = self._router, self._box
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + limit
        stall_at = started + (router.stall_s or math.inf) if self._user else math.inf
        what = f"channel {self.tag} recv from peer {'any' if src is None else src}"
        while True:  # ``recv`` found nothing just now: check, wait, then spin again
            if box.ended and self._ended(src):
                who = "every other rank" if src is None else f"rank {src}"
                raise CommClosedError(f"rank {router.rank}: channel {self.tag}: {who} closed it")
            if router.closed:
                raise CommClosedError(f"rank {router.rank}: channel {self.tag}: the "
                                      "communicator is closed")
            gone = self._gone(src) if router.dead or router.told else None
            if gone:
                raise router.gone(what, *gone)
            now = time.monotonic()
            if now >= deadline or now >= stall_at:  # (a stall is said once, while it waits)
                if now >= deadline:
                    raise (await router.timed_out(what, limit, router.others(src)) if self._user
                           else CommTimeoutError(f"rank {router.rank}: {what} timed out after "
                                                 f"{limit:g} s"))
                stall_at = math.inf
                router.warn_stalled(f"rank {router.rank}: {what}", now - started,
                                    router.others(src))
            router.expect()  # what this rank issued leaves now: then spin a while
            if spun:  # (``recv`` spun just now)
                spun = False
            elif self._spin_until(box.has_frames if src is None else self._has_from(src)):
                frame = box.take(src)  # (there: ``spin_until`` says so)
                if frame is not None:
                    return self.opened(frame)
            if self._refused():  # no spin until the loop turns: yield it, then spin again
                await asyncio.sleep(0)
                frame = box.take(src)  # (the loop may have put it here meanwhile)
                if frame is not None:
                    return self.opened(frame)
                continue
            waiter: asyncio.Future[None] = loop.create_future()
            entry = (src, waiter)
            box.waiters.append(entry)
            left, timer = deadline - now, None
            if left <= router.probe_s or (not self._user and left != math.inf):
                timer = loop.call_later(left, wake, waiter)  # the deadline is near
            elif self._user:
                router.patrol()  # woken within probe_s, to check the peers
            try:
                await waiter  # woken: something came (or an end of stream, a death, a timer)
            except BaseException:  # cancelled: it took nothing, what came stays in the mailbox
                if waiter.done() and not waiter.cancelled() and box.frames:
                    box.wake()  # woken for it first: the other receivers take it instead
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                if box.waiters and entry in box.waiters:
                    box.waiters.remove(entry)
            frame = box.take(src)
            if frame is not None:
                return self.opened(frame)
            if self._user and time.monotonic() < deadline:  # nothing yet: are they there?
                router.check_peers(self._expected(src))

    def _expected(self, src: int | None) -> list[int]:
        """The peers a recv from ``src`` may still get a message from."""
        router, ended = self._router, self._box.ended
        peers: Iterable[int]
        if src is not None:
            peers = (src,)
        else:
            peers = range(router.size) if self.senders is None else self.senders
        return [p for p in peers if p != router.rank and p not in ended]

    def _gone(self, src: int | None) -> list[int]:
        """The peers, dead or that said they failed, that leave a recv from ``src`` nobody
        to wait for (see the router's note on dead peers)."""
        silent = self._router.silent
        expected = self._expected(src)
        if expected and all(silent(p) for p in expected):
            return expected
        return []

    def _ended(self, src: int | None) -> bool:
        ended = self._box.ended
        if src is not None:
            return src in ended
        if self.senders is not None:
            return self.senders - {self._router.rank} <= ended
        return len(ended - {self._router.rank}) >= self._router.size - 1

    def over(self, src: int | None = None) -> bool:
        """Whether every ``recv`` from ``src`` (``None``: any rank) now fails at once.

        A loop that receives from any rank asks this after an error: a stream that a rank
        broke as it died fails one receive (``PeerFailedError``) while the others may still
        send.

        Args:
            src: the rank asked about, or ``None``: every rank a message could come from.

        Returns:
            Whether the communicator is closed, or every rank it could come from closed the
            channel, is gone, or said it failed.
        """
        return self._router.closed or self._ended(src) or bool(self._gone(src))

    def listen(self, listener: Callable[[Entry], None]) -> None:
        """Hand every message to ``listener`` as it arrives, instead of queuing it.

        Args:
            listener: called on the loop with each message's entry; it takes the message
                with ``opened(entry)``.
        """
        self._box.listener = listener

    def opened(self, entry: Entry) -> Message:
        """Count ``entry`` as taken from this channel (as a listener does); return it as the
        ``Message`` a receiver gets (``entry`` itself where it is one).

        Args:
            entry: what the listener was handed (or ``recv`` took).

        Raises:
            ProtocolError: the frame was refused on arrival, or is of the wrong codec.
        """
        if type(entry) is Message and self._small_room and (
                not self._user or self._instrument.recording is None):
            # the commonest (an actor's request or reply): nothing to check, nothing to trace
            self._router.took(entry, self._box)
            return entry
        router = self._router
        router.took(entry, self._box)
        if type(entry) is Message:  # a small message: decoded on arrival (the default codec's)
            if self._user and self._instrument.recording is not None:  # its bytes, as sent
                self._received = len(small_encode(entry[2], self._small_room, self._max_ndim)
                                     or b"") if self._small_room else 0
            if not self._small_room:
                raise ProtocolError(f"rank {router.rank}: channel {self.tag}: message from "
                                    f"rank {entry[0]}: frame of codec DEFAULT on a channel "
                                    f"of codec {self.codec.name}; refused")
            return entry
        frame: Frame = entry  # type: ignore[assignment]
        if self._user and self._instrument.recording is not None:
            self._received = max(frame.charge, 0)
        if frame.error is not None:
            raise frame.error
        assert frame.head is not None
        try:
            return Message(frame.src, self.tag, wire.decode(frame.head, frame.buffers, self.codec))
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
        """Close this rank's sending end, at once (a half-close: it still receives). Each
        other rank's receive from this one ends after its last message, and a receive from
        any rank once every sender has closed (every other rank, or ``senders``)."""
        if self._closed:
            return
        self._closed = True
        self._windows.clear()  # (sends go the slow way, which refuses them)
        router = self._router
        if router.closed:
            return
        for dst in router.others(None):
            router.notify(Kind.EOS, self.tag, dst)


def codec_of(name: str) -> Codec:
    """Return the codec called ``name`` ("default" or "pickle")."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}: expected one of {', '.join(_CODECS)}") from None
