"""Receive buffers of large frames, lent again once nothing refers to them.

Note on recycling
-----------------
A frame's buffers become the received tensors (no copy), and fresh memory costs a page fault per
page whether or not the allocator hands freed memory back (docs/channels-and-actors.md, "Large
messages' memory"). So a large buffer is a ``bytearray`` lent here, the tensor a view of it
(``torch.frombuffer``). Every tensor, view or array over it holds a reference to the bytearray
through its storage, so one whose only references are this pool's is free again
(``sys.getrefcount``) and is lent again to a frame buffer of its size. At most ``limit`` bytes are
kept, lent and free (beyond that a buffer is fresh memory nobody keeps): a rank that stops receiving
leaves at most ``limit`` bytes behind until its link closes.

Note on reuse
-------------
The buffer lent again is the one freed last: it is still in the cache (its message was just read).
Messages are mostly consumed in the order they came, so the buffers lent first are the ones freed
first: every ``take`` moves the oldest lent buffers that are free to the free ones (stopping at the
first still used: cheap however many messages the user keeps), and the whole lent list is looked
through only when that finds none (looked through only once none is free, a burst's leftovers would
be lent in turn, each out of the cache).
"""

from __future__ import annotations

import collections
import sys
import threading

import torch


def _unused_references() -> int:
    """Return a bytearray's references while only ``_collect``'s loop holds it."""
    for buffer in [bytearray(1)]:  # as in ``_collect``: a list slot, the loop's name
        return sys.getrefcount(buffer)
    raise AssertionError  # pragma: no cover


_UNUSED = _unused_references()


class Buffers:
    """Receive buffers (flat uint8 tensors): large ones lent from kept memory."""

    def __init__(self, limit: int = 128 << 20, least: int = 64 << 10) -> None:
        self.limit = limit  # the most bytes kept, lent and free
        self.least = least  # buffers smaller than this are fresh memory (no page to spare)
        self._lock = threading.Lock()  # the gloo link lends on its listener thread
        self._lent: collections.deque[bytearray] = collections.deque()  # oldest first
        self._free: dict[int, list[bytearray]] = {}  # per size, freed last at the end
        self._kept = 0  # the bytes kept, lent and free

    def take(self, nbytes: int) -> torch.Tensor:
        """Return a flat uint8 tensor of ``nbytes`` to receive into."""
        if nbytes < self.least:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:  # the free buffer of nbytes freed last (see the note on reuse)
            self._collect_oldest()
            free = self._free.get(nbytes)
            if not free:
                self._collect()
                free = self._free.get(nbytes)
            if free:
                buffer = free.pop()
            else:
                if self._kept + nbytes > self.limit:
                    self._evict(self._kept + nbytes - self.limit)
                    if self._kept + nbytes > self.limit:
                        return torch.empty(nbytes, dtype=torch.uint8)
                buffer = bytearray(nbytes)
                self._kept += nbytes
            self._lent.append(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def clear(self) -> None:
        """Keep nothing more (tensors over lent buffers stay valid: they hold them)."""
        with self._lock:
            self._lent, self._free, self._kept = collections.deque(), {}, 0

    def _collect_oldest(self) -> None:
        """Move the oldest lent buffers nothing refers to any more to the free ones."""
        lent, free = self._lent, self._free
        while lent:
            buffer = lent[0]  # (held by its slot and a name, as in ``_unused_references``)
            if sys.getrefcount(buffer) > _UNUSED:
                return
            free.setdefault(len(buffer), []).append(lent.popleft())

    def _collect(self) -> None:
        """Move every lent buffer nothing refers to any more to the free ones."""
        still: collections.deque[bytearray] = collections.deque()
        for buffer in self._lent:
            if sys.getrefcount(buffer) > _UNUSED:
                still.append(buffer)
            else:
                self._free.setdefault(len(buffer), []).append(buffer)
        self._lent = still

    def _evict(self, nbytes: int) -> None:
        """Forget free buffers of at least ``nbytes`` in all, if there are so many."""
        for size in list(self._free):
            free = self._free[size]
            while free and nbytes > 0:
                free.pop()
                self._kept -= size
                nbytes -= size
            if not free:
                del self._free[size]
            if nbytes <= 0:
                return
