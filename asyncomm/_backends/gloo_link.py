"""The link of torch backends: channel frames over gloo, their data over asyncomm's own lane.

Note on threads
---------------
gloo's receives must know their size and complete only inside a blocking ``wait()``. So a
*listener* thread keeps ``DEPTH`` any-source receives of ``ENVELOPE_BYTES`` link messages
posted, and when one announces a large frame, asks the data lane (``gloo_lane``) for that
frame's bytes at once, in order; the lane's reader hands each whole frame to the loop
through the backend's inbox. The loop posts link messages itself (eager sends: a round trip
of small messages takes no thread hand-off), parses those that came in one piece, and gives
data to the lane's writers, which never wait on the loop. The listener posts no receive
after the last peer's goodbye (see the note on closing in ``_core.link``).

Note on the data lane
---------------------
Large frames' bytes travel on connections of asyncomm's own, not through gloo's pairs (see
``gloo_lane``'s note on why). That also keeps the loop out of gloo's pair lock: a pair's I/O
thread holds it while it moves a message, and a send posted meanwhile waits (a credit frame
sent during a stream would wait out whole data messages); with no data on the pairs, a link
message waits for nothing but other link messages. A data message needs no order against
its envelope (see ``gloo_lane``'s note on order and matching).

Note on batches and message sizes
---------------------------------
The envelopes of large frames travel in batches (see the note on the layout in ``_core.link``): on
gloo a batch spares every frame but its first an eager send, a listener's wake-up and a receive
re-posted, on both ranks. The listener asks for the data of a batch's frames in order and tells the
loop of them in one hand-off. On Linux, link messages are as long as what they hold; elsewhere they
are padded to ``ENVELOPE_BYTES`` (see ``gloo_p2p``'s note on sizes).

Note on draining
----------------
One posted receive at a time puts a listener's reaction between any two messages; with
``DEPTH`` posted, messages flow while it works. But no receive may stay posted when the
group goes, and gloo cannot cancel one. So the listener re-posts after every message until
the last peer's goodbye, except after a DRAIN message, and each rank sends ``DEPTH - 1``
DRAINs to rank ``rank - 1`` after its goodbyes: the receives still posted once every goodbye
is in are exactly the ones the DRAINs fill.

Note on dead peers
------------------
gloo fails an operation on a connection that closed (its peer died), but not an any-source receive,
which belongs to no connection: the listener never learns of a death. Except in two ways, both when
a peer dies while sending to this rank. The receive its message was being read into fails, alone: it
is replaced and the listener goes on. And a message it had announced with no receive posted yet
stays announced: gloo then tries every later any-source receive on the dead connection first, and
fails to post it. The rank can hear no one on this group any more; every peer's stream ends with
that reason (``_deaf``), and a shrink makes new groups (that needs no listener: the survivors agree
through the store). ``probe`` sends the peer a PING message, which the listener drops; if the peer
is gone, the send fails at once (gloo closed its connection when the socket did). A frame whose data
a dead peer never wrote fails when the lane's connection closes. A dead rank drains no one and says
no goodbye, so each rank drains the nearest *live* rank below it and first says the dead ranks'
goodbyes to it (proxy ``BYE``s, see ``_core.link``): the count above holds as long as the live ranks
agree on who is dead (they probe everyone just before saying goodbye). A rank left with no live peer
cannot be drained: its listener stays blocked in its receive (a daemon thread) until the process
exits.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncomm._backends import gloo_p2p
from asyncomm._backends.gloo_lane import Lane
from asyncomm._core import tags, wire
from asyncomm._core.backend import nothing
from asyncomm._core.errors import CommError, PeerFailedError, ProtocolError, gist
from asyncomm._core.handle import Classify, Handle, reraise
from asyncomm._core.link import Arrivals, Link, Transport, bye_from, proxy_bye, signal
from asyncomm._core.messages import BATCH, PREAMBLE, Pending, envelopes
from asyncomm._core.progress import Inbox, Waiters

SHORT = gloo_p2p.SHORT  # a message may be shorter than its receive (see gloo_p2p's note)
# the most bytes of a link message on gloo (its receives' size; padded to it where not SHORT)
ENVELOPE_BYTES = (16 if SHORT else 4) << 10
DEPTH = 8  # any-source receives the listener keeps posted
DRAIN: bytes = signal(tags.DRAIN)  # see the note on draining
PING: bytes = signal(tags.PING)  # see the note on dead peers
_AT = PREAMBLE.size


class Endpoint(Transport, Protocol):
    """What the gloo link needs of its backend beyond receives: its eager sends."""

    def send_raw(self, sink: Any, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Issue a send of ``tensor``'s bytes, a buffer never written again (eager)."""


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


class _Pinged:
    """The sink of a PING: a failure says the peer is gone."""

    def __init__(self, link: GlooLink, dst: int) -> None:
        self._link, self._dst = link, dst

    def _succeed(self, value: object) -> None:
        self._link._pinging.discard(self._dst)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        self._succeed(None)
        if issubclass(kind, PeerFailedError) and self._link._arrivals is not None:
            self._link._arrivals.failed(self._dst, cause)

    _abandon = _fail


def _later(head: wire.Head, seq: int) -> Pending:
    """A frame whose buffers are taken as its data is next on the lane (see its note on
    memory), not as its envelope comes."""
    return Pending(head, [], seq, left=1)


class GlooLink(Link):
    """Link messages of ``ENVELOPE_BYTES`` on gloo, data on a lane (see the note on threads)."""

    def __init__(self, backend: Endpoint, pg: Any, loop: asyncio.AbstractEventLoop, inbox: Inbox,
                 waiters: Waiters, classify: Classify, lane: Callable[[], Lane]) -> None:
        super().__init__(backend, loop, ENVELOPE_BYTES - _AT)
        self._endpoint = backend
        self._pg = pg
        self._inbox = inbox
        self._waiters = waiters
        self._classify = classify
        self._make_lane = lane
        self._lane: Lane | None = None  # made as the link opens
        self._listener: threading.Thread | None = None
        self._stopped = False
        self._drained = loop.create_future()  # the listener has nothing posted
        ping = bytearray(_AT + len(PING) if SHORT else ENVELOPE_BYTES)
        PREAMBLE.pack_into(ping, 0, len(PING), len(PING), 0, 0)
        ping[_AT:_AT + len(PING)] = PING
        self._ping = torch.frombuffer(ping, dtype=torch.uint8)  # only read: every probe sends it
        # as goodbye found them: the live ranks that drain this one and that this one drains
        # (None: no live peer is left to drain this rank)
        self._drainer: int | None = None
        self._drains: int | None = None
        self._undrainable = loop.create_future()  # done if the drainer died first
        self._pinging: set[int] = set()  # peers with a PING in flight
        self.batching = True  # see the note on batches

    def open(self, arrivals: Arrivals, limits: wire.Limits) -> None:
        super().open(arrivals, limits)
        self._lane = self._make_lane()
        self._listener = threading.Thread(target=self._listen, name="asyncomm-listener",
                                          daemon=True)
        self._listener.start()

    def probe(self, dst: int) -> BaseException | None:
        """Send ``dst`` a PING; a send to a dead peer fails at once (see the note). A peer
        whose data lane broke is gone, though a PING to it may still be written.

        At most one PING per peer is in flight: one to a stalled peer waits (on a waiter
        thread, so other peers' sends go on) and reports a death if the peer dies meanwhile.
        """
        lost = None if self._lane is None else self._lane.lost.get(dst)
        if lost is not None:
            return lost
        if dst in self._pinging or self._pg is None:  # (None: closed, see ``let_go``)
            return None
        try:
            work = self._pg.send([self._ping], dst, tags.LINK_MESSAGE)
        except RuntimeError as exc:
            return exc
        self._pinging.add(dst)
        self._waiters.watch(work.wait, _Pinged(self, dst), nothing)
        return None

    def goodbye(self, gone: frozenset[int] = frozenset()) -> list[Handle[None]]:
        """Say goodbye to every live peer; drain the nearest live rank below (see the notes)."""
        rank, size = self._backend.rank, self._backend.size
        below = [(rank - k) % size for k in range(1, size)]
        live = [r for r in below if r not in gone]
        self._drainer = live[-1] if live else None  # (the nearest live rank above)
        self._drains = live[0] if live else None
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
        if self._drains is not None:  # else nobody is left to fill the receives still posted
            await asyncio.wait([self._drained, self._undrainable],
                               return_when=asyncio.FIRST_COMPLETED)

    def lost(self, peer: int, said_goodbye: bool) -> None:
        """A peer died after this rank's goodbye (see the note on dead peers). One that said
        its goodbye here said it everywhere and sent its DRAINs with it (one ``goodbye``):
        nothing is missing. Else, if it was to drain this rank, this rank's listener is
        left parked, as where no live peer is left; and the rank this one drains is told
        that its goodbye will not come."""
        if said_goodbye or self._drains is None or self._stopped:
            return
        if peer == self._drainer and not self._undrainable.done():
            self._undrainable.set_result(None)
        if peer != self._drains:
            self.send(self._drains, proxy_bye(peer), [])

    @property
    def listening(self) -> bool:
        """Return whether the listener is running (its receives may still be posted)."""
        return self._listener is not None and self._listener.is_alive()

    def stop(self) -> None:
        """Take no more data (the lane's threads end once done with what they were given);
        a receive still posted stays posted (gloo cannot cancel it)."""
        if self._stopped:
            return
        self._stopped = True
        if self._lane is not None:
            self._lane.close()
        self._buffers.clear()

    async def join(self, timeout: float) -> None:
        """Join the lane's threads, and the listener once it drained, off the loop, up to
        ``timeout`` in all. A listener that did not drain waits for a peer that never said
        goodbye (it died, or never closed): it is left, a daemon thread."""
        deadline = time.monotonic() + timeout
        lane, listener = self._lane, self._listener
        if not self._drained.done():
            listener = None

        def join_all() -> None:
            if lane is not None:
                lane.join(timeout)
            if listener is not None:
                listener.join(max(0.0, deadline - time.monotonic()))

        await self._loop.run_in_executor(None, join_all)

    def _post(self, buffer: bytes | bytearray | torch.Tensor, dst: int,
              tag: int) -> Handle[None] | None:
        tensor = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(
            buffer, dtype=torch.uint8)
        handle: Handle[None] = Handle(self._loop, (self._backend.rank, "send", None, dst, tag),
                                      None, tensor)
        if tag == tags.LINK_DATA:  # on the lane: done once written (or, read directly, taken)
            assert self._lane is not None
            self._lane.send(dst, tensor, functools.partial(self._written, handle))
            return handle
        if not SHORT and tensor.numel() < ENVELOPE_BYTES:
            tensor = torch.cat([tensor, tensor.new_zeros(ENVELOPE_BYTES - tensor.numel())])
        try:  # eager (sent as it is: every link message is a buffer of its own, never
            # written again once it goes; the send's work holds it until gloo is done)
            self._endpoint.send_raw(handle, tensor, dst, tag)
        except (RuntimeError, CommError) as exc:  # RuntimeError: gloo closed dst's connection
            handle._fail(self._classify(exc), exc)  # (it died); a CommError keeps its class
        return handle

    def _written(self, handle: Handle[None], error: PeerFailedError | None) -> None:
        """On a lane thread (its writer, or the one hearing its reader took the bytes):
        settle a data message's handle on the loop."""
        self._inbox.put(handle, nothing if error is None
                        else functools.partial(reraise, error), None)

    # -- the listener thread --------------------------------------------------------------

    def let_go(self) -> None:
        """Hold the group no longer (its backend destroyed it); a listener that still runs
        holds it until it ends."""
        self._pg = None

    def _listen(self) -> None:
        posted: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        pg = self._pg

        def post() -> None:
            envelope = torch.zeros(ENVELOPE_BYTES, dtype=torch.uint8)
            posted.append((envelope, pg.recv_anysource([envelope], tags.LINK_MESSAGE)))

        try:
            self._listen_posting(posted, post)
        except RuntimeError as exc:  # the group's connections are closed (see TorchBackend's
            if not self._stopped:  # note on teardown), or gloo refuses receives (the note
                self._deaf(exc)  # on dead peers)
            return
        self._on_loop(self._drained.set_result, None)  # (set only here, once)

    def _listen_posting(self, posted: collections.deque[tuple[torch.Tensor, Any]],
                        post: Callable[[], None]) -> None:
        """Take messages as they come, re-posting until every peer's goodbye is in."""
        for _ in range(DEPTH):
            post()
        said: set[int] = set()  # who said goodbye (a live rank says it for a dead one)
        others = self._backend.size - 1
        while posted:  # see the note on draining
            envelope, work = posted.popleft()
            try:
                work.wait()
            except RuntimeError:
                if self._stopped:
                    raise
                if len(said) < others:  # a dying peer's message (see the note on dead peers)
                    post()
                continue
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

    def _deaf(self, cause: RuntimeError) -> None:
        """No receive can be posted any more: end every peer's stream with the reason."""
        assert self._arrivals is not None
        rank = self._backend.rank
        error = PeerFailedError(
            f"rank {rank} can hear no one on this communicator any more: gloo refuses its "
            f"receives since a peer died while sending to it ({gist(cause)}); comm.shrink() "
            "makes a communicator of the survivors")
        for src in range(self._backend.size):
            if src != rank:
                self._on_loop(self._arrivals.refuse, src, error, None)

    def _follow(self, src: int, view: memoryview, head_bytes: int, follow: int) -> None:
        """Ask the lane for a frame's data; tell the loop of it."""
        if head_bytes <= self.room:
            self._expect(src, [self._pend(src, view[_AT:_AT + head_bytes], follow)])
            return
        raw = torch.empty(head_bytes, dtype=torch.uint8)  # the head itself comes first
        failure = self._read_now(src, raw)
        try:
            if failure is not None:
                raise failure
            head = wire.decode_head(raw.numpy().tobytes(), self._limits)
            self._check_follow(head, head_bytes, follow - 1)
        except (ProtocolError, CommError) as exc:  # its data messages can't be skipped
            self._refuse(src, exc if isinstance(exc, ProtocolError)
                         else ProtocolError(f"frame head from rank {src} lost: {exc}"))
            return
        self._expect(src, [_later(head, head.seq)])

    def _read_now(self, src: int, raw: torch.Tensor) -> PeerFailedError | None:
        """Read ``src``'s next bytes into ``raw``, waiting for them; return a failure."""
        assert self._lane is not None
        read: concurrent.futures.Future[PeerFailedError | None] = concurrent.futures.Future()
        self._lane.recv(src, lambda: [raw], read.set_result)
        return read.result()

    def _follow_batch(self, src: int, view: memoryview) -> None:
        """Ask for the data of a batch's frames, in order (see ``Link.send``)."""
        frames: list[Pending | ProtocolError] = []
        try:
            for raw, follow in envelopes(view, self.room):
                frames.append(self._pend(src, raw, follow))
                if isinstance(frames[-1], ProtocolError):
                    break
        except ProtocolError as exc:
            frames.append(ProtocolError(f"batch from rank {src}: {exc}"))
        self._expect(src, frames)

    def _pend(self, src: int, raw: memoryview, follow: int) -> Pending | ProtocolError:
        """The frame whose head is ``raw``, its buffers allocated."""
        try:  # (heads alike but for their seq are decoded once: a stream's are)
            head, seq = self._head(raw)
            self._check_follow(head, len(raw), follow)
        except ProtocolError as exc:  # its data messages can't be skipped
            return exc
        return _later(head, seq)

    def _expect(self, src: int, frames: list[Pending | ProtocolError]) -> None:
        """Tell the loop of ``frames`` (in order, up to a refusal); ask the lane for their data."""
        arrivals = self._arrivals
        lane = self._lane
        assert arrivals is not None and lane is not None

        def later() -> None:
            for frame in frames:
                if isinstance(frame, ProtocolError):
                    arrivals.refuse(src, frame, None)
                else:
                    arrivals.later(src, frame)

        self._on_loop(later)  # before any frame is whole
        for frame in frames:
            if not isinstance(frame, ProtocolError):  # (a refused frame's data is never read)
                lane.recv(src, functools.partial(self._take, frame),
                          functools.partial(self._on_loop, self._received, frame))

    def _take(self, pending: Pending) -> list[torch.Tensor]:
        """On a lane reader, as a frame's data is next: its buffers (see ``_later``)."""
        assert pending.head is not None
        pending.buffers = self._allocate(pending.head)
        return pending.buffers

    def _refuse(self, src: int, error: ProtocolError) -> None:
        assert self._arrivals is not None
        self._on_loop(self._arrivals.refuse, src, error, None)

    @staticmethod
    def _received(pending: Pending, error: PeerFailedError | None) -> None:
        if error is None:
            pending.whole()
        else:
            pending.fail(error)

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, after what was handed over before."""
        self._inbox.put(_ON_LOOP, lambda _: fn(*args), None)
