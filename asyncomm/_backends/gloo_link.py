"""The link of torch backends: channel frames over gloo, served by four threads.

Note on threads
---------------
gloo's receives must know their size and complete only inside a blocking
``wait()``; a send of a buffer moves only once its receive is posted (a
rendezvous). Posting a frame's data receives from the event loop puts a loop
iteration and two thread hand-offs on the path of every large frame
(measured: 64 x 1 MiB streamed at 0.29x raw gloo). So a *listener* thread
keeps ``DEPTH`` any-source receives of ``ENVELOPE_BYTES`` messages posted, and
when one arrives posts that frame's data receives at once, in order. A
*completer* thread waits for the data receives, frame after frame, and hands
each whole frame to the loop through the backend's inbox. A *poster* thread
posts the data sends, and link messages while data moves (see the note on
posting), in order, and never waits for one; a *sender* thread waits for
them in the order they were posted (one thread, where the backend's own
sends take a waiter thread each). The loop parses frames that came in one
piece itself. The listener posts no receive after
the last peer's goodbye (see the note on closing in ``_link``).

Note on batches and message sizes
---------------------------------
The envelopes of large frames travel in batches (see the note on the layout
in ``_link``). On gloo a batch spares every frame but its first an eager
send, a listener's wake-up and a receive re-posted, on both ranks: 64 x 1
MiB streamed at 0.54x raw gloo with an envelope each, 0.76-0.93x in batches.
The listener posts the data receives of a batch's frames in order and tells
the loop of them in one hand-off. A batch holds the envelopes of about 150
large frames (40 where messages are padded), so a burst's go in one
message, ahead of its data: a second batch, sent once the receiver had
posted the first's receives, reached it behind their data on the same
connection (a burst of 64 x 1 MiB with 4 KiB envelopes: batches of 40 and
24, the second read 6 ms into a 9 ms round, its frames' receives posted
only then; 0.76-0.81x raw gloo against 0.81-0.85 with one batch, three
launches each, alternated). On Linux, link messages are as long as
what they hold: gloo's TCP transport takes a message into a longer receive.
Its libuv transport (macOS, Windows) reads as many bytes as the receive
holds, so there they are padded to ``ENVELOPE_BYTES``.

Note on posting
---------------
gloo's TCP pair holds one lock while its I/O thread reads or writes a
message, and a send or receive posted to that pair waits for it: credit
frames sent by the receiving loop while 64 x 1 MiB streamed in held it in
gloo's ``send`` 1.2 s of a 4.5 s run (p90 4.6 ms a send, up to 13 ms). So the
loop posts nothing to gloo while data moves: data messages, and link
messages while data messages are out or expected (or earlier link messages
still wait to be posted), are posted by the poster thread, in order (then
34-54 ms of the same run); a link message so sent counts as sent at once,
as an eager send does. Otherwise the loop posts link messages itself: a
round trip of small messages takes no thread hand-off. A data message is
queued for the poster only once its envelope is posted (its batch's). The
poster never waits for a send: a link message is never held behind a data
send that does not complete (its receiver refused its envelope: the rank's
messages to every other peer would wait with it).

Note on draining
----------------
One posted receive at a time puts a listener's reaction between any two
messages; with ``DEPTH`` posted, messages flow while it works (measured with
gloo alone: 64 x 1 MiB at ~1,100 MiB/s with one, 1,500-3,200 with eight).
But no receive may stay posted when the group goes, and gloo cannot cancel
one. So the listener re-posts after every message until the last peer's
goodbye, except after a DRAIN message, and each rank sends ``DEPTH - 1``
DRAINs to rank ``rank - 1`` after its goodbyes: the receives still posted
once every goodbye is in are exactly the ones the DRAINs fill.

Note on dead peers
------------------
gloo fails an operation on a connection that closed (its peer died), but
not an any-source receive, which belongs to no connection: the listener
never learns of a death. ``probe`` sends the peer a PING message, which the
listener drops; if the peer is gone, the send fails at once (gloo closed its
connection when the socket did). A dead rank drains no one and says no
goodbye, so each rank drains the nearest *live* rank below it and first
says the dead ranks' goodbyes to it (proxy ``BYE``s, see ``_link``): the
count above holds as long as the live ranks agree on who is dead (they
probe everyone just before saying goodbye). A rank left with no live peer
cannot be drained: its listener stays blocked in its receive (a daemon
thread) until the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncomm._backends import gloo_p2p
from asyncomm._core import tags, wire
from asyncomm._core.errors import CommClosedError, CommError, PeerFailedError, ProtocolError
from asyncomm._core.handle import Handle
from asyncomm._core.link import Arrivals, Link, Transport, bye_from, proxy_bye, signal
from asyncomm._core.messages import BATCH, PREAMBLE, Pending, envelopes
from asyncomm._core.progress import Classify, Inbox, Waiters

# gloo's TCP transport (Linux) takes a message into a longer receive; its libuv transport
# (macOS, Windows) reads as many bytes as the receive holds (see the note on batches).
SHORT = gloo_p2p.SHORT
# the most bytes of a link message on gloo (its receives' size; padded to it where not SHORT)
ENVELOPE_BYTES = (16 if SHORT else 4) << 10
DEPTH = 8  # any-source receives the listener keeps posted
DRAIN: bytes = signal(tags.DRAIN)  # see the note on draining
PING: bytes = signal(tags.PING)  # see the note on dead peers
_AT = PREAMBLE.size


def _ping_message() -> torch.Tensor:
    message = bytearray(_AT + len(PING) if SHORT else ENVELOPE_BYTES)
    PREAMBLE.pack_into(message, 0, len(PING), len(PING), 0, 0)
    message[_AT:_AT + len(PING)] = PING
    return torch.frombuffer(message, dtype=torch.uint8)


class Endpoint(Transport, Protocol):
    """What the gloo link needs of its backend beyond receives: its eager sends."""

    def send_raw(self, sink: Any, tensor: torch.Tensor, dst: int, tag: int,
                 eager: bool = True, copied: bool = False) -> None:
        """Issue a send of the bytes as they are (``eager``: done at once, of a copy unless
        ``tensor`` is one already, never written again)."""


class _OnLoop:
    """A sink for the inbox that runs what a thread hands over on the loop (its ``finish``)."""

    def _succeed(self, value: object) -> None:
        pass

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        # A bug in the link: report it, and let the inbox go on with what follows.
        asyncio.get_running_loop().call_exception_handler(
            {"message": "asyncomm: a channel frame could not be handed over", "exception": cause})

    _abandon = _fail


_ON_LOOP = _OnLoop()


class _Watched:
    """The sink of a link message nobody awaits (a PING, one the poster thread posted): a
    failure says the peer is gone."""

    def __init__(self, link: GlooLink, dst: int, ping: bool = False) -> None:
        self._link, self._dst, self._ping = link, dst, ping

    def _succeed(self, value: object) -> None:
        if self._ping:
            self._link._pinging.discard(self._dst)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        self._succeed(None)
        link = self._link
        if issubclass(kind, PeerFailedError) and link._arrivals is not None:
            link._arrivals.failed(self._dst, cause)
        elif not self._ping and not issubclass(kind, CommClosedError):
            link._loop.call_exception_handler({
                "message": f"asyncomm: messages to rank {self._dst} were lost",
                "exception": cause})

    _abandon = _fail


_Sink = Handle[None] | _Watched
_Send = tuple[torch.Tensor, int, int, _Sink]  # a tensor, its destination and tag, its sink


def _nothing(_: object) -> None:
    return None


def _serve(items: queue.SimpleQueue[Any], each: Any) -> None:
    """On a thread: ``each(*item)`` for every queued item, until ``None``."""
    while (item := items.get()) is not None:
        each(*item)


def _wait_all(works: list[Any]) -> RuntimeError | None:
    """Wait for gloo works in turn; return the first failure (the rest are not waited for)."""
    for work in works:
        try:
            work.wait()
        except RuntimeError as exc:
            return exc
    return None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _reraise(exc: BaseException, _: object) -> None:
    raise exc


class GlooLink(Link):
    """Link messages of ``ENVELOPE_BYTES``, served by four threads (see the note on threads)."""

    def __init__(self, backend: Endpoint, pg: Any, loop: asyncio.AbstractEventLoop, inbox: Inbox,
                 waiters: Waiters, classify: Classify) -> None:
        super().__init__(backend, loop, ENVELOPE_BYTES - _AT)
        self._endpoint = backend
        self._pg = pg
        self._size = backend.size
        self._inbox = inbox
        self._waiters = waiters
        self._classify = classify
        self._frames: queue.SimpleQueue[tuple[Pending, list[Any]] | None] = queue.SimpleQueue()
        self._sends: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self._posted_works: queue.SimpleQueue[tuple[Any, _Sink] | None] = queue.SimpleQueue()
        self._behind_batch: dict[int, list[_Send]] = {}  # data sends whose envelope's batch waits
        # Counted on the loop (see the note on posting): data sends not seen off, data
        # frames expected, link messages queued for the poster thread and (its count)
        # posted by it.
        self._data_out = self._expected = self._queued = 0
        self._posted = 0  # written by the poster thread only
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._drained = loop.create_future()  # the listener has nothing posted
        self._ping = _ping_message()  # only read: every probe sends the same bytes
        self._can_drain = True  # False once no live peer is left to drain this rank
        self._pinging: set[int] = set()  # peers with a PING in flight
        self.batching = True  # see the note on batches

    def open(self, arrivals: Arrivals, limits: wire.Limits) -> None:
        super().open(arrivals, limits)
        for target, name in ((self._listen, "asyncomm-listener"),
                             (functools.partial(_serve, self._frames, self._complete),
                              "asyncomm-completer"),
                             (self._post_sends, "asyncomm-poster"),
                             (functools.partial(_serve, self._posted_works, self._see_off),
                              "asyncomm-sender")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _packet(self, packet: bytes | bytearray) -> bytes | bytearray:
        return packet  # sent as it is (padded where it must be: see ``_post``)

    def probe(self, dst: int) -> BaseException | None:
        """Send ``dst`` a PING; a send to a dead peer fails at once (see the note).

        At most one PING per peer is in flight: one to a stalled peer waits
        (on a waiter thread, not the sender's, so other peers' sends go on)
        and reports a death if the peer dies meanwhile.
        """
        if dst in self._pinging:
            return None
        try:
            work = self._pg.send([self._ping], dst, tags.LINK_MESSAGE)
        except RuntimeError as exc:
            return exc
        self._pinging.add(dst)
        self._waiters.watch(work.wait, _Watched(self, dst, ping=True), _nothing)
        return None

    def goodbye(self, gone: frozenset[int] = frozenset()) -> list[Handle[None]]:
        """Say goodbye to every live peer; drain the nearest live rank below (see the notes)."""
        rank = self._backend.rank
        below = [(rank - k) % self._size for k in range(1, self._size)]
        live = [r for r in below if r not in gone]
        self._can_drain = bool(live)
        handles: list[Handle[None]] = []
        if live:  # the dead ranks' goodbyes come before this rank's own
            for dead in sorted(gone):
                handles.extend(self.send(live[0], proxy_bye(dead), []))
        handles.extend(super().goodbye(gone))
        if live:
            for _ in range(DEPTH - 1):
                handles.extend(self.send(live[0], DRAIN, []))
        return handles

    async def drained(self) -> None:
        if self._can_drain:  # else nobody is left to fill the receives still posted
            await asyncio.shield(self._drained)

    @property
    def listening(self) -> bool:
        """Return whether the listener is running (its receives may still be posted)."""
        return any(t.is_alive() for t in self._threads if t.name == "asyncomm-listener")

    @property
    def completing(self) -> bool:
        """Return whether the completer or sender runs (perhaps inside a gloo wait)."""
        return any(t.is_alive() for t in self._threads if t.name != "asyncomm-listener")

    def stop(self) -> None:
        """Stop the threads; a receive still posted stays posted (gloo cannot cancel it)."""
        if self._stopped:
            return
        self._stopped = True
        self._frames.put(None)
        self._sends.put(None)
        self._buffers.clear()

    async def join(self, timeout: float) -> None:
        """Join the threads off the loop, up to ``timeout`` in all.

        A listener that did not drain waits for a peer that never said
        goodbye (it died, or never closed): it is left, a daemon thread.
        """
        threads = [t for t in self._threads
                   if t.name != "asyncomm-listener" or self._drained.done()]
        if not any(t.is_alive() for t in threads):
            return
        deadline = time.monotonic() + timeout

        def join_all() -> None:
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))

        await self._loop.run_in_executor(None, join_all)

    def _post(self, buffer: bytes | bytearray | torch.Tensor, dst: int,
              tag: int) -> Handle[None] | None:
        tensor = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(
            buffer, dtype=torch.uint8)
        handle: Handle[None] = Handle(self._loop, (self._backend.rank, "send", None, dst, tag),
                                      None, tensor)
        if tag == tags.LINK_MESSAGE:  # small: eager (see the note on posting)
            if not SHORT and tensor.numel() < ENVELOPE_BYTES:
                tensor = torch.cat([tensor, tensor.new_zeros(ENVELOPE_BYTES - tensor.numel())])
            if self._data_out or self._expected or self._queued != self._posted:
                self._queued += 1
                self._sends.put((tensor, dst, tag, _Watched(self, dst)))
                handle._succeed(None)
                return handle
            try:  # (sent as it is: every link message is a buffer of its own, never written
                # again once it goes; the send's work holds it until gloo is done)
                self._endpoint.send_raw(handle, tensor, dst, tag, eager=True, copied=True)
            except RuntimeError as exc:  # gloo closed dst's connection: it died
                handle._fail(self._classify(exc), exc)
            except CommError as exc:
                handle._fail(type(exc), exc)
            return handle
        # Data messages are never eager: an eager data message behind its envelope
        # took ~7 ms to arrive (a 64 KiB channel round trip: 8 ms eager, 1 ms not).
        # The poster thread posts them after their envelope (see the note on posting).
        self._data_out += 1
        send = (tensor, dst, tag, handle)
        if dst in self._batches:
            self._behind_batch.setdefault(dst, []).append(send)
        else:
            self._sends.put(send)
        return handle

    def _send_batch(self, dst: int) -> None:
        super()._send_batch(dst)
        for send in self._behind_batch.pop(dst, ()):
            self._sends.put(send)

    def _seen_off(self, _: object) -> None:
        self._data_out -= 1

    def _failed_send(self, error: BaseException, _: object) -> None:
        self._data_out -= 1
        raise error

    # -- the poster and sender threads --------------------------------------------------

    def _post_sends(self) -> None:
        """Post the sends queued, in order, and hand each to the sender thread (until
        ``None``). It never waits for one: a link message is never held behind data."""
        while (item := self._sends.get()) is not None:
            tensor, dst, tag, sink = item
            try:
                self._posted_works.put((self._pg.send([tensor], dst, tag), sink))
            except RuntimeError as exc:  # gloo closed dst's connection: it died
                self._settle(sink, exc)
            if tag == tags.LINK_MESSAGE:
                self._posted += 1
        self._posted_works.put(None)

    def _see_off(self, work: Any, sink: _Sink) -> None:
        """Complete a data send's handle once gloo is done with it (sends in posting order);
        report a link message's failure."""
        self._settle(sink, _wait_all([work]))

    def _settle(self, sink: _Sink, error: RuntimeError | None) -> None:
        """On a thread: settle a data send's handle on the loop, or report a link message's
        failure (its handle counted it sent already)."""
        if isinstance(sink, Handle):
            self._inbox.put(sink, self._seen_off if error is None
                            else functools.partial(self._failed_send, error), None)
        elif error is not None:
            self._inbox.put(sink, functools.partial(_reraise, error), None)

    # -- the listener thread --------------------------------------------------------------

    def _listen(self) -> None:
        posted: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

        def post() -> None:
            envelope = torch.zeros(ENVELOPE_BYTES, dtype=torch.uint8)
            posted.append((envelope, self._pg.recv_anysource([envelope], tags.LINK_MESSAGE)))

        try:
            self._listen_posting(posted, post)
        except RuntimeError:
            return  # the group's connections are closed (see TorchBackend's note on teardown)
        self._on_loop(_settle, self._drained)

    def _listen_posting(self, posted: collections.deque[tuple[torch.Tensor, Any]],
                        post: Callable[[], None]) -> None:
        """Take messages as they come, re-posting until every peer's goodbye is in."""
        for _ in range(DEPTH):
            post()
        said: set[int] = set()  # who said goodbye (a live rank says it for a dead one)
        others = self._size - 1
        while posted:  # see the note on draining
            envelope, work = posted.popleft()
            work.wait()
            src = work._source_rank()
            view = memoryview(envelope.numpy().data)
            head_bytes, inline, follow, form = PREAMBLE.unpack_from(view, 0)
            head = view[_AT:_AT + head_bytes]
            if not follow and head == DRAIN:
                continue
            if len(said) < others:
                who = None if follow else bye_from(head, src)
                if who is not None:
                    said.add(who)
                if len(said) < others:
                    post()
            if not follow and head == PING:
                continue
            if form == BATCH and not head_bytes and not follow:
                self._follow_batch(src, view[_AT:_AT + inline])
            elif not follow:  # in one piece: parsed on the loop
                self._on_loop(self._arrive, src, envelope)
            elif head_bytes <= self._limits.max_head_bytes and not inline:
                self._follow(src, view, head_bytes, follow)
            else:
                self._refuse(src, ProtocolError(f"message from rank {src} declares a head "
                                                f"of {head_bytes} bytes, inline {inline}"))

    def _follow(self, src: int, view: memoryview, head_bytes: int, follow: int) -> None:
        """Post the data receives of a frame in pieces; queue it for the completer."""
        if head_bytes <= self.room:
            self._expect(src, [self._pend(src, view[_AT:_AT + head_bytes], follow)])
            return
        try:  # the head itself comes first, as a data message
            raw = torch.empty(head_bytes, dtype=torch.uint8)
            self._pg.recv([raw], src, tags.LINK_DATA).wait()
            head = wire.decode_head(raw.numpy().tobytes(), self._limits)
            self._check_follow(head, head_bytes, follow - 1)
        except (ProtocolError, RuntimeError) as exc:  # its data messages can't be skipped
            self._refuse(src, exc if isinstance(exc, ProtocolError)
                         else ProtocolError(f"frame head from rank {src} lost: {exc}"))
            return
        self._expect(src, [self._receive(src, head, head.seq)])

    def _follow_batch(self, src: int, view: memoryview) -> None:
        """Post the data receives of a batch's frames, in order (see ``Link.send``)."""
        frames: list[tuple[Pending, list[Any]] | ProtocolError] = []
        try:
            for raw, follow in envelopes(view, self.room):
                frames.append(self._pend(src, raw, follow))
                if isinstance(frames[-1], ProtocolError):
                    break
        except ProtocolError as exc:
            frames.append(ProtocolError(f"batch from rank {src}: {exc}"))
        self._expect(src, frames)

    def _pend(self, src: int, raw: memoryview, follow: int,
              ) -> tuple[Pending, list[Any]] | ProtocolError:
        """Post the data receives of a frame whose head is ``raw``."""
        try:  # (heads alike but for their seq are decoded once: a stream's are)
            head, seq = self._head(raw)
            self._check_follow(head, len(raw), follow)
        except ProtocolError as exc:  # its data messages can't be skipped
            return exc
        return self._receive(src, head, seq)

    def _receive(self, src: int, head: wire.Head, seq: int) -> tuple[Pending, list[Any]]:
        pending = Pending(head, self._allocate(head), seq)
        return pending, [self._pg.recv([b], src, tags.LINK_DATA) for b in pending.buffers]

    def _expect(self, src: int, frames: list[tuple[Pending, list[Any]] | ProtocolError]) -> None:
        """Tell the loop of ``frames`` (in order, up to a refusal); queue them for the completer."""
        arrivals = self._arrivals
        assert arrivals is not None

        coming = [frame for frame in frames if not isinstance(frame, ProtocolError)]

        def later() -> None:
            self._expected += len(coming)  # (a refused frame's data is never received)
            for frame in frames:
                if isinstance(frame, ProtocolError):
                    arrivals.refuse(src, frame, None)
                else:
                    arrivals.later(src, frame[0])

        self._inbox.put(_ON_LOOP, lambda _: later(), None)
        for frame in coming:
            self._frames.put(frame)

    def _refuse(self, src: int, error: ProtocolError) -> None:
        assert self._arrivals is not None
        self._on_loop(self._arrivals.refuse, src, error, None)

    # -- the completer thread ---------------------------------------------------------

    def _complete(self, pending: Pending, works: list[Any]) -> None:
        """Hand a frame to the loop once its data receives are done (frames in order)."""
        error = _wait_all(works)
        self._on_loop(self._received, pending, None if error is None
                      else CommError(f"data receive failed: {error}"))

    def _received(self, pending: Pending, error: CommError | None) -> None:
        self._expected -= 1
        if error is None:
            pending.whole()
        else:
            pending.fail(error)

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, after what was handed over before."""
        self._inbox.put(_ON_LOOP, lambda _: fn(*args), None)
