"""Mailboxes: the messages of one channel as they arrive, and the receivers waiting for them.

A mailbox keeps what arrived in order: a small message as the ``Message`` its
receiver gets (decoded once, on arrival), anything else as a ``Frame``. A
receiver waiting for a source is woken when something from it arrives and
takes it then: nothing is handed to a receiver that may yet be cancelled, so
a cancelled ``recv`` loses nothing. A mailbox also counts, per source, the
sequence number due next and what its user took (the credit to return).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from asyncomm._core import small
from asyncomm._core.errors import CommError
from asyncomm._core.wire import Head, Kind


def charge_of(head: Head) -> int:
    """Return the bytes a frame holds of its window, as its sender counts (``size_of``)."""
    return max(0, head.size + head.payload_bytes - small.BYTES)


class Message(NamedTuple):
    """A received message: who sent it, on which channel, and what."""

    src: int
    tag: int
    data: Any


def message(src: int, tag: int, data: object) -> Message:
    """Return ``Message(src, tag, data)``, made as the tuple it is (cheaper than ``__new__``)."""
    return _new(Message, (src, tag, data))  # type: ignore[no-any-return]


_new: Any = tuple.__new__


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
        return cls(src, head.kind, head.tag, seq, head, buffers, charge_of(head))

    @classmethod
    def refused(cls, src: int, tag: int, error: CommError, seq: int = 0,
                charge: int = -1) -> Frame:
        """A frame refused on arrival: its receiver gets ``error`` (``charge``: its credit)."""
        return cls(src, Kind.DATA, tag, seq, None, [], charge, error)


Waiter = tuple[int | None, "asyncio.Future[None]"]  # a receiver: the source it wants
Entry = Message | Frame  # what a mailbox keeps: a small message, or a frame


class Mailbox:
    """Messages of one channel in arrival order, who waits for them, who has closed their end.

    A mailbox with a ``listener`` hands it every good message as it arrives,
    on the loop, instead (actors take their messages so).
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
            self.came(entry[0] if type(entry) is Message else entry.src)

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
        first = frames[0]  # (``src_of``, inline: a waiting recv asks this again and again)
        if (first[0] if type(first) is Message else first.src) == src:  # type: ignore[union-attr]
            return True
        return any(src_of(entry) == src for entry in frames)

    def take(self, src: int | None) -> Entry | None:
        """Pop the first entry (from ``src``, if given), or return ``None``."""
        frames = self.frames
        if not frames:
            return None
        if src is None or src_of(frames[0]) == src:
            return frames.popleft()
        for i, entry in enumerate(frames):
            if src_of(entry) == src:
                del frames[i]
                return entry
        return None


def src_of(entry: Entry) -> int:
    """Return the rank that sent ``entry``."""
    return entry[0] if type(entry) is Message else entry.src  # type: ignore[union-attr]


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
    """Return the bytes a message holds of its window, as its receiver counts (``charge_of``).

    Every message's first ``small.BYTES`` are free, as a small message's all are: the
    window's count of messages bounds them. So 64 messages of 1 MiB fit 64 MiB.
    """
    return 0 if isinstance(frame, bytes) else max(0, size_of(frame) - small.BYTES)


def wake(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)
