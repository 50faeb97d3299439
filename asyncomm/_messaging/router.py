"""The router: one per communicator, it sends and routes the frames of every channel.

It holds the receive side of asyncomm's private twin communicator, through a ``Link`` of the
backend's choosing (see ``_core.link``: in order per pair of ranks, the same frame bytes on
every backend), and delivers each frame that arrives, in order per source, into its
channel's mailbox (see ``mailbox``). Channels (``channels``) and actors (``actors``) are
built on it. A channel's ``close()`` sends EOS to every other rank (see ``Channel.close``).

Note on flow control
--------------------
A sender may have at most ``window`` messages and ``window_bytes`` bytes of one channel
unconsumed at one receiver; the first ``small.BYTES`` of each message are not counted (a
small frame counts as a message only): the message count bounds them. The receiver returns
credit (a CREDIT frame) as its user consumes messages, in batches of half the window's
messages or a quarter of its bytes; a message too large for the room left passes once no
more than a batch is out, so large messages pass. So a fast producer blocks in ``send``
instead of filling a slow consumer's memory, and messages for a channel nobody opened yet
are kept, but never more than one window per sender.

Note on dead peers
------------------
A rank that dies says no goodbye. Whoever waits on a peer (a ``recv`` from it, a ``send``
waiting for its credit, an actor call to it) checks after ``probe_s`` (``ASYNCOMM_PROBE_S``)
of waiting, and every ``probe_s`` after, that the peer is still there (``Link.probe``,
rate-limited per peer); a send to it that fails says the same. Once a peer is known dead,
the router fails what depends on it with ``PeerFailedError``: a ``recv`` from it (after the
messages it sent before dying), an any-source ``recv`` once every other rank has died or
closed the channel (while a live rank may still send, it waits), a send to it; and it tells
whoever registered in ``on_dead`` (the communicator fails its own operations that need the
peer, and its later ones).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from typing import Any

import torch

from asyncomm._core import instrument, settings, small, tags, wire
from asyncomm._core.backend import Backend
from asyncomm._core.errors import (
    CommClosedError,
    CommError,
    CommTimeoutError,
    PeerFailedError,
    ProtocolError,
    gist,
)
from asyncomm._core.link import Link
from asyncomm._core.wire import Codec, Kind
from asyncomm._messaging.mailbox import (
    DATA,
    Delivery,
    Encoded,
    Frame,
    charge,
    wake,
)

_log = logging.getLogger("asyncomm")
WINDOW = 64  # messages of one channel a sender may have unconsumed at one receiver
WINDOW_BYTES = 64 << 20  # and bytes (see the note on flow control)


def frame_limits() -> wire.Limits:
    """Return the frame limits: the defaults, with ``ASYNCOMM_MAX_MESSAGE_BYTES`` if set
    (the same on every rank: a sender refuses, ``ValueError``, what a receiver with the same
    limits would refuse, ``ProtocolError``)."""
    largest = settings.read().max_message_bytes
    return wire.Limits() if largest is None else wire.Limits(max_message_bytes=largest)


def _as_tensor(buffer: wire.Buffer) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    if buffer.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only memory is only read from here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


class Window:
    """A sender's credit towards one (receiver, channel)."""

    __slots__ = ("bytes_out", "messages_out", "open", "seq", "waiters")

    def __init__(self, open: bool) -> None:
        self.messages_out = 0
        self.bytes_out = 0
        self.seq = 0  # of the next message
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # whether a small frame may go at once (not to this rank itself, nor to a rank
        # gone, nor once the communicator closed): see ``Channel.send``
        self.open = open


class Router(Delivery):
    """This rank's receive loop and send side for every channel of one communicator."""

    def __init__(self, rank: int, size: int, link: Link, peers: Backend,
                 instrument: instrument.Instrument, probe_s: float = 0.5) -> None:
        super().__init__(rank, frame_limits(), link, WINDOW, WINDOW_BYTES)
        self.size = size
        self.peers = peers  # the communicator's backend: receives only a peer's message ends
        self.instrument = instrument  # where channels and actors report, while someone records
        self.probe_s = probe_s  # see the note on dead peers
        self.window, self.window_bytes = WINDOW, WINDOW_BYTES
        # the most bytes of a small frame's body (see ``small``)
        self.small_room = min(link.small_room, self.limits.max_message_bytes)
        self._windows: dict[tuple[int, int], Window] = {}
        self._byes: set[int] = set()  # ranks whose router said goodbye
        self._loop = asyncio.get_running_loop()
        self._all_byes: asyncio.Future[None] = self._loop.create_future()
        self._inflight: set[Any] = set()
        self.told: dict[int, BaseException] = {}  # peers that said they failed, and what
        self._quiet: set[int] = set()  # of those, the ones whose earlier sends are in
        self._left: set[int] = set()  # peers that closed without waiting for the others
        self._released = False  # whether a peer was asked to release stuck receives
        self._probed: dict[int, float] = {}  # when each peer was last probed
        self.on_dead: list[Callable[[int], None]] = []  # called with a rank once it is gone
        # a wait past ``stall_s`` (0: never) is warned of; ``explain`` (the communicator's)
        # says what the peers it waits for are doing, for warnings and timeouts
        self.stall_s = 0.0
        self.explain: Callable[[Sequence[int]], Awaitable[str]] | None = None
        self._explaining: set[asyncio.Task[None]] = set()  # (``aside``)
        self._patrol: asyncio.TimerHandle | None = None
        if self.size > 1:
            self.link.open(self, self.limits)
        else:
            self._all_byes.set_result(None)

    # -- sending ----------------------------------------------------------------

    def encode(self, tag: int, obj: object, codec: Codec) -> Encoded:
        """Encode ``obj`` for channel ``tag``; ``TypeError`` if the codec can't carry it.

        A small message of the default codec becomes a small frame's body, any other a frame;
        ``send`` sets its sequence number, when it goes."""
        if codec is Codec.DEFAULT:
            body = small.encode(obj, self.small_room, self.limits.max_ndim)
            if body is not None:
                return body
        head, buffers = wire.encode(Kind.DATA, tag, 0, obj, codec, self.limits)
        return head, [_as_tensor(b) for b in buffers]

    def window_to(self, dst: int, tag: int) -> Window:
        """Return the window of channel ``tag`` towards ``dst``."""
        window = self._windows.get((dst, tag))
        if window is None:
            window = self._windows[(dst, tag)] = Window(
                dst != self.rank and dst not in self.dead and not self.closed)
        return window

    async def send(self, frame: Encoded, tag: int, dst: int, timeout: float = math.inf) -> None:
        """Send an encoded message; wait for credit first, then until its buffers are free."""
        if self.closed:
            raise CommClosedError(f"rank {self.rank}: channel {tag}: the communicator is closed")
        if dst in self.dead:
            raise self.gone(f"channel {tag} send to peer {dst}", dst)
        nbytes = charge(frame)  # see the note on flow control
        window = self.window_to(dst, tag)
        if window.waiters or not self._fits(window, nbytes):
            await self._acquire(window, nbytes, tag, dst, timeout)
        window.messages_out += 1
        window.bytes_out += nbytes
        # The seq is taken only now: a send that timed out or was cancelled waiting for
        # credit leaves no gap, and nothing can run between here and the transmit.
        seq = window.seq
        window.seq = seq + 1
        if isinstance(frame, bytes):  # a small frame: its bytes are copied already
            if dst == self.rank:
                try:
                    self._small(dst, DATA, tag, seq, small.decode(frame, self.limits))
                except ProtocolError as exc:  # (what this rank encoded: never)
                    self._small(dst, DATA, tag, seq, exc)
            else:
                self.link.send_small(dst, DATA, tag, seq, frame)
            return
        head, buffers = frame
        head = wire.with_seq(head, seq)
        try:
            for handle in self.transmit(dst, head, buffers):
                await handle  # no task per handle: most are done already
        except PeerFailedError as exc:
            cause = exc.__cause__
            if cause is None or isinstance(cause, CommError):  # not dst's connection's own
                raise
            self.failed(dst, cause)
            raise self.gone(f"channel {tag} send to peer {dst}", dst) from exc

    # -- dead peers (see the note) ---------------------------------------------------

    def alive(self, peer: int) -> bool:
        """Return whether ``peer`` may be alive; probe it unless it was probed just now."""
        if peer in self.dead:
            return False
        if peer == self.rank or self.closed or peer in self._byes:
            # no probe after our goodbye (a probe is a message), nor of a rank that closed
            return True
        now = time.monotonic()
        if now - self._probed.get(peer, -math.inf) < self.probe_s:
            return True
        self._probed[peer] = now
        gone = self.link.probe(peer)
        if gone is None:
            return True
        self.failed(peer, gone)
        return False

    def failed(self, peer: int, cause: BaseException) -> None:
        """``peer`` is gone: fail what waits on it, and the communicator's later operations."""
        if peer in self.dead or peer == self.rank:
            return
        self.dead[peer] = cause
        self.link.lost(peer, peer in self._byes)
        for box in self._mailboxes.values():
            box.wake()
        for (dst, _), window in self._windows.items():
            if dst == peer:
                window.open = False
                for waiter in window.waiters:
                    wake(waiter)
        self._count_byes()
        for callback in self.on_dead:
            callback(peer)

    def said_failed(self, peer: int, cause: BaseException, grace: float) -> None:
        """``peer`` said it failed (``cause``): a call to it fails now. It sends nothing
        more, but what it sent before may still be on its way (the notice came another
        way): a receive that waits on it alone fails ``grace`` s later (``silent``)."""
        if peer != self.rank and peer not in self.dead and peer not in self.told:
            self.told[peer] = cause
            self._loop.call_later(grace, self._quieten, peer)

    def _quieten(self, peer: int) -> None:
        self._quiet.add(peer)
        for box in self._mailboxes.values():
            box.wake()

    def silent(self, peer: int) -> bool:
        """Whether ``peer`` sends nothing more: it is gone, or it said it failed and what
        it sent before is in."""
        return peer in self.dead or peer in self._quiet

    def gone(self, what: str, *peers: int) -> PeerFailedError:
        """The error of an operation that needed ``peers``, which are gone or said they
        failed."""
        ranks = ", ".join(str(p) for p in peers)
        why = [self.dead.get(p) or self.told.get(p) for p in peers]
        causes = "; ".join(gist(cause) for cause in why if cause is not None)
        error = PeerFailedError(f"rank {self.rank}: {what}: rank{'s' if len(peers) > 1 else ''} "
                                f"{ranks} failed ({causes})")
        error.__cause__ = why[0]
        return error

    async def timed_out(self, what: str, limit: float, peers: Sequence[int]) -> CommTimeoutError:
        """The error of ``what``, waiting for ``peers``, after ``limit`` s: with their state."""
        said = await self.explain(peers) if self.explain is not None and peers else ""
        return CommTimeoutError(f"rank {self.rank}: {what} timed out after {limit:g} s"
                                + (f". Meanwhile {said}." if said else ""))

    def aside(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (saying what peers do: it asks them) as a task kept until done."""
        task = self._loop.create_task(work)
        self._explaining.add(task)
        task.add_done_callback(self._explaining.discard)

    def warn_stalled(self, what: str, waited: float, peers: Sequence[int]) -> None:
        """Warn that ``what`` has waited ``waited`` s for ``peers``, with their state."""
        async def warn() -> None:
            said = await self.explain(peers) if self.explain is not None and peers else ""
            _log.warning("asyncomm: %s has been pending for %.1f s (ASYNCOMM_STALL_S=%g); "
                         "it goes on waiting.%s", what, waited, self.stall_s,
                         f" Meanwhile {said}." if said else "")

        self.aside(warn())

    def others(self, src: int | None) -> list[int]:
        """The ranks a wait on ``src`` (``None``: any) waits for."""
        return [r for r in range(self.size) if r != self.rank] if src is None else [src]

    def known(self, peer: int) -> str | None:
        """Say what this rank already knows of ``peer``'s end: failed, or finished; else None."""
        if peer in self.dead:
            return f"failed ({gist(self.dead[peer])})"
        if peer in self._byes:
            return "finished (closed this communicator)"
        return None

    def check_peers(self, peers: Iterable[int]) -> None:
        """Probe ``peers`` (rate-limited): a waiter has waited ``probe_s`` for them."""
        for peer in peers:
            self.alive(peer)

    def _fits(self, window: Window, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` may go now."""
        out, out_bytes = window.messages_out, window.bytes_out
        # A message too large for the room left passes once all that is out may be credit the
        # receiver holds back until a batch is full (``Delivery.took``): else it would never pass.
        return (out == 0
                or (out < self.batch and out_bytes < self._batch_bytes)
                or (out < self.window and out_bytes + nbytes <= self.window_bytes))

    async def _acquire(self, window: Window, nbytes: int, tag: int, dst: int,
                       timeout: float) -> None:
        """Wait for credit for a message of ``nbytes``, in turn with other senders."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        window.waiters.append(waiter)
        deadline = time.monotonic() + timeout  # (inf: no deadline)
        try:
            while True:
                if self.closed:
                    raise CommClosedError(f"rank {self.rank}: channel {tag} send to peer "
                                          f"{dst}: the communicator is closed")
                if dst in self.dead:
                    raise self.gone(f"channel {tag} send to peer {dst} (waiting for credit)",
                                     dst)
                if window.waiters[0] is waiter and self._fits(window, nbytes):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"rank {self.rank}: channel {tag} send to peer "
                                           f"{dst}: no credit after {timeout:g} s")
                await asyncio.wait((waiter,), timeout=min(left, self.probe_s))
                if waiter.done():
                    fresh = loop.create_future()
                    window.waiters[window.waiters.index(waiter)] = fresh
                    waiter = fresh
                else:  # no credit for a while: is dst still there?
                    self.alive(dst)
        finally:
            window.waiters.remove(waiter)
            if window.waiters and not window.waiters[0].done():
                window.waiters[0].set_result(None)

    def _credit(self, src: int, tag: int, messages: int, nbytes: int) -> None:
        window = self._windows.get((src, tag))
        if window is None:
            return
        window.messages_out = max(0, window.messages_out - messages)
        window.bytes_out = max(0, window.bytes_out - nbytes)
        if window.waiters and not window.waiters[0].done():
            window.waiters[0].set_result(None)

    def transmit(self, dst: int, head: bytes, buffers: list[torch.Tensor]) -> list[Any]:
        """Issue one frame to ``dst`` (itself included); return the handles of its sends."""
        if dst == self.rank:  # no transport: a private copy, delivered in order
            decoded = wire.decode_head(head, self.limits)
            self._deliver(Frame.whole(self.rank, decoded, [b.clone() for b in buffers],
                                       decoded.seq))
            return []
        return self.link.send(dst, head, buffers)

    def notify(self, kind: Kind, tag: int, dst: int, obj: object = None) -> None:
        """Send a small control frame without waiting (credit, end of stream)."""
        if dst in self.dead:
            return
        head, buffers = wire.encode(kind, tag, 0, obj)
        handles = self.transmit(dst, head, [_as_tensor(b) for b in buffers])
        self._inflight.update(handles)
        self._inflight = {h for h in self._inflight if not h.done()}

    # -- receiving -----------------------------------------------------------------

    def expect(self) -> None:
        """A task begins to wait for a frame: send what it issued now, not when the iteration
        ends (the answer cannot come before the question has left), and watch closely."""
        self.link.flush()
        self.link.expect()

    def patrol(self) -> None:
        """Wake every waiting receiver within ``probe_s`` (to check its peers, its deadline):
        one timer for all, not one per wait (a timer costs as much as a message's delivery)."""
        if self._patrol is None:
            self._patrol = asyncio.get_running_loop().call_later(self.probe_s, self._tick)

    def _tick(self) -> None:
        self._patrol = None
        for box in self._mailboxes.values():
            if box.waiters:
                box.wake()

    def bye(self, src: int, dead: int | None = None) -> None:
        """``src``'s router said goodbye, or said it for ``dead`` (see ``_core.link``)."""
        if dead is not None:  # so this rank says it too, to the rank it drains
            self.failed(dead, PeerFailedError(f"rank {src} found rank {dead} gone"))
        self._byes.add(src if dead is None else dead)
        self._count_byes()

    def _count_byes(self) -> None:
        """Resolve ``_all_byes`` once every other rank said goodbye or is known gone."""
        if (len((self._byes | self.dead.keys()) - {self.rank}) >= self.size - 1
                and not self._all_byes.done()):
            self._all_byes.set_result(None)

    def _ask_release(self) -> None:
        """Ask a live peer to end the communicator's receives only its message can end (sent
        before the goodbye, so the peer handles it before it closes)."""
        stuck = self.peers.stuck()
        helper = next((p for p in self.others(None) if p not in self.dead and p not in self._left),
                      None)
        if stuck and helper is not None:
            self.notify(Kind.EOS, tags.RELEASE, helper, stuck)
            self._released = True

    async def _drained(self) -> None:
        await asyncio.shield(self._all_byes)
        if self.size > 1:  # a world of one opens no link
            await self.link.drained()

    def _control(self, frame: Frame) -> None:
        """Take a frame that carries no message: credit, an end of stream, a request."""
        head, tag = frame.head, frame.tag
        assert head is not None  # control frames are whole frames (but small credit)
        if frame.kind == Kind.CREDIT:
            credit: Any = wire.decode(head, frame.buffers, Codec.DEFAULT)
            self._credit(frame.src, tag, int(credit[0]), int(credit[1]))
        elif frame.kind == Kind.EOS and tag >= tags.BYE:  # see close
            if tag == tags.RELEASE:
                stuck: Any = wire.decode(head, frame.buffers, Codec.DEFAULT)
                for stuck_tag in stuck:
                    self.peers.release(frame.src, int(stuck_tag))
            elif tag == tags.LEAVING:
                self._left.add(frame.src)
        elif frame.kind == Kind.EOS:
            box = self.mailbox(tag)
            box.ended.add(frame.src)
            box.wake()
        else:
            self.refuse(frame.src, ProtocolError(f"frame of kind {frame.kind}"), tag)

    async def close(self, timeout: float) -> None:
        """Say goodbye to every rank, wait (up to ``timeout``) for theirs, stop receiving.

        Closing is collective, like MPI's finalize (see the note on closing in
        ``_core.link``). Every peer not heard from is probed first: a dead one is not waited
        for (its goodbye is said for it). A live rank that never closes leaves the link's
        receive posted after ``timeout``.
        """
        if self.closed:
            return
        if self.size > 1:  # who is gone says no goodbye: ask everyone still expected
            for peer in self.others(None):
                if peer not in self._byes:
                    self._probed.pop(peer, None)
                    self.alive(peer)
        self.closed = True
        for window in self._windows.values():
            window.open = False  # small frames go through ``send`` now, which refuses them
        if self.size > 1:
            if timeout <= 0:  # so that nobody asks this rank to release anything
                for peer in self.others(None):
                    self.notify(Kind.EOS, tags.LEAVING, peer)
            self._ask_release()
            self._inflight.update(self.link.goodbye(frozenset(self.dead)))
            self._count_byes()
        if timeout > 0:
            try:
                await asyncio.wait_for(self._drained(), timeout)
            except asyncio.TimeoutError:
                pass
            if self._released:
                await self.peers.released(min(timeout, 2.0))
        self.link.stop()
        if self._patrol is not None:
            self._patrol.cancel()
        await self.link.join(1.0)
        for box in self._mailboxes.values():
            box.wake()
        for window in self._windows.values():
            for waiter in window.waiters:
                wake(waiter)
