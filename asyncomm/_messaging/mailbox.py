"""Mailboxes: the messages of one channel as they arrive, the receivers waiting for them,
and the delivery of arriving frames into them.

A mailbox keeps what arrived in order: a small message as the ``Message`` its receiver gets
(decoded once, on arrival), anything else as a ``Frame``. A receiver waiting for a source is
woken when something from it arrives and takes it then: nothing is handed to a receiver
that may yet be cancelled, so a cancelled ``recv`` loses nothing. A mailbox also counts,
per source, the sequence number due next and what its user took (the credit to return).

``Delivery`` is the router's receive side (the link's ``Arrivals``): it keeps each frame in
its channel's mailbox, checked: sequence numbers per (source, channel), malformed frames
refused on their channel (or, where the channel cannot be told, the source's stream
broken), and frames whose buffers are still on their way holding back their source's
later ones. A packet of small frames is decoded in one call (see ``Delivery.packet``), with
no object or call per frame on the commonest paths (a run of a channel's messages, checked
once and kept in one step; the channel's next message alone). As its user takes messages,
it returns their credit to their senders in batches (``took``; the router's note on flow
control says why).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from asyncomm._core import small, wire
from asyncomm._core.errors import CommError, PeerFailedError, ProtocolError
from asyncomm._core.link import Link
from asyncomm._core.messages import Pending
from asyncomm._core.wire import Head, Kind


class Message(NamedTuple):
    """A received message: who sent it, on which channel, and what."""

    src: int
    tag: int
    data: Any


_new: Any = tuple.__new__  # ``_new(Message, (src, tag, data))``: cheaper than ``Message(...)``


# A message ready to send: a small frame's body (see ``small``), or a frame's head and buffers.
# A small frame holds no bytes of its window (see the note on flow control in ``router``).
Encoded = bytes | tuple[bytes, list[torch.Tensor]]


class Frame:
    """A frame that arrived whole (``head`` and ``buffers``), or refused (``error``)."""

    __slots__ = ("buffers", "charge", "error", "head", "kind", "seq", "src", "tag")

    def __init__(self, src: int, kind: int, tag: int, seq: int, head: Head | None,
                 buffers: list[torch.Tensor], charge: int,
                 error: CommError | None = None) -> None:
        self.src, self.kind, self.tag, self.seq = src, kind, tag, seq
        self.head = head  # perhaps shared by frames alike: ``seq`` is its own
        self.buffers = buffers
        self.charge = charge  # the bytes it holds of its window (-1: none, it was refused)
        self.error = error  # a frame refused on arrival: raised by recv

    @classmethod
    def whole(cls, src: int, head: Head, buffers: list[torch.Tensor], seq: int) -> Frame:
        # the bytes it holds of its window (as ``charge`` counts)
        return cls(src, head.kind, head.tag, seq, head, buffers,
                   max(0, head.size + head.payload_bytes - small.BYTES))

    @classmethod
    def refused(cls, src: int, tag: int, error: CommError, seq: int = 0,
                charge: int = -1) -> Frame:
        """A frame refused on arrival: its receiver gets ``error`` (``charge``: its credit)."""
        return cls(src, Kind.DATA, tag, seq, None, [], charge, error)


Waiter = tuple[int | None, "asyncio.Future[None]"]  # a receiver: the source it wants
Entry = Message | Frame  # what a mailbox keeps: a small message, or a frame


class Mailbox:
    """Messages of one channel in arrival order, who waits for them, who has closed their end.

    With a ``listener``, every good message is handed to it on arrival instead (actors').
    """

    __slots__ = ("ended", "frames", "listener", "seqs", "taken", "waiters")

    def __init__(self) -> None:
        self.frames: collections.deque[Entry] = collections.deque()
        self.ended: set[int] = set()
        self.waiters: list[Waiter] = []
        self.listener: Callable[[Entry], None] | None = None
        self.seqs: dict[int, int] = {}  # per source, the sequence number due next
        self.taken: dict[int, list[int]] = {}  # per source, messages and bytes taken, uncredited

    def put(self, entry: Entry) -> None:
        """Keep ``entry`` (or hand it to the listener); wake a receiver waiting for it."""
        if self.listener is not None and (type(entry) is Message
                                          or entry.error is None):  # type: ignore[union-attr]
            self.listener(entry)
            return
        self.frames.append(entry)
        if self.waiters:
            self.came(entry.src)

    def came(self, src: int) -> None:
        """Something from ``src`` was kept: wake the first receiver waiting for it."""
        for i, (wants, waiter) in enumerate(self.waiters):
            if (wants is None or wants == src) and not waiter.done():
                del self.waiters[i]
                waiter.set_result(None)
                return

    def wake(self) -> None:
        """Wake every receiver: something else happened, let them look."""
        for _, waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    def has_frames(self) -> bool:
        return bool(self.frames)

    def has(self, src: int) -> bool:
        """Return whether something from ``src`` is here."""
        frames = self.frames
        if not frames:
            return False
        if frames[0].src == src:  # (a waiting recv asks this again and again)
            return True
        return any(entry.src == src for entry in frames)

    def take(self, src: int | None) -> Entry | None:
        """Pop the first entry (from ``src``, if given), or return ``None``."""
        frames = self.frames
        if not frames:
            return None
        if src is None or frames[0].src == src:
            return frames.popleft()
        for i, entry in enumerate(frames):
            if entry.src == src:
                del frames[i]
                return entry
        return None


DATA = Kind.DATA.value  # an int: compared on every message


def size_of(frame: Encoded) -> int:
    """Return the bytes of an encoded message: its head and buffers."""
    if isinstance(frame, bytes):
        return len(frame)
    head, buffers = frame
    nbytes = len(head)
    for b in buffers:
        nbytes += b.numel()  # flat uint8
    return nbytes


def charge(frame: Encoded) -> int:
    """Return the bytes a message holds of its window, as its receiver counts (``Frame.whole``):
    its first ``small.BYTES`` are free, as all a small message's are (see ``router``)."""
    return 0 if isinstance(frame, bytes) else max(0, size_of(frame) - small.BYTES)


def wake(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


RUN = small.RUN


@functools.lru_cache(maxsize=64)
def _credit_body(messages: int, nbytes: int) -> bytes:
    """Return the body of a credit frame (a batch of small messages: the same, kept)."""
    body = small.encode([messages, nbytes])
    assert body is not None
    return body


class Delivery:
    """Frames that arrive, into the mailboxes of their channels (the router's receive side)."""

    def __init__(self, rank: int, limits: wire.Limits, link: Link, window: int,
                 window_bytes: int) -> None:
        self.rank = rank
        self.limits = limits
        self.link = link  # (channels send their small frames straight to it)
        # credit goes back in batches (see ``took``, and the router's note on flow control):
        # smaller ones would cost the sender more credit frames, each a packet of its own
        self.batch, self._batch_bytes = max(1, window // 2), window_bytes // 4
        self.closed = False  # set by ``Router.close``; channels read it
        self.dead: dict[int, BaseException] = {}  # peers known gone, and how we know
        self._mailboxes: dict[int, Mailbox] = {}
        # frames of a source queued behind one whose buffers are on their way (a small
        # frame as its tag, seq and message)
        self._queued: dict[int, collections.deque[Frame | Pending | tuple[int, int, object]]] = {}
        self._broken: dict[int, CommError] = {}  # sources whose stream cannot be followed

    def mailbox(self, tag: int) -> Mailbox:
        box = self._mailboxes.get(tag)
        if box is None:
            box = self._mailboxes[tag] = Mailbox()
        return box

    def frame(self, src: int, head: Head, buffers: list[torch.Tensor], seq: int) -> None:
        """A whole frame from ``src`` (the link calls this, in the order frames arrive)."""
        if src not in self._broken:
            frame = Frame.whole(src, head, buffers, seq)
            queue = self._queued.get(src)
            if queue is None:
                self._deliver(frame)  # the common case: nothing from src is on its way
            else:
                queue.append(frame)

    def packet(self, src: int, view: memoryview, at: int, end: int) -> None:
        """The small frames of a packet from ``src`` (the link calls this, in arrival order).

        The hot path of every small message: the packet decoded in one call, each message
        kept in its mailbox as the ``Message`` its receiver gets (or handed to the mailbox's
        listener). A packet that does not decode as a whole is taken apart frame by frame
        (``_packet_slowly``), so a malformed message fails its own channel only.
        """
        try:
            items = small.unpack_packet(view[at:end], self.limits)
        except ProtocolError:
            self._packet_slowly(src, view[at:end])
            return
        self.items(src, items)

    def items(self, src: int, items: list[Any]) -> None:
        """The small frames of a packet from ``src``, decoded (``small.unpack_packet``'s items):
        each message kept in its mailbox (the link calls this where it decoded them itself)."""
        if (self._broken and src in self._broken) or (self._queued and src in self._queued):
            for item in items:
                if not self._one(src, item):
                    return
            return
        boxes = self._mailboxes
        for item in items:
            if type(item) is not list or len(item) != 4:
                self._one(src, item)  # which refuses it
                return
            kind, tag, seq, data = item
            if type(tag) is not int or (kind != DATA and (kind != RUN or type(data) is not list)):
                if not self._one(src, item):  # not a message, or a malformed run
                    return
                continue
            box = boxes.get(tag) or self.mailbox(tag)
            if seq != box.seqs.get(src, 0) or type(seq) is not int:  # out of sequence
                if not self._one(src, item):
                    return
                continue
            if kind == DATA:  # the commonest: the channel's next message
                box.seqs[src] = seq + 1
                box.put(_new(Message, (src, tag, data)))
                continue
            box.seqs[src] = seq + len(data)  # a run: its messages from ``seq`` on
            for obj in data:
                box.put(_new(Message, (src, tag, obj)))

    def _one(self, src: int, item: object) -> bool:
        """Take one packet item as a small frame (or run); return whether ``src`` may go on."""
        if (type(item) is not list or len(item) != 4
                or not all(type(field) is int for field in item[:3])
                or (item[0] == RUN and type(item[3]) is not list)):
            self.refuse(src, ProtocolError(f"malformed small frame from rank {src}"), None)
            return False
        kind, tag, seq, data = item
        for i, obj in enumerate(data) if kind == RUN else ((0, data),):
            self._small(src, DATA if kind == RUN else kind, tag, seq + i, obj)
            if src in self._broken:
                return False
        return True

    def _packet_slowly(self, src: int, data: memoryview) -> None:
        """Take a packet that does not decode as a whole: frame by frame, each refused alone."""
        for frame in small.split_packet(data, self.limits):
            if isinstance(frame, ProtocolError):
                self.refuse(src, ProtocolError(f"packet from rank {src}: {frame}"), None)
                return
            self._small(src, *frame)
            if self._broken and src in self._broken:
                return

    def _small(self, src: int, kind: int, tag: int, seq: int, obj: object) -> None:
        """One small frame from ``src``, decoded (``obj``: a ``ProtocolError`` if it is not)."""
        if src in self._broken:
            return
        if kind != DATA:
            self._small_control(src, kind, tag, obj)
            return
        queue = self._queued.get(src) if self._queued else None
        if queue is not None:  # behind a frame still on its way
            queue.append((tag, seq, obj))
            return
        self._keep(src, tag, seq, obj)

    def _keep(self, src: int, tag: int, seq: int, obj: object) -> None:
        """Keep a small message in its mailbox, its sequence checked."""
        box = self._mailboxes.get(tag) or self.mailbox(tag)
        due = box.seqs.get(src, 0)
        box.seqs[src] = seq + 1
        if seq != due or isinstance(obj, ProtocolError):
            why = (f"frame {seq} from rank {src} where {due} was due" if seq != due
                   else f"frame from rank {src} refused: {obj}")
            box.put(Frame.refused(src, tag, ProtocolError(f"rank {self.rank}: channel {tag}: "
                                                          f"{why}"), seq, 0))
            return
        box.put(_new(Message, (src, tag, obj)))

    def _small_control(self, src: int, kind: int, tag: int, obj: object) -> None:
        if kind == Kind.CREDIT:  # not queued: credit may overtake what is on its way
            credit: Any = obj  # (not trusted: checked here)
            try:
                messages, nbytes = credit
                self._credit(src, tag, int(messages), int(nbytes))
            except (TypeError, ValueError):
                self._break(src, ProtocolError(f"malformed credit from rank {src}"))
            return
        self.refuse(src, ProtocolError(f"small frame of kind {kind}"), tag)

    def later(self, src: int, pending: Pending) -> None:
        """A frame from ``src`` whose buffers are still on their way."""
        if src in self._broken:
            return
        queue = self._queued.get(src)
        if queue is None:
            if pending.done() and pending.error is None:  # whole already, none before it
                assert pending.head is not None
                self._deliver(Frame.whole(src, pending.head, pending.buffers, pending.seq))
                return
            queue = self._queued[src] = collections.deque()
        queue.append(pending)
        pending.then(lambda: self._release(src))

    def _release(self, src: int) -> None:
        """Deliver ``src``'s queued frames up to the first still on its way."""
        queue = self._queued.get(src)
        while queue:
            item = queue[0]
            if isinstance(item, tuple):  # a small frame: (tag, seq, message)
                queue.popleft()
                if src not in self._broken:
                    self._keep(src, *item)
                continue
            if isinstance(item, Frame):
                frame = item
            elif not item.done():
                return
            elif item.error is not None:
                error = item.error
                self._queued.pop(src, None)
                # (a peer gone mid-frame stays a PeerFailedError: its data was lost, not bad)
                lost = PeerFailedError if isinstance(error, PeerFailedError) else ProtocolError
                self._break(src, error if isinstance(error, ProtocolError)
                            else lost(f"frame from rank {src} lost: {error}"))
                return
            else:
                assert item.head is not None
                frame = Frame.whole(src, item.head, item.buffers, item.seq)
            queue.popleft()
            if src not in self._broken:
                self._deliver(frame)
        self._queued.pop(src, None)

    def refuse(self, src: int, error: CommError, tag: int | None) -> None:
        """Refuse a malformed frame: on its channel if its tag is legible, its source if not."""
        if tag is None:
            self._break(src, error)
            return
        wrapped = ProtocolError(f"rank {self.rank}: channel {tag}: frame from rank {src} "
                                f"refused: {error}")
        self.mailbox(tag).put(Frame.refused(src, tag, wrapped))

    def _break(self, src: int, error: CommError) -> None:
        """Stop following ``src``'s stream: every channel waiting on it gets ``error`` (a
        ``PeerFailedError`` where the peer went, else a ``ProtocolError``)."""
        self._broken[src] = error
        kind = PeerFailedError if isinstance(error, PeerFailedError) else ProtocolError
        for tag, box in self._mailboxes.items():
            box.put(Frame.refused(src, tag, kind(
                f"rank {self.rank}: channel {tag}: stream from rank {src} broken: {error}")))

    def _deliver(self, frame: Frame) -> None:
        tag = frame.tag
        if frame.kind != DATA:
            self._control(frame)
            return
        box = self._mailboxes.get(tag) or self.mailbox(tag)
        expected = box.seqs.get(frame.src, 0)
        if frame.seq != expected:
            frame.error = ProtocolError(
                f"rank {self.rank}: channel {tag}: frame {frame.seq} from rank "
                f"{frame.src} where {expected} was due")
        box.seqs[frame.src] = frame.seq + 1
        box.put(frame)

    # -- credit returned as messages are taken ----------------------------------------

    def took(self, entry: Entry, box: Mailbox) -> None:
        """Count a message the user took from ``box``; return credit to its sender in batches.

        Note on credit
        --------------
        A batch of credit is queued as a small frame to its sender as soon as the batch is
        taken (``Link.queue_small``): it goes at the next flush (the loop iteration's end, a
        task about to wait), or just before the next frame to its sender, whichever is first.
        So it is on the link before anything this rank sends its sender after taking the
        batch: a sender that waits for an answer to a window's worth of messages has its
        credit back when the answer comes, and does not wait for it when it sends again.
        """
        src = entry.src
        charge = 0 if type(entry) is Message else entry.charge  # type: ignore[union-attr]
        if charge < 0:
            return  # refused: it held no credit
        done = box.taken.get(src)
        if done is None:
            done = box.taken[src] = [0, 0]
        done[0] += 1
        done[1] += charge
        if done[0] >= self.batch or done[1] >= self._batch_bytes:
            self._return_credit(src, entry.tag, done)

    def _return_credit(self, src: int, tag: int, done: list[int]) -> None:
        messages, nbytes = done
        done[0] = done[1] = 0
        if src == self.rank:
            self._credit(self.rank, tag, messages, nbytes)
        elif not self.closed and src not in self.dead:  # (closing: its peers close too)
            self.link.queue_small(src, Kind.CREDIT, tag, 0, _credit_body(messages, nbytes))

    def _credit(self, src: int, tag: int, messages: int, nbytes: int) -> None:
        """Credit came back from ``src`` for channel ``tag`` (the router counts it)."""
        raise NotImplementedError

    def _control(self, frame: Frame) -> None:
        """A whole frame that carries no message (the router takes it)."""
        raise NotImplementedError
