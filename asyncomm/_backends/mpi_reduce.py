"""MPI's reductions: its operator for each of asyncomm's (``mpi_operator``), and small
all-reduces by persistent requests, made and started in step on every rank.

Note on kept all-reduces
------------------------
An all-reduce of a small CPU tensor started by a kept persistent request (``MPI_Allreduce_init``
once, then ``MPI_Start``) costs less than a new ``MPI_Iallreduce``. But a persistent collective is
itself a collective: every rank must make and start its own in the same order as its other
collectives, and it matches only the requests made with it. So whether an all-reduce is kept, and by
which request, depends here only on what every rank knows alike: its *kind* (bytes, dtype,
reduction) and how many of its kind came before -- never on this rank's buffers or timing.

- The first ``KINDS`` kinds of at most ``KEPT_BYTES`` are counted; from the second all-reduce of a
  kind on, ``SLOTS`` requests of its own serve it in turn (each made the first time its turn comes).
  Later kinds, larger ones, bfloat16 (a reduction of Python's) and averages go as before.
- Each request reduces a buffer of its own: the tensor is copied in before the start and out when it
  is done (a request made over the user's first tensor would have to take a later tensor's data into
  that one's memory).
- A request still in flight when its turn comes again holds back that all-reduce and every
  collective issued after it, in order, until it is done: never waited for, as the rank it waits for
  may be waiting for this one. ``split`` (a collective too) waits until nothing is held.
- A library without persistent collectives (``Allreduce_init`` raises) keeps none from then on, on
  every rank alike.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from mpi4py import MPI

from asyncomm._backends import mpi_kept
from asyncomm._backends.mpi_link import DATATYPES, spec
from asyncomm._core import ops
from asyncomm._core.errors import CommClosedError, CommError
from asyncomm._core.handle import Handle, Sink
from asyncomm._core.ops import ReduceOp
from asyncomm._core.polling import Poller

KINDS = 64  # kinds of all-reduce counted per communicator (later kinds are never kept)
KEPT_BYTES = 4096  # the largest all-reduce kept (larger ones are not bound by latency)
SLOTS = 4  # kept requests per kind, used in turn: so many may be in flight at once

_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,  # divided by the size when done
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}

_BOOL_OPS = {**dict.fromkeys((ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR), MPI.LOR),
             **dict.fromkeys((ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND), MPI.LAND),
             ReduceOp.BXOR: MPI.LXOR}  # logical or, and, xor (see ``ReduceOp``)

_BF16_KERNELS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], object]] = {
    ReduceOp.SUM: lambda acc, x: acc.add_(x),
    ReduceOp.AVG: lambda acc, x: acc.add_(x),
    ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
}
# the MPI operator of each (dtype, op) given so far (``mpi_operator``)
MPI_OPS: dict[tuple[torch.dtype, ReduceOp], Any] = {}


def mpi_operator(dtype: torch.dtype, op: ReduceOp) -> Any:
    """Return MPI's operator for ``op`` on ``dtype`` (kept in ``MPI_OPS``; ``AVG`` is a sum,
    divided afterwards by the caller)."""
    made = MPI_OPS.get((dtype, op))
    if made is None:
        if dtype == torch.bool:
            made = _BOOL_OPS[op]
        elif dtype == torch.bfloat16:
            made = _bf16_op(op)
        else:
            made = _OPS[op]
        MPI_OPS[(dtype, op)] = made
    return made


def _bf16_op(op: ReduceOp) -> Any:
    """Make the MPI operator reducing bfloat16 words with ``op`` (once: ``MPI_OPS`` keeps it)."""
    kernel = _BF16_KERNELS[op]

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        x = torch.frombuffer(bytearray(inbuf), dtype=torch.bfloat16)
        acc = torch.frombuffer(inoutbuf, dtype=torch.bfloat16)
        kernel(acc, x)

    return MPI.Op.Create(reduce, commute=True)


_TEST = MPI.Request.Test
_IN_PLACE = MPI.IN_PLACE

F = TypeVar("F", bound=Callable[..., None])


class Kept:
    """A persistent all-reduce over a buffer of its own, and the tensor it last served."""

    __slots__ = ("buffer", "finish", "last", "nbytes", "ptr", "request", "stage", "user",
                 "wanted")

    def __init__(self, request: Any, stage: torch.Tensor, buffer: Any,
                 release: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.stage = stage  # (its memory: ``buffer`` is only its address)
        self.buffer = buffer
        self.nbytes = stage.nbytes
        self.last: Any = mpi_kept.IDLE  # the handle of its last operation (``_keep``: busy)
        self.ptr = 0
        self.user: Any = None  # the tensor's memory (an address and a length), by ``ptr``
        self.wanted = False  # a held collective waits for it

        def finish(_: Any) -> None:  # (the poller's, once MPI is done with it)
            self.user[:] = self.buffer
            if self.wanted:
                self.wanted = False
                loop.call_soon(release)

        self.finish = finish

    def start(self, ptr: int) -> Any:
        """Copy the tensor at address ``ptr`` in and start; return the request."""
        if ptr != self.ptr:
            self.user, self.ptr = MPI.buffer.fromaddress(ptr, self.nbytes), ptr
        self.buffer[:] = self.user
        self.request.Start()
        return self.request


class _Kind:
    __slots__ = ("slots", "uses")

    def __init__(self) -> None:
        self.uses = 0  # all-reduces of the kind kept so far (the first is not)
        self.slots: list[Kept] = []


class Reductions:
    """The kept all-reduces of one communicator, and the collectives they hold back."""

    def __init__(self, comm: Any, loop: asyncio.AbstractEventLoop, poller: Poller,
                 status: Any, classify: Callable[[BaseException], type[CommError]]) -> None:
        self._comm = comm
        self._loop = loop
        self._poller = poller
        self._status = status
        self._classify = classify
        self._tables: dict[tuple[torch.dtype, ops.ReduceOp], dict[int, _Kind]] = {}
        self._kinds = 0
        self._on = True
        self._kept: list[Kept] = []
        # collectives held back, in order, with their sinks (``None``: nothing held)
        self.held: collections.deque[tuple[Sink, Callable[[], object]]] | None = None
        self._unheld = asyncio.Event()  # set while nothing is held
        self._unheld.set()

    def table(self, dtype: torch.dtype, op: ops.ReduceOp) -> dict[int, _Kind] | None:
        """Return the kinds of all-reduce of ``dtype`` and ``op`` by bytes (``None``: never
        kept: bfloat16, whose reduction is Python's)."""
        if dtype == torch.bfloat16:
            return None
        kinds = self._tables.get((dtype, op))
        if kinds is None:
            kinds = self._tables[(dtype, op)] = {}
        return kinds

    def next(self, kinds: dict[int, _Kind], tensor: torch.Tensor, nbytes: int,
             mpi_op: Any) -> Kept | None:
        """Count an all-reduce of ``tensor`` (of ``nbytes``); return the kept request whose
        turn it is (``None``: not kept). Every all-reduce of a kept table comes here, in
        order."""
        kind = kinds.get(nbytes)
        if kind is None:
            if self._on and self._kinds < KINDS and 0 < nbytes <= KEPT_BYTES:
                kinds[nbytes] = _Kind()
                self._kinds += 1
            return None
        if not self._on:
            return None
        turn = kind.uses % SLOTS
        kind.uses += 1
        if turn < len(kind.slots):
            return kind.slots[turn]
        return self._make(kind, tensor, mpi_op)

    def _make(self, kind: _Kind, tensor: torch.Tensor, mpi_op: Any) -> Kept | None:
        """Make the next kept request of ``kind`` (``None``: persistent collectives are not
        to be had)."""
        nbytes = tensor.nbytes
        stage = torch.empty(nbytes, dtype=torch.uint8)
        buffer = MPI.buffer.fromaddress(stage.data_ptr(), nbytes)
        try:
            request = self._comm.Allreduce_init(_IN_PLACE, [buffer, DATATYPES[tensor.dtype]],
                                                mpi_op)
        except (NotImplementedError, MPI.Exception):
            self._on = False  # (on every rank alike: the same library)
            return None
        kept = Kept(request, stage, buffer, self.release, self._loop)
        kind.slots.append(kept)
        self._kept.append(kept)
        return kept

    def start(self, sink: Handle[Any] | Sink, kept: Kept, tensor: torch.Tensor,
              then: Callable[[Any], object] | None = None) -> None:
        """Start ``kept`` for ``tensor`` (``then`` after its copy out), or hold it back
        first, ahead of the others held (its request is in flight)."""
        if kept.last._keep is not None:
            kept.wanted = True
            if self.held is None:
                self.held = collections.deque()
                self._unheld.clear()
            self.held.appendleft((sink, functools.partial(self.start, sink, kept, tensor, then)))
            return
        request = kept.start(tensor.data_ptr())
        finish: Callable[[Any], object] = kept.finish
        if then is not None:
            finish = functools.partial(_both, kept.finish, then)
        kept.last = sink
        self._poller.watch(request, sink, finish)

    def quick(self, tensor: torch.Tensor, where: tuple[int, int, Any],
              what: tuple[Any, ...]) -> Handle[Any] | None:
        """``Backend.quick_all_reduce`` of ``tensor`` (``where``: its address, its bytes and
        ``quick_op``'s pair of the MPI op and its kinds), or ``None`` while collectives are
        held (before anything is counted: the usual path, which counts it, holds it back
        behind them)."""
        if self.held is not None:
            return None
        ptr, nbytes, (mpi_op, kinds) = where
        kept = None if kinds is None else self.next(kinds, tensor, nbytes, mpi_op)
        try:
            if kept is None:
                request = self._comm.Iallreduce(_IN_PLACE, spec(tensor), mpi_op)
            elif kept.last._keep is None:  # the commonest: its request idle
                request = kept.start(ptr)
            else:
                handle: Handle[Any] = Handle(self._loop, what, tensor, tensor)
                self.start(handle, kept, tensor)
                return handle
        except MPI.Exception as exc:  # (counted: the usual path would count it again)
            handle = Handle(self._loop, what, tensor, tensor)
            handle._fail(self._classify(exc), exc)
            return handle
        # Made after the start, so that MPI has the while to finish; three tests (the first
        # only sends this rank's part, the second mostly finds the peers' there).
        handle = Handle(self._loop, what, tensor, tensor)
        try:
            status = self._status
            if _TEST(request, status) or _TEST(request, status) or _TEST(request, status):
                if kept is not None:
                    kept.user[:] = kept.buffer
                handle._succeed(None)
                return handle
        except MPI.Exception as exc:
            handle._fail(self._classify(exc), exc)
            return handle
        if kept is None:
            self._poller.follow(request, handle, None)
        else:
            kept.last = handle
            self._poller.follow(request, handle, kept.finish)
        return handle

    def release(self) -> None:
        """Issue the collectives held, in order, up to one whose request is still busy."""
        held = self.held
        while held:
            sink, issue = held.popleft()
            left = len(held)
            try:
                issue()
            except Exception as exc:
                sink._fail(CommError if isinstance(exc, (TypeError, ValueError))
                           else self._classify(exc), exc)
            if len(held) > left:  # it went back first: its request's end calls again
                return
        self._none_held()

    def _none_held(self) -> None:
        self.held = None
        self._unheld.set()

    async def settled(self) -> None:
        """Return once no collective is held back."""
        while self.held is not None:
            await self._unheld.wait()

    def close(self) -> None:
        """Fail what is held; free the requests not in flight (those are the poller's)."""
        held = self.held or ()
        self._none_held()  # (a split waiting goes on, to find the communicator closed)
        for sink, _ in held:
            sink._fail(CommClosedError, CommClosedError("the communicator was closed"))
        for kept in self._kept:
            if kept.last._keep is None:
                with contextlib.suppress(MPI.Exception):
                    kept.request.Free()
        self._kept.clear()


def _both(first: Callable[[Any], object], then: Callable[[Any], object], outcome: Any) -> object:
    first(outcome)
    return then(outcome)


def in_turn(method: F) -> F:
    """A collective of a backend whose ``_reductions`` is its ``Reductions``: issued now, or
    held back behind the collectives held (see the note)."""
    @functools.wraps(method)
    def issue(self: Any, sink: Sink, *args: Any) -> None:
        held = self._reductions.held
        if held is None:
            method(self, sink, *args)
        else:
            held.append((sink, functools.partial(method, self, sink, *args)))
    return issue  # type: ignore[return-value]

