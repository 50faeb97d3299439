"""Point-to-point messages on gloo that say their size, so that no receive can abort.

Note on sizes
-------------
A gloo receive given a buffer smaller than the message that matches it fails an assertion on gloo's
own thread, which halts gloo in the process (``gloo_halt``: else ``std::terminate`` would kill it),
from a Python call with a buffer too small. So asyncomm's sends on gloo begin with a 16-byte header
(a magic number, a data tag, the payload's size):

- a payload of at most 64 KiB follows the header in the same message, which every receive takes into
  a buffer of ``first_bytes()`` (a copy on each side: these sends copy anyway, as eager sends);
- a larger one travels as a second message on a tag of the reserved range (``tags.GLOO_DATA``),
  which the receive posts once the header has said that the payload fits its buffer, straight into
  it; one that does not fit is taken whole and dropped. The data tags are used round robin per peer,
  a tag not again before its data was received, so a receive can only match its own data, whatever
  other receives wait on the same source and tag.

A receive into a buffer too small fails with ``MismatchError``, as MPI's does; a smaller message
fills the buffer's beginning, as on MPI. The cost: the header's copy, and for a large payload one
more small message before it (the receive posts its data only once the header is in).

gloo's TCP transport (Linux) takes a message into a longer receive; its libuv transport (macOS,
Windows) reads as many bytes as the receive holds. There (``SHORT`` false) every first message is
padded to the receives' size, 4 KiB, and payloads above 4 KiB less the header travel as data
messages.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import struct
import sys
import threading
from typing import Any

import torch

from asyncomm._core import tags
from asyncomm._core.errors import CommError, MismatchError, truncated

HEADER = struct.Struct("<IIQ")  # magic, the data's tag (0: the payload follows), its bytes
MAGIC = 0xA5C0_3D01
SHORT = sys.platform.startswith("linux")  # a message may be shorter than its receive
FOREVER = datetime.timedelta(days=365)  # how long a point-to-point wait may take


def first_bytes() -> int:
    """The size of every receive of a first message: a header and the longest inline payload
    (64 KiB; 4 KiB in all where a message must fill its receive: see the note)."""
    return HEADER.size + (64 << 10) if SHORT else 4096


def _header(data_tag: int, size: int, payload: torch.Tensor | None = None) -> torch.Tensor:
    """A first message: the header, then ``payload``'s ``size`` bytes if given (read through
    their address in one call, sparing torch's dispatch of a slice and a copy)."""
    message = bytearray(HEADER.pack(MAGIC, data_tag, size))  # (writable, as frombuffer wants)
    if payload is not None and size:
        message += ctypes.string_at(payload.data_ptr(), size)
    if not SHORT:
        message = message.ljust(first_bytes(), b"\0")
    return torch.frombuffer(message, dtype=torch.uint8)


NOTHING = _header(0, 0)  # an empty message (ends a peer's receive; only ever read)


class Outgoing:
    """The data tags a backend's large sends use, per peer (sends come from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}

    def message(self, tensor: torch.Tensor, dst: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Return the first message of ``tensor`` to ``dst``, and its data and data tag if it
        has a second (``None``, 0: the payload is in the first, a copy)."""
        size = tensor.nbytes
        if size <= first_bytes() - HEADER.size:
            return _header(0, size, tensor), None, 0
        with self._lock:
            busy = self._busy.setdefault(dst, set())
            if len(busy) >= tags.GLOO_DATA_TAGS:
                raise CommError(f"{len(busy)} large sends to rank {dst} are in flight already "
                                "(their receives have not been posted)")
            number = self._next.get(dst, 0)
            while number in busy:
                number = (number + 1) % tags.GLOO_DATA_TAGS
            busy.add(number)
            self._next[dst] = (number + 1) % tags.GLOO_DATA_TAGS
        data_tag = tags.GLOO_DATA + number
        return _header(data_tag, size), tensor, data_tag  # (gloo moves its bytes)

    def sent(self, dst: int, data_tag: int) -> None:
        """The data sent on ``data_tag`` was received: the tag may be used again."""
        with self._lock:
            self._busy[dst].discard(data_tag - tags.GLOO_DATA)


_SPARE = 16  # first messages' buffers a backend keeps free for its next receives
Buffer = tuple[torch.Tensor, Any, int]  # a receive's: tensor, NumPy view (for struct), address


class Incoming:
    """One receive into ``tensor``: the buffer its first message lands in (one of ``spare``,
    if any is free), then the rest."""

    __slots__ = ("_buffer", "_refused", "_spare", "_tensor", "first")

    def __init__(self, tensor: torch.Tensor, spare: collections.deque[Buffer]) -> None:
        self._tensor = tensor
        self._spare = spare
        try:  # (pop and append are atomic: receives are issued and finish on any thread)
            self._buffer = spare.pop()
        except IndexError:
            first = torch.empty(first_bytes(), dtype=torch.uint8)
            self._buffer = (first, first.numpy(), first.data_ptr())
        self.first = self._buffer[0]
        HEADER.pack_into(self._buffer[1], 0, 0, 0, 0)  # (a raw empty message: no magic)
        self._refused: CommError | None = None

    def take(self, pg: Any, work: Any, src: int | None) -> None:
        """On the waiting thread: wait for the first message, then receive the payload.

        A message that does not fit is refused (``result`` raises), not raised here:
        the caller's bookkeeping of the receive must still happen.
        """
        work.wait(FOREVER)
        source = work._source_rank() if src is None else src
        _, view, at = self._buffer
        magic, data_tag, size = HEADER.unpack_from(view)
        tensor = self._tensor
        if magic != MAGIC:
            self._refused = MismatchError(f"rank {source} sent a message asyncomm's send did "
                                          "not make (gloo's own send, on comm.raw?)")
        elif size > tensor.nbytes:
            self._refused = truncated(source, size, tensor.nbytes)
            if data_tag:  # taken whole and dropped: the next message must find its receive
                pg.recv([torch.empty(size, dtype=torch.uint8)], source, data_tag).wait(FOREVER)
        elif data_tag:
            target = tensor if size == tensor.nbytes else (
                tensor.reshape(-1).view(torch.uint8)[:size])
            pg.recv([target], source, data_tag).wait(FOREVER)
        elif size:
            ctypes.memmove(tensor.data_ptr(), at + HEADER.size, size)
        if len(self._spare) < _SPARE:  # gloo is done with it: the next receive may take it
            self._spare.append(self._buffer)

    def result(self, source: int) -> int:
        """On the loop: ``source``, or the refusal of a message that did not fit."""
        if self._refused is not None:
            raise self._refused
        return source
