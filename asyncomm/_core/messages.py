"""Link messages: their preamble, a frame laid out in one piece, a batch's envelopes, and a
frame whose buffers are still on their way (``Pending``); see ``link``'s note on the layout.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

from asyncomm._core.errors import CommError, ProtocolError
from asyncomm._core.handle import Handle
from asyncomm._core.wire import Head

PREAMBLE = struct.Struct("<IIII")  # head bytes, frame bytes inline (0: none), data messages, form
PACKET = 1  # the preamble's form of a packet of small frames (0: a frame)
BATCH = 2  # the preamble's form of a batch: the envelopes of large frames
_PREAMBLE_AT, _PREAMBLE_BYTES = PREAMBLE.unpack_from, PREAMBLE.size


class Pending:
    """A frame whose buffers are on their way; ``then`` runs once it is whole or failed, at
    once (no loop iteration between a buffer's arrival and the frame's delivery)."""

    __slots__ = ("_then", "buffers", "error", "head", "left", "seq")

    def __init__(self, head: Head | None, buffers: list[torch.Tensor], seq: int,
                 left: int | None = None) -> None:
        self.head = head  # perhaps shared by frames alike: the frame's seq is ``seq``
        self.buffers = buffers  # (a link may take them only as their data comes: ``left``)
        self.seq = seq
        self.left = len(buffers) if left is None else left
        self.error: CommError | None = None
        self._then: Callable[[], None] | None = None

    def done(self) -> bool:
        return self.error is not None or (self.head is not None and self.left == 0)

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when done (at once, if it is)."""
        if self.done():
            callback()
        else:
            self._then = callback

    def received(self, handle: Handle[Any]) -> None:
        try:
            handle.result()
        except CommError as exc:
            self.fail(exc)
        else:
            self.arrived()

    def arrived(self) -> None:
        """One buffer has arrived."""
        self.left -= 1
        self._settle()

    def whole(self) -> None:
        """Every buffer has arrived (for links that wait for them all at once)."""
        self.left = 0
        self._settle()

    def fail(self, error: CommError) -> None:
        if self.error is None:
            self.error = error
            self._settle()

    def follow(self, other: Pending) -> None:
        """Become ``other`` (the frame behind a head that came late) once it is done."""
        def adopt() -> None:
            self.head, self.buffers, self.seq, self.left = other.head, other.buffers, other.seq, 0
            if other.error is not None:
                self.error = other.error
            self._settle()

        other.then(adopt)

    def _settle(self) -> None:
        if self.done() and self._then is not None:
            then, self._then = self._then, None
            then()


# -- a frame in one piece (a link message's layout) ----------------------------------------

ALIGN = 16  # buffers of a frame in one piece start at multiples of this


def _aligned(at: int) -> int:
    return (at + ALIGN - 1) & -ALIGN


def envelopes(view: memoryview, room: int) -> Iterator[tuple[memoryview, int]]:
    """Yield the envelopes of a batch: each frame's head and its count of data messages;
    raise ``ProtocolError`` at the first one that is malformed (those before are whole)."""
    at, end = 0, len(view)
    while at < end:
        if end - at < _PREAMBLE_BYTES:
            raise ProtocolError(f"an envelope cut short ({end - at} bytes)")
        head_bytes, inline, follow, form = _PREAMBLE_AT(view, at)
        at += _PREAMBLE_BYTES
        if inline or form or not follow or head_bytes > min(end - at, room):
            raise ProtocolError(f"an envelope declares a head of {head_bytes} bytes, "
                                f"inline {inline}, {follow} data messages")
        yield view[at:at + head_bytes], follow
        at += head_bytes


def frame_size(head_bytes: int, sizes: list[int]) -> int:
    """Return the bytes of a frame in one piece: the head, then each buffer aligned."""
    at = head_bytes
    for n in sizes:
        at = _aligned(at) + n
    return at


def pack_frame(head: bytes, buffers: list[torch.Tensor], out: memoryview) -> None:
    """Lay out a frame in one piece into ``out`` (zeroed, ``frame_size`` bytes long);
    ``buffers`` are flat uint8 tensors, as ``encode`` returns them."""
    at = len(head)
    out[:at] = head
    for b in buffers:
        at = _aligned(at)
        n = b.numel()
        if n:
            out[at:at + n] = b.numpy().data
        at += n


def unpack_frame(frame: memoryview, head_bytes: int, head: Head) -> list[torch.Tensor]:
    """Return tensors over the buffers of a frame in one piece (flat uint8, no copies).

    Raises:
        ProtocolError: ``frame`` does not hold exactly the head and the buffers it describes.
    """
    at, spans = head_bytes, []
    for d in head.descriptors:
        at = _aligned(at)
        spans.append((at, d.nbytes))
        at += d.nbytes
    if at != len(frame):
        raise ProtocolError(f"frame of {len(frame)} bytes where its head describes {at}")
    return [torch.frombuffer(frame, dtype=torch.uint8, count=n, offset=start) if n
            else torch.empty(0, dtype=torch.uint8) for start, n in spans]
