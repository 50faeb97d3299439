"""Links: how whole frames travel between the ranks of asyncomm's own communicator.

A ``Link`` carries frames (see ``wire``) for the channel router, in order per pair of
ranks, and hands each one that arrives to the router's ``Arrivals``. Backends choose the
link that suits them (``Backend.link``).

Note on the layout
------------------
A frame travels as one *message* on tag ``tags.LINK_MESSAGE``: a preamble (head bytes, frame bytes
inline, data messages following; see ``messages``), then the frame in one piece if it fits in the
link's ``room``. If not, the message holds only the head (or nothing, for a head beyond the room)
and the buffers follow as *data messages* on ``tags.LINK_DATA`` from the same source, in order: the
receiver posts their receives as soon as the message arrives, so frames from one source never mix.

Small frames (see ``small``) travel in *packets* (preamble form ``PACKET``, one msgpack array
decoded in one call). The first frame to a rank since the last ``flush`` goes at once, in a packet
of its own; those issued after it wait together in ``small.Outbox`` until the next ``flush``: when
the loop iteration ends, or a task begins to wait (no timer, so nothing waits for more than the rest
of the iteration). On links that batch (``batching``: gloo), the envelopes of large frames issued to
one rank within one iteration travel together as one *batch* (form ``BATCH``: each frame's preamble
and head), sent when the iteration ends or once the next does not fit in the room; their data
messages are issued at once, in order. (On MPI, data messages sent before their envelope would
arrive unexpected, and be copied twice.) A frame sent another way first sends its destination's
packet and batch, so frames leave in the order they were issued. The frame bytes are the same on
every link; only how a message is found differs. gloo's receives must know their size: every message
fits a fixed size, and a thread keeps any-source receives of that size posted (``gloo_link``). MPI
finds messages by matched probe, or in a receive kept posted (``mpi_link``).

Note on closing
---------------
A receive posted on gloo can be neither cancelled nor aborted, and tearing a process group
down under one kills the process. So links close collectively: each sends ``BYE`` to every
peer and stops receiving once every peer's ``BYE`` is in (``Arrivals.bye``). A peer known
to be gone (``probe``) never says goodbye, so a live rank says it for it: a *proxy* ``BYE``
naming the dead rank, sent before its own goodbye to the one rank it drains (see
``gloo_link``), so that every receiver counts a goodbye from every peer, live or dead.
"""

from __future__ import annotations

import asyncio
import collections
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncomm._core import small, tags, wire
from asyncomm._core.buffers import Buffers
from asyncomm._core.errors import CommClosedError, CommError, PeerFailedError, ProtocolError
from asyncomm._core.handle import FROM_BACKEND, Handle
from asyncomm._core.messages import (
    BATCH,
    PACKET,
    PREAMBLE,
    Pending,
    envelopes,
    frame_size,
    pack_frame,
    unpack_frame,
)
from asyncomm._core.polling import due_at
from asyncomm._core.small import DATA, Outbox
from asyncomm._core.wire import Head

_PREAMBLE_AT = PREAMBLE.unpack_from
_HEADS = 1024  # heads a link keeps decoded


BYE: bytes = wire.encode(wire.Kind.EOS, tags.BYE, 0, None)[0]  # a link's goodbye (see close)


def signal(tag: int) -> bytes:
    """Return the head of a link's signal ``tag`` (a drain, a ping): an empty EOS frame."""
    return wire.encode(wire.Kind.EOS, tag, 0, None)[0]


def proxy_bye(rank: int) -> bytes:
    """Return the goodbye a live rank says for the dead ``rank`` (see the note on closing)."""
    return wire.with_seq(BYE, rank + 1)


def bye_from(raw: bytes | memoryview, src: int) -> int | None:
    """Return who said goodbye if ``raw`` is a goodbye from ``src`` (or for a dead rank)."""
    if len(raw) != len(BYE) or wire.without_seq(bytes(raw)) != wire.without_seq(BYE):
        return None
    proxy = wire.seq_of(raw)
    return src if proxy == 0 else proxy - 1


class Arrivals(Protocol):
    """Where a link hands what it receives (the channel router)."""

    def frame(self, src: int, head: Head, buffers: list[torch.Tensor], seq: int) -> None:
        """A whole frame from ``src`` (``seq`` is its own: ``head`` may be a shared one)."""

    def packet(self, src: int, view: memoryview, at: int, end: int) -> None:
        """The small frames of a packet from ``src`` in ``view[at:end]`` (read it at once): a
        msgpack array (see ``small``), refused (``refuse``) from the first frame not whole."""

    def later(self, src: int, pending: Pending) -> None:
        """A frame from ``src`` whose buffers are on their way (it comes before later ones)."""

    def refuse(self, src: int, error: CommError, tag: int | None) -> None:
        """A malformed frame: on channel ``tag``, or (``None``) the end of ``src``'s stream."""

    def bye(self, src: int, dead: int | None = None) -> None:
        """``src`` closed its end of the link: nothing more comes from it (with ``dead``: it
        says that goodbye for ``dead``, which it found gone)."""

    def failed(self, peer: int, cause: BaseException) -> None:
        """``peer`` is gone (a probe of it failed)."""


class Transport(Protocol):
    """What a link needs of its backend: where it stands, and receives to post."""

    rank: int
    size: int

    def recv(self, sink: Any, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        """Issue a receive; the sink gets the source rank."""


class Link(ABC):
    """Frames between the ranks of one communicator; see the note on the layout."""

    def __init__(self, backend: Transport, loop: asyncio.AbstractEventLoop, room: int) -> None:
        self._backend = backend
        self._loop = loop
        self.room = room  # the most frame bytes a message carries inline
        self._arrivals: Arrivals | None = None
        self._limits = wire.Limits()
        self._held: dict[int, collections.deque[bytearray | torch.Tensor]] = {}
        self._heads: dict[bytes, Head] = {}
        self._buffers = Buffers()  # large frames' receive buffers, lent again once free
        # the body of a small frame: what fits a packet with a run's head, up to small.BYTES
        self.small_room = min(small.BYTES, room - small.RUN_HEAD.size - small.PACKET_HEAD_BYTES)
        # small frames queued, per destination (the most bytes of a packet: within ``room``)
        self._outbox = Outbox(PREAMBLE.size + room)
        self._batches: dict[int, bytearray] = {}  # large frames' envelopes, per destination
        self.batching = False  # whether large frames' envelopes go in batches (see the note)
        self._waiting = False  # whether frames wait (their flush in ``due``: see ``spin``)
        self._flush_asked = False  # whether the loop flushes at its iteration's end
        self._went: set[int] = set()  # destinations of packets sent since the last flush
        self._due = due_at(loop)

    def open(self, arrivals: Arrivals, limits: wire.Limits) -> None:
        """Start receiving: every frame that arrives goes to ``arrivals``."""
        self._arrivals, self._limits = arrivals, limits

    polls = False  # whether ``spin_until`` may find anything (links polled from the loop)

    def spin_until(self, done: Callable[[], bool]) -> bool:
        """A task is about to wait for ``done()``: poll for frames a while first (links that
        poll, see ``spin``); return whether ``done()`` became true."""
        return False

    def refused(self) -> bool:
        """Return whether the last ``spin_until`` was refused until the loop turns (its task
        yields that turn, then spins again)."""
        return False

    def expect(self) -> None:  # noqa: B027
        """A receiver waits: watch closely for a while (where the link polls)."""

    def probe(self, dst: int) -> BaseException | None:
        """Check that ``dst`` is still there; return why not, or ``None`` if it may be (always,
        where the link cannot tell: on MPI a dead rank ends the job). Only before this rank's
        goodbye (a probe is a message)."""
        return None

    def goodbye(self, gone: frozenset[int] = frozenset()) -> list[Handle[None]]:
        """Say goodbye to every peer but the dead ones, ``gone`` (see the note on closing);
        return the sends in flight."""
        handles: list[Handle[None]] = []
        for dst in range(self._backend.size):
            if dst != self._backend.rank and dst not in gone:
                handles.extend(self.send(dst, BYE, []))
        return handles

    async def drained(self) -> None:  # noqa: B027
        """Return once no receive of the link is posted (after every peer's goodbye), or
        once none can be filled any more (``lost``)."""

    def lost(self, peer: int, said_goodbye: bool) -> None:  # noqa: B027
        """``peer`` is gone (having said goodbye to this rank, or not): what the link waits
        for from it will not come."""

    @abstractmethod
    def stop(self) -> None:
        """Receive nothing more (every peer said goodbye, or the communicator closes)."""

    async def join(self, timeout: float) -> None:  # noqa: B027
        """Wait (up to ``timeout`` in all, off the loop) for the link's threads to end."""

    @abstractmethod
    def _post(self, buffer: bytes | bytearray | torch.Tensor, dst: int,
              tag: int) -> Handle[None] | None:
        """Send ``buffer``; return its handle, or ``None`` if it is done already."""

    def _allocate(self, head: Head) -> list[torch.Tensor]:
        """Return the buffers to receive a frame's into (see ``buffers``)."""
        return [self._buffers.take(d.nbytes) for d in head.descriptors]

    def _fetch(self, tensor: torch.Tensor, src: int | None, tag: int) -> Handle[int]:
        handle: Handle[int] = Handle(self._loop, (self._backend.rank, "recv", None, src, tag),
                                     FROM_BACKEND, tensor)
        self._backend.recv(handle, tensor, src, tag)
        return handle

    # -- sending -----------------------------------------------------------------------

    def send_small(self, dst: int, kind: int, tag: int, seq: int, body: bytes) -> None:
        """Send a small frame (``body`` at most ``small_room`` bytes) to ``dst``: the first since
        the last ``flush`` at once, so that a task that then blocks the loop has not left it
        behind; later ones queued until the next ``flush`` or until the packet is full. A
        failure to send a packet fails ``dst``."""
        if dst in self._went:
            self.queue_small(dst, kind, tag, seq, body)
            return
        self._went.add(dst)
        if not self._flush_asked:
            self._flush_asked = True
            self._loop.call_soon(self._flush_at_turn_end)
        if self._waiting and (self._outbox.queued(dst) or self._batches):
            # what waits for dst (credit, say) goes first, in the same packet where it is one
            self.queue_small(dst, kind, tag, seq, body)
            self._flush_to(dst)
        else:  # the commonest: nothing waits, a packet of its own laid out in one step
            self._send_packet(Outbox.alone(kind, tag, seq, body), dst)

    def queue_small(self, dst: int, kind: int, tag: int, seq: int, body: bytes) -> None:
        """Queue a small frame in ``dst``'s packet, never alone: it goes at the next ``flush``,
        or just before the next frame to ``dst`` that leaves at once, which it does not keep
        from leaving so (credit: see ``Delivery.took``, ``_messaging.mailbox``)."""
        queued = self._outbox.put(dst, kind, tag, seq, body)
        if queued and self._begun(dst, queued):
            self._outbox.put(dst, kind, tag, seq, body)

    def post(self, window: Any, dst: int, tag: int, obj: object, room: int,
             max_ndim: int, limit: int) -> bool:
        """Queue a channel's message through its ``window`` (see ``Channel.post``); return
        ``False`` (nothing queued) where the window is closed or full, a sender waits for
        credit, or ``obj`` is not a small message."""
        out = window.messages_out
        if not window.open or out >= limit or window.waiters:
            return False
        body = small.encode(obj, room, max_ndim)
        if body is None:
            return False
        self.send_small(dst, DATA, tag, window.seq, body)
        window.messages_out = out + 1
        window.seq += 1
        return True

    def _begun(self, dst: int, queued: int = 1) -> bool:
        """Something for ``dst`` began to wait (``queued``, as ``Outbox.put`` answers: 1 a
        packet or batch begun, -1 a full packet): it goes at the next ``flush``, when the
        iteration ends (once), or a task begins to wait (the loop's ``due`` list). Return
        whether the packet was full: it is sent now, and the caller queues its frame again."""
        if not self._flush_asked:
            self._flush_asked = True
            self._loop.call_soon(self._flush_at_turn_end)
        if not self._waiting:
            self._waiting = True
            self._due.append(self.flush)
        if queued < 0:
            self._flush_to(dst)
            return True
        return False

    def _flush_at_turn_end(self) -> None:
        self._flush_asked = False
        self.flush()

    def flush(self) -> None:
        """Send every batch and packet queued (the loop calls this once an iteration ends,
        a task about to wait before): the next packet for any rank leaves at once."""
        self._went.clear()
        if not self._waiting:  # nothing waits: whatever is queued set it (``_begun``)
            return
        self._waiting = False
        try:
            self._due.remove(self.flush)
        except ValueError:  # (a spinning task took it off the list to call it)
            pass
        while self._batches:
            self._send_batch(next(iter(self._batches)))
        for dst in self._outbox.dsts():
            self._flush_to(dst)

    def _flush_to(self, dst: int) -> None:
        if self._batches:  # a batch pending beside a packet holds older frames
            self._send_batch(dst)
        packet = self._outbox.take(dst)
        if packet is not None:
            self._send_packet(packet, dst)

    def _send_packet(self, packet: bytearray, dst: int) -> None:
        handle = self._post(packet, dst, tags.LINK_MESSAGE)
        if handle is not None:
            handle.add_done_callback(self._packet_sent)

    def _packet_sent(self, handle: Handle[None]) -> None:
        try:
            handle.result()
        except PeerFailedError as exc:
            if self._arrivals is not None and handle.peer is not None:
                self._arrivals.failed(handle.peer, exc)
        except CommClosedError:
            pass  # the communicator closed: so did its channels
        except CommError as exc:
            self._loop.call_exception_handler({
                "message": f"asyncomm: messages to rank {handle.peer} were lost",
                "exception": exc})

    def send(self, dst: int, head: bytes, buffers: list[torch.Tensor]) -> list[Handle[None]]:
        """Issue a frame (``buffers`` flat uint8); return the handles still in flight. A large
        frame's envelope may wait for the iteration's others in a batch (see the note on the
        layout); its data messages are issued at once."""
        if self._outbox.queued(dst):  # what was issued before goes first
            self._flush_to(dst)
        at = PREAMBLE.size
        size = frame_size(len(head), [b.numel() for b in buffers])
        inline = size <= self.room
        if not inline and self.batching and len(head) <= self.room - at:
            self._enclose(dst, head, len(buffers))
            sent = [self._post(b, dst, tags.LINK_DATA) for b in buffers]
            return [h for h in sent if h is not None]
        if self._batches:
            self._send_batch(dst)
        follow = 0 if inline else len(buffers) + (len(head) > self.room)
        body = size if inline else len(head) if follow == len(buffers) else 0
        message = bytearray(at + body)
        PREAMBLE.pack_into(message, 0, len(head), size if inline else 0, follow, 0)
        if inline:
            pack_frame(head, buffers, memoryview(message)[at:at + size])
        elif follow == len(buffers):
            message[at:at + len(head)] = head
        posted = [self._post(message, dst, tags.LINK_MESSAGE)]
        if follow > len(buffers):
            posted.append(self._post(torch.frombuffer(bytearray(head), dtype=torch.uint8),
                                     dst, tags.LINK_DATA))
        if not inline:
            posted.extend(self._post(b, dst, tags.LINK_DATA) for b in buffers)
        return [h for h in posted if h is not None]

    def _enclose(self, dst: int, head: bytes, follow: int) -> None:
        """Add a large frame's envelope to ``dst``'s batch, sent when the iteration ends."""
        batch = self._batches.get(dst)
        if batch is not None and len(batch) + len(head) > self.room:
            self._send_batch(dst)
            batch = None
        if batch is None:
            batch = self._batches[dst] = bytearray(PREAMBLE.size)  # laid when it goes
            self._begun(dst)
        batch += PREAMBLE.pack(len(head), 0, follow, 0)
        batch += head

    def _send_batch(self, dst: int) -> None:
        batch = self._batches.pop(dst, None)
        if batch is None:
            return
        PREAMBLE.pack_into(batch, 0, 0, len(batch) - PREAMBLE.size, 0, BATCH)
        self._send_packet(batch, dst)

    # -- receiving ---------------------------------------------------------------------

    def _arrive(self, src: int, message: bytearray | torch.Tensor) -> bool:
        """Take one message from ``src`` (perhaps padded), in its order; return whether it was
        a packet of small frames, delivered (a link that polls stops there: see ``mpi_link``)."""
        arrivals = self._arrivals
        assert arrivals is not None
        if self._held and src in self._held:  # a big head from src is on its way: keep order
            self._held[src].append(message)
            return False
        at = PREAMBLE.size
        view = memoryview(message if isinstance(message, bytearray) else message.numpy().data)
        if len(view) < at:
            arrivals.refuse(src, ProtocolError(f"message of {len(view)} bytes from rank {src}"),
                            None)
            return False
        head_bytes, inline, follow, form = _PREAMBLE_AT(view, 0)
        end = at + inline
        if form == PACKET and not head_bytes and not follow and end <= len(view):
            arrivals.packet(src, view, at, end)
            return True
        if form == BATCH and not head_bytes and not follow and end <= len(view):
            self._batch(src, view[at:end])
            return False
        if (form or head_bytes > self._limits.max_head_bytes
                or inline > len(view) - at):
            arrivals.refuse(src, ProtocolError(f"message from rank {src} declares a head of "
                                               f"{head_bytes} bytes, inline {inline}"), None)
            return False
        if head_bytes > self.room:  # the head follows as a data message: hold src's later ones
            if inline or not follow:
                arrivals.refuse(src, ProtocolError(f"message from rank {src} declares a head "
                                                   f"of {head_bytes} bytes inline"), None)
                return False
            self._big_head(src, head_bytes, follow - 1)
            return False
        raw = view[at:at + head_bytes]
        who = bye_from(raw, src) if not follow else None
        if who is not None:
            arrivals.bye(src, None if who == src else who)
            return False
        try:
            head, seq = self._head(raw)
            if inline:
                if follow:
                    raise ProtocolError("a frame inline with data messages following")
                buffers = unpack_frame(view[at:at + inline], head_bytes, head)
            else:
                self._check_follow(head, head_bytes, follow)
        except ProtocolError as exc:  # its data messages cannot be skipped safely
            arrivals.refuse(src, exc, None if follow else wire.legible_tag(raw))
            return False
        if inline:
            arrivals.frame(src, head, buffers, seq)
        else:
            arrivals.later(src, self._data(src, head, seq))
        return False

    def _batch(self, src: int, view: memoryview) -> None:
        """Post the data receives of a batch's frames, in order (see ``send``)."""
        arrivals = self._arrivals
        assert arrivals is not None
        try:
            for raw, follow in envelopes(view, self.room):
                head, seq = self._head(raw)
                self._check_follow(head, len(raw), follow)
                arrivals.later(src, self._data(src, head, seq))
        except ProtocolError as exc:  # the data messages that follow cannot be skipped
            arrivals.refuse(src, ProtocolError(f"batch from rank {src}: {exc}"), None)

    def _head(self, raw: memoryview) -> tuple[Head, int]:
        """Decode a head; return it and its seq.

        Heads with buffers that differ only in their seq (a stream of tensors of one shape)
        are decoded once: the cache maps the head's bytes but the seq to the ``Head`` decoded
        first. (A listener thread calls this too: each cache operation is atomic under the GIL.)
        """
        data = raw.tobytes()
        key = wire.without_seq(data)
        head = self._heads.get(key)
        if head is None:
            head = wire.decode_head(data, self._limits)
            if head.descriptors:  # shapes repeat; structures of plain messages rarely do
                if len(self._heads) >= _HEADS:
                    self._heads.clear()
                self._heads[key] = head
        return head, wire.seq_of(data)

    def _check_follow(self, head: Head, head_bytes: int, follow: int) -> None:
        if follow != len(head.descriptors):
            raise ProtocolError("data message count does not match the head")
        if frame_size(head_bytes, [d.nbytes for d in head.descriptors]) <= self.room:
            raise ProtocolError("a frame that fits its message came in pieces")

    def _data(self, src: int, head: Head, seq: int) -> Pending:
        """Post a frame's data receives now, in order; return the frame they complete."""
        pending = Pending(head, self._allocate(head), seq)
        for b in pending.buffers:
            self._fetch_into(pending, b, src)
        return pending

    def _fetch_into(self, pending: Pending, tensor: torch.Tensor, src: int) -> None:
        """Receive ``tensor``, one of ``pending``'s buffers, from ``src``."""
        self._fetch(tensor, src, tags.LINK_DATA).add_done_callback(pending.received)

    def _big_head(self, src: int, head_bytes: int, follow: int) -> None:
        """Fetch a head that came as a data message; meanwhile hold ``src``'s later messages."""
        assert self._arrivals is not None
        raw_head = torch.empty(head_bytes, dtype=torch.uint8)
        self._held[src] = collections.deque()
        pending = Pending(None, [], 0)
        self._arrivals.later(src, pending)

        def fetched(handle: Handle[int]) -> None:
            try:
                handle.result()
                head = wire.decode_head(raw_head.numpy().tobytes(), self._limits)
                self._check_follow(head, head_bytes, follow)
            except CommError as exc:
                pending.fail(exc)
            else:
                pending.follow(self._data(src, head, head.seq))
            for message in self._held.pop(src, ()):  # now the later ones, in order
                self._arrive(src, message)

        self._fetch(raw_head, src, tags.LINK_DATA).add_done_callback(fetched)
