"""Links: how whole frames travel between the ranks of asyncomm's own communicator.

A ``Link`` carries frames (see ``_wire``) for the channel router, in order
per pair of ranks, and hands each one that arrives to the router's
``Arrivals``. Backends choose the link that suits them (``Backend.link``).

Note on the layout
------------------
A frame travels as one *message* on tag ``T_MESSAGE``: a preamble (head
bytes, frame bytes inline, data messages following), then the frame in one
piece if it fits in the link's ``room``. If it does not, the message holds
only the head (or nothing, for a head beyond the room) and the buffers follow
as *data messages* on tag ``T_DATA`` from the same source, in order: the
receiver posts their receives as soon as the message arrives, so frames from
one source never mix. The frame bytes are the same on every link; only how a
message is found differs:

- ``EnvelopeLink`` (gloo): receives must know their size, so every message
  is padded to ``ENVELOPE_BYTES`` and one any-source receive stands posted.
- the MPI link finds messages by matched probe and sizes each receive from
  it (see ``_mpi``).
"""

from __future__ import annotations

import asyncio
import collections
import struct
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from asyncomm import _wire
from asyncomm._errors import CommError, ProtocolError
from asyncomm._handle import FROM_BACKEND, Handle
from asyncomm._wire import Head

if TYPE_CHECKING:
    from asyncomm._backends import Backend

T_MESSAGE = 1  # tags on asyncomm's own communicator
T_DATA = 2
PREAMBLE = struct.Struct("<IIII")  # head bytes, frame bytes inline (0: none), data messages, 0
ENVELOPE_BYTES = 4096

Arrival = tuple[Head, list[torch.Tensor]]


class Arrivals(Protocol):
    """Where a link hands what it receives (the channel router)."""

    def frame(self, src: int, head: Head, buffers: list[torch.Tensor]) -> None:
        """A whole frame from ``src``."""

    def later(self, src: int, arrival: Awaitable[Arrival]) -> None:
        """A frame from ``src`` whose buffers are on their way (it comes before later ones)."""

    def refuse(self, src: int, error: ProtocolError, tag: int | None) -> None:
        """A malformed frame: on channel ``tag``, or (``None``) the end of ``src``'s stream."""


class Link(ABC):
    """Frames between the ranks of one communicator; see the note on the layout."""

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop, room: int) -> None:
        self._backend = backend
        self._loop = loop
        self.room = room  # the most frame bytes a message carries inline
        self._arrivals: Arrivals | None = None
        self._limits = _wire.Limits()
        self._held: dict[int, collections.deque[torch.Tensor]] = {}

    def open(self, arrivals: Arrivals, limits: _wire.Limits) -> None:
        """Start receiving: every frame that arrives goes to ``arrivals``."""
        self._arrivals, self._limits = arrivals, limits

    def pump(self) -> bool:
        """Hand over what has arrived, without waiting; return whether anything had."""
        return False

    def expect(self) -> None:  # noqa: B027
        """A receiver waits: watch closely for a while (where the link polls)."""

    @abstractmethod
    def stop(self) -> None:
        """Receive nothing more (every peer said goodbye, or the communicator closes)."""

    def _message(self, nbytes: int) -> bytearray:
        """Return a zeroed message buffer of at least ``nbytes``."""
        return bytearray(nbytes)

    def _post(self, buffer: bytearray | torch.Tensor, dst: int, tag: int) -> Handle[None] | None:
        """Send ``buffer``; return its handle, or ``None`` if it is done already."""
        tensor = buffer if isinstance(buffer, torch.Tensor) else torch.frombuffer(
            buffer, dtype=torch.uint8)
        handle: Handle[None] = Handle(self._loop, (self._backend.rank, "send", None, dst, tag),
                                      None, tensor)
        # Data messages are never eager: on gloo an eager data message behind its
        # envelope took ~7 ms to arrive (a 64 KiB channel round trip: 8 ms eager, 1 ms not).
        self._backend.send(handle, tensor, dst, tag, eager=tag == T_MESSAGE)
        return handle

    def _fetch(self, tensor: torch.Tensor, src: int | None, tag: int) -> Handle[int]:
        handle: Handle[int] = Handle(self._loop, (self._backend.rank, "recv", None, src, tag),
                                     FROM_BACKEND, tensor)
        self._backend.recv(handle, tensor, src, tag)
        return handle

    # -- sending -----------------------------------------------------------------------

    def send(self, dst: int, head: bytes, buffers: list[torch.Tensor]) -> list[Handle[None]]:
        """Issue a frame (``buffers`` flat uint8); return the handles still in flight."""
        at = PREAMBLE.size
        size = _wire.frame_size(len(head), [b.numel() for b in buffers])
        inline = size <= self.room
        follow = 0 if inline else len(buffers) + (len(head) > self.room)
        body = size if inline else len(head) if follow == len(buffers) else 0
        message = self._message(at + body)
        PREAMBLE.pack_into(message, 0, len(head), size if inline else 0, follow, 0)
        if inline:
            _wire.pack_frame(head, buffers, np.frombuffer(message, np.uint8, size, at))
        elif follow == len(buffers):
            message[at:at + len(head)] = head
        posted = [self._post(message, dst, T_MESSAGE)]
        if follow > len(buffers):
            posted.append(self._post(torch.frombuffer(bytearray(head), dtype=torch.uint8),
                                     dst, T_DATA))
        if not inline:
            posted.extend(self._post(b, dst, T_DATA) for b in buffers)
        return [h for h in posted if h is not None]

    # -- receiving ---------------------------------------------------------------------

    def _arrive(self, src: int, message: torch.Tensor) -> None:
        """Take one message from ``src`` (flat uint8, perhaps padded), in its order."""
        arrivals = self._arrivals
        assert arrivals is not None
        held = self._held.get(src)
        if held is not None:  # a big head from src is still on its way: keep the order
            held.append(message)
            return
        at = PREAMBLE.size
        view = memoryview(message.numpy().data)
        if len(view) < at:
            arrivals.refuse(src, ProtocolError(f"message of {len(view)} bytes from rank {src}"),
                            None)
            return
        head_bytes, inline, follow, _ = PREAMBLE.unpack_from(view, 0)
        if head_bytes > self._limits.max_head_bytes or inline > len(view) - at:
            arrivals.refuse(src, ProtocolError(f"message from rank {src} declares a head of "
                                               f"{head_bytes} bytes, inline {inline}"), None)
            return
        if head_bytes > self.room:  # the head follows as a data message: hold src's later ones
            if inline or not follow:
                arrivals.refuse(src, ProtocolError(f"message from rank {src} declares a head "
                                                   f"of {head_bytes} bytes inline"), None)
                return
            raw_head = torch.empty(head_bytes, dtype=torch.uint8)
            self._held[src] = collections.deque()
            fetched = self._fetch(raw_head, src, T_DATA)
            arrivals.later(src, self._big_head(src, raw_head, fetched, follow - 1))
            return
        raw = view[at:at + head_bytes]
        try:
            head = _wire.decode_head(raw, self._limits)
            if inline:
                if follow:
                    raise ProtocolError("a frame inline with data messages following")
                buffers = _wire.unpack_frame(message[at:at + inline], head_bytes, head)
            else:
                self._check_follow(head, head_bytes, follow)
        except ProtocolError as exc:  # its data messages cannot be skipped safely
            arrivals.refuse(src, exc, None if follow else _wire.legible_tag(raw))
            return
        if inline:
            arrivals.frame(src, head, buffers)
        else:
            arrivals.later(src, self._data(src, head))

    def _check_follow(self, head: Head, head_bytes: int, follow: int) -> None:
        if follow != len(head.descriptors):
            raise ProtocolError("data message count does not match the head")
        if _wire.frame_size(head_bytes, [d.nbytes for d in head.descriptors]) <= self.room:
            raise ProtocolError("a frame that fits its message came in pieces")

    def _data(self, src: int, head: Head) -> Awaitable[Arrival]:
        """Post a frame's data receives now, in order; return what completes the frame."""
        buffers = _wire.allocate(head)
        receives = [self._fetch(b, src, T_DATA) for b in buffers]

        async def complete() -> Arrival:
            for receive in receives:
                await receive
            return head, buffers

        return complete()

    async def _big_head(self, src: int, raw_head: torch.Tensor, fetched: Handle[int],
                        follow: int) -> Arrival:
        try:
            await fetched
            head = _wire.decode_head(raw_head.numpy().tobytes(), self._limits)
            self._check_follow(head, len(raw_head), follow)
            frame = self._data(src, head)
        finally:
            for message in self._held.pop(src, ()):  # now the later ones, in order
                self._arrive(src, message)
        return await frame


class EnvelopeLink(Link):
    """Messages of a fixed size (``ENVELOPE_BYTES``), one any-source receive always posted.

    For backends whose receives must know their size up front (gloo).
    """

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(backend, loop, ENVELOPE_BYTES - PREAMBLE.size)
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def open(self, arrivals: Arrivals, limits: _wire.Limits) -> None:
        super().open(arrivals, limits)
        self._task = self._loop.create_task(self._receive())

    def _message(self, nbytes: int) -> bytearray:
        return bytearray(ENVELOPE_BYTES)

    async def _receive(self) -> None:
        while not self._stopped:
            envelope = torch.empty(ENVELOPE_BYTES, dtype=torch.uint8)
            try:
                src = await self._fetch(envelope, None, T_MESSAGE)
            except CommError:
                return  # closed under us
            self._arrive(src, envelope)

    def stop(self) -> None:
        """Post no more receives; a receive still posted stays posted (gloo cannot cancel it)."""
        self._stopped = True
        task = self._task
        if task is not None and task is not asyncio.current_task(self._loop):
            task.cancel()
