"""Persistent MPI requests kept for the quick sends and receives of ``MpiBackend``.

Note on persistent requests
---------------------------
A quick send or receive (see the note in ``Comm``) of a buffer (address, bytes, MPI datatype), peer
and tag seen before starts a persistent request kept for them: the loops of a program send and
receive the same tensors again and again, and ``MPI_Start`` of a kept request costs less than
posting a new one (see docs/benchmarks.md). The first time, a request of its own is posted and the
buffer noted: one made and freed for every fresh buffer would cost more than it saves. Each kept
request remembers the handle of its last operation: it is started again only once that handle's
buffers are released (the operation is over, also when its await timed out or was cancelled and MPI
finished it later); while it is in flight, the next operation on the same buffer, peer and tag posts
a request of its own. At most ``KEPT`` buffers of each kind are noted or kept (when that many are,
those not in flight are forgotten, their requests freed); closing frees the idle ones, and those in
flight are orphans like any other request.

Small all-reduces are kept too, by their kind rather than their buffer (a persistent collective is
made collectively: see ``mpi_reduce``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from mpi4py import MPI

from asyncomm._backends.mpi_link import spec

KEPT = 64  # buffers noted or kept per communicator, of sends and of receives

# ((address, bytes, MPI datatype's handle): the buffer as ``small.span`` gives it, peer, tag)
Key = tuple[tuple[int, int, Any], int, int]


# What an entry holds for its last operation before it has a handle: read as a handle's
# ``_keep`` is (None: done, the request idle).
IDLE = SimpleNamespace(_keep=None)  # a persistent request's before its first: none, done
SEEN: Any = (None, SimpleNamespace(_keep=True))  # a buffer, peer and tag seen once: no request yet


class Requests:
    """The persistent requests kept for one kind of operation (see the note).

    Args:
        init: makes that kind's persistent request (``Comm.Send_init``, ``Comm.Recv_init``).
        once: posts a request of its own (``Comm.Isend``, ``Comm.Irecv``).
    """

    __slots__ = ("_init", "_kept", "_once")

    def __init__(self, init: Callable[..., Any], once: Callable[..., Any]) -> None:
        self._init, self._once = init, once
        self._kept: dict[Key, list[Any]] = {}  # key: [request, the handle of its last operation]

    def start(self, key: Key, tensor: Any) -> tuple[Any, list[Any] | None]:
        """Start the operation of ``key`` on ``tensor``'s memory: its kept persistent request
        where that is idle; else a request of its own (``once``) the first time the buffer,
        peer and tag come, or while the kept one is in flight; a persistent one (``init``),
        kept, the second time. Return the request and its entry in ``_kept`` (``None``: not
        kept). Raises ``MPI.Exception`` with nothing issued."""
        last = self._kept.get(key)
        if last is not None and last[1]._keep is None:  # the commonest: idle
            last[0].Start()
            return last[0], last
        buffer, (_, peer, tag) = spec(tensor), key
        if last is SEEN:
            request = self._init(buffer, peer, tag)
            try:
                request.Start()
            except MPI.Exception:
                request.Free()
                raise
            entry = self._kept[key] = [request, IDLE]
            return request, entry
        request = self._once(buffer, peer, tag)
        if last is None:  # new: noted, if there is room
            if len(self._kept) >= KEPT:
                self.free_idle()
            if len(self._kept) < KEPT:
                self._kept[key] = SEEN
        return request, None

    def free_idle(self) -> None:
        """Forget what is kept of buffers that are not in flight, freeing their requests."""
        kept = self._kept
        for key, (request, last) in list(kept.items()):
            if last._keep is None or request is None:
                del kept[key]
                if request is not None:
                    with contextlib.suppress(MPI.Exception):
                        request.Free()

    def close(self) -> None:
        """Free the idle requests and forget every one (those in flight are left to finish)."""
        self.free_idle()
        self._kept.clear()
