"""Mailboxes: the frames of one channel as they arrive, and the receivers waiting for them.

A frame that arrives while its mailbox is empty goes straight to the first
receiver waiting for its source, without being kept (``Mailbox.put``); a
receiver cancelled once it was handed a frame puts it back (``put_back``), so
a cancelled ``recv`` loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import torch

from asyncomm._core.errors import CommError
from asyncomm._core.wire import Head, Kind


def charge_of(head: Head) -> int:
    """Return the bytes a frame holds of its window: its head and buffers, as its sender counts."""
    return head.size + head.payload_bytes


# A message ready to send: a small frame's body (see ``small``), or a frame's head and buffers.
Encoded = bytes | tuple[bytes, list[torch.Tensor]]


class Frame:
    """A frame that arrived: whole (``head`` and ``buffers``), or small (``data``, decoded)."""

    __slots__ = ("buffers", "charge", "data", "error", "head", "kind", "seq", "src", "tag")

    def __init__(self, src: int, kind: int, tag: int, seq: int, head: Head | None,
                 buffers: list[torch.Tensor], data: object, charge: int,
                 error: CommError | None = None) -> None:
        self.src, self.kind, self.tag, self.seq = src, kind, tag, seq
        self.head = head  # None for a small frame (else perhaps shared: ``seq`` is its own)
        self.buffers = buffers
        self.data = data  # a small frame's message
        self.charge = charge  # the bytes it holds of its window (-1: none, it was refused)
        self.error = error  # a frame refused on arrival: raised by recv

    @classmethod
    def whole(cls, src: int, head: Head, buffers: list[torch.Tensor], seq: int) -> Frame:
        return cls(src, head.kind, head.tag, seq, head, buffers, None, charge_of(head))

    @classmethod
    def refused(cls, src: int, tag: int, error: CommError) -> Frame:
        return cls(src, Kind.DATA, tag, 0, None, [], None, -1, error)


Waiter = tuple[int | None, "asyncio.Future[Frame | None]"]  # a receiver: the source it wants


class Mailbox:
    """Frames of one channel in arrival order, who waits for them, who has closed their end.

    A frame that arrives while the mailbox is empty goes straight to the
    first receiver waiting for its source (the future it awaits), without
    being kept: no task runs between its arrival and its receiver. A
    mailbox with a ``listener`` hands it every good frame as it arrives,
    on the loop, instead (actors take their messages so).
    """

    def __init__(self) -> None:
        self.frames: collections.deque[Frame] = collections.deque()
        self.ended: set[int] = set()
        self.waiters: list[Waiter] = []
        self.listener: Callable[[Frame], None] | None = None

    def put(self, frame: Frame) -> None:
        if self.listener is not None and frame.error is None:
            self.listener(frame)
            return
        if self.waiters:
            if not self.frames:
                src = frame.src
                for i, (wants, waiter) in enumerate(self.waiters):
                    if (wants is None or wants == src) and not waiter.done():
                        del self.waiters[i]
                        waiter.set_result(frame)
                        return
            self.frames.append(frame)
            self.wake()
            return
        self.frames.append(frame)

    def put_back(self, frame: Frame) -> None:
        """Keep a frame handed to a receiver that was cancelled: before its source's later ones."""
        for i, other in enumerate(self.frames):
            if other.src == frame.src and other.seq > frame.seq:
                self.frames.insert(i, frame)
                break
        else:
            self.frames.appendleft(frame)
        self.wake()

    def wake(self) -> None:
        """Wake every receiver (with nothing): something else happened, let them look."""
        for _, waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.waiters.clear()

    def has_frames(self) -> bool:
        return bool(self.frames)

    def has(self, src: int) -> bool:
        """Return whether a frame from ``src`` is here."""
        frames = self.frames
        if not frames:
            return False
        return frames[0].src == src or any(frame.src == src for frame in frames)

    def take(self, src: int | None) -> Frame | None:
        """Pop the first frame (from ``src``, if given), or return ``None``."""
        frames = self.frames
        if src is None:
            return frames.popleft() if frames else None
        for i, frame in enumerate(frames):
            if frame.src == src:
                del frames[i]
                return frame
        return None


NO_BUFFERS: list[torch.Tensor] = []  # a small frame's (never appended to)
DATA = Kind.DATA.value  # an int: compared on every message


def size_of(frame: Encoded) -> int:
    """Return the bytes a message holds of its window, as its receiver counts them."""
    if isinstance(frame, bytes):
        return len(frame)
    head, buffers = frame
    nbytes = len(head)
    for b in buffers:
        nbytes += b.numel()  # flat uint8
    return nbytes


def wake(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)
