"""MPI backend through mpi4py: non-blocking MPI calls completed by ``Poller``.

Tensors are passed to MPI as NumPy views of their own memory (zero-copy).
MPI has no ``avg`` (done as ``sum`` then a division) and no native bfloat16
arithmetic here (user-defined operators over 16-bit words). Lists of tensors
go through one flat buffer unless they already are consecutive views of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from asyncomm._backends import mpi_kept
from asyncomm._backends.mpi_link import AT_ONCE_BYTES, DATATYPES, PostedLink, ProbeLink, spec
from asyncomm._backends.mpi_reduce import MPI_OPS, Reductions, in_turn, mpi_operator
from asyncomm._core import small, tags
from asyncomm._core.backend import Backend, InFlight, Posted, Tensors, nothing, remembering
from asyncomm._core.errors import (
    CommClosedError,
    CommError,
    MismatchError,
    PeerFailedError,
    truncated,
)
from asyncomm._core.handle import Handle, Sink, reraise
from asyncomm._core.link import Link
from asyncomm._core.ops import ReduceOp
from asyncomm._core.polling import Poller

_TEST = MPI.Request.Test
# the MPI datatype of each dtype, by its handle (a key of the persistent requests kept)
_DATATYPE_HANDLES = {dtype: datatype.handle for dtype, datatype in DATATYPES.items()}


# Requests still in MPI's hands when their communicator was freed, with their sinks (which hold the
# buffers MPI may still write into): kept for the life of the process, never tested again (testing
# one that a late message failed, once its communicator is freed, makes MPICH abort the process).
#
# A pending receive is not cancelled: a message a peer sends after this rank closed
# would then wait, unmatched, until MPI gives the freed communicator's context to a
# new one, and be received there, by a later receive on the same tag. Left pending,
# the receive keeps the context from reuse and takes the late message itself.
#
# The list outlives the interpreter's teardown (one reference nobody drops): MPI's
# finalize runs after it (mpi4py's exit hook), and progresses what is still pending,
# reading and writing these buffers. Open MPI read a freed one there: a segmentation
# fault in its finalize, as a peer received a large send that had timed out here.
_orphans: list[tuple[Any, Sink | bytearray, bool]] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_orphans))

_PEER_GONE = ("process failed", "proc_failed", "terminated", "connection", "unreachable")

# Open MPI's receive of a message larger than its buffer, beyond its eager limit (~4 KiB),
# kills the process (a segmentation fault in its truncated rendezvous receive; MPICH says
# "Message truncated"). There a receive first finds its message by matched probe, and
# takes it only if it fits: whole and dropped otherwise (``MismatchError``). Read when a
# communicator is made (a test sets it on MPICH).
PROBE_FIRST = "open mpi" in MPI.Get_library_version().lower()
_Probing = tuple[Sink, torch.Tensor, int, int]  # a receive probing: sink, buffer, source, tag


# MPICH's detail of a truncated receive, the last line of its error stack. Which size it
# calls received and which the buffer's varies with the path: the larger was sent.
_TRUNCATION = re.compile(r"rank (\d+) and tag \d+ truncated; (\d+) bytes received but "
                         r"buffer size is (\d+)")


def classify(exc: BaseException) -> type[CommError]:
    """Map an MPI exception to the asyncomm error it means (a truncated receive: its sizes
    noted as ``gist`` reads them)."""
    text = str(exc).lower()
    if "truncat" in text:
        if not getattr(exc, "__notes__", None):  # (else noted before)
            found = _TRUNCATION.search(str(exc))
            if found:
                sender, one, other = map(int, found.groups())
                exc.add_note(str(truncated(sender, max(one, other), min(one, other))))
            else:  # (MPICH's large messages: the sizes are not said)
                exc.add_note("the message was larger than the buffer (truncated; MPI does not "
                             "say by how much)")
        return MismatchError
    if any(sign in text for sign in _PEER_GONE):
        return PeerFailedError
    return CommError


def _consecutive(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Return one flat tensor over ``tensors`` if they are consecutive in one storage."""
    first = tensors[0]
    nbytes = first.numel() * first.element_size()
    base = first.data_ptr()
    storage = first.untyped_storage()
    for i, tensor in enumerate(tensors):
        if (tensor.data_ptr() != base + i * nbytes
                or tensor.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
    flat = first.new_empty(0)
    flat.set_(storage, first.storage_offset(), (first.numel() * len(tensors),), (1,))
    return flat


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = _consecutive(tensors)
    return flat if flat is not None else torch.cat([t.reshape(-1) for t in tensors])


def _unflatten(flat: torch.Tensor,
               tensors: Sequence[torch.Tensor]) -> Callable[[Any], object] | None:
    """Return a finish step copying ``flat`` back into ``tensors`` unless it is their memory."""
    if _consecutive(tensors) is not None:
        return None

    def copy_out(_: Any) -> object:
        parts = torch.split(flat, [t.numel() for t in tensors])
        for tensor, part in zip(tensors, parts, strict=True):
            tensor.view(-1).copy_(part)
        return None

    return copy_out


class MpiBackend(Backend):
    """An MPI communicator driven by polling from the event loop.

    Quick sends and receives start persistent requests kept for their buffers (``mpi_kept``).
    """

    name = "mpi"
    dtypes = frozenset(DATATYPES)
    quick = True

    def __init__(self, comm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.raw = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.ends_job_on_error = MPI.COMM_WORLD.Get_size() > 1
        self.max_tag = int(tag_ub) - tags.RESERVED  # type: ignore[arg-type]
        self._comm = comm
        self._loop = loop
        self._status = MPI.Status()
        # (tested by mpi4py's own methods: no Python frame per test)
        self._classify = remembering(self, classify)
        self._poller = Poller(loop, MPI.Request.Test, self._status, self._status.Get_source,
                              self._testsome, self._classify)
        self._statuses: list[Any] = []
        self._closed = False
        self.posted = InFlight()  # ``Posted`` operations (cancelled at close)
        self._probe_first = PROBE_FIRST
        self._span = small.span  # where the tensor of a quick operation lies
        self._probing: list[_Probing] = []  # receives looking for their message, in order
        # persistent requests of quick sends and receives (see ``mpi_kept``)
        self._sends = mpi_kept.Requests(comm.Send_init, comm.Isend)
        self._recvs = mpi_kept.Requests(comm.Recv_init, comm.Irecv)
        # small all-reduces by persistent requests, and the collectives they hold back
        self._reductions = Reductions(comm, loop, self._poller, self._status, self._classify)

    def _average(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[Any], object] | None:
        if op is not ReduceOp.AVG:
            return None
        size = self.size

        def divide(_: Any) -> object:
            tensor.div_(size)
            return None

        return divide

    # -- progress -------------------------------------------------------------------

    def _testsome(self, requests: Sequence[Any]) -> list[tuple[int, Any]]:
        statuses = self._statuses
        if len(statuses) < len(requests):
            statuses.extend(MPI.Status() for _ in range(len(requests) - len(statuses)))
        try:
            indices = MPI.Request.Testsome(requests, statuses)
        except MPI.Exception:
            return self._test_each(requests)
        if not indices:
            return []
        return [(index, statuses[j].Get_source()) for j, index in enumerate(indices)]

    def _test_each(self, requests: Sequence[Any]) -> list[tuple[int, Any]]:
        """Test requests one by one, to pin an error on the request that raised it."""
        completed: list[tuple[int, Any]] = []
        status = MPI.Status()
        for index, request in enumerate(requests):
            try:
                if request.Test(status):
                    completed.append((index, status.Get_source()))
            except MPI.Exception as exc:
                completed.append((index, exc))
        return completed

    def _watch(self, sink: Sink, request: Any, finish: Callable[[Any], object] | None = None,
               keep: object = None, active: bool = True) -> None:
        # Buffers are raw addresses: the handle keeps the user's tensors alive, and
        # ``keep`` the temporaries (flat copies) until the request is done. No finish:
        # the request's outcome (its source) is the value.
        if keep is not None:
            request_finish = finish or nothing

            def finish(outcome: Any, _keep: object = keep) -> object:
                return request_finish(outcome)

        self._poller.watch(request, sink, finish, active)

    # -- collectives ------------------------------------------------------------------

    @in_turn
    def barrier(self, sink: Sink) -> None:
        self._watch(sink, self._comm.Ibarrier())

    @in_turn
    def broadcast(self, sink: Sink, tensor: torch.Tensor, src: int) -> None:
        self._watch(sink, self._comm.Ibcast(spec(tensor), root=src))

    def quick_op(self, dtype: torch.dtype, op: ReduceOp) -> object | None:
        if op is ReduceOp.AVG:
            return None
        return mpi_operator(dtype, op), self._reductions.table(dtype, op)

    def quick_all_reduce(self, tensor: Any, ops: dict[torch.dtype, Any],
                         what: tuple[Any, ...]) -> Handle[Any] | None:
        if self.lost is not None:
            return None  # the usual path fails it
        where = self._span(tensor, ops)
        return None if where is None else self._reductions.quick(tensor, where, what)

    def quick_send(self, tensor: Any, dst: int, tag: int,
                   what: tuple[Any, ...]) -> Handle[Any] | None:
        if self.lost is not None:
            return None  # the usual path fails it
        where = self._span(tensor, _DATATYPE_HANDLES)
        if where is None:
            return None
        try:  # (a persistent request kept for the buffer, peer and tag: ``mpi_kept``)
            request, kept = self._sends.start((where, dst, tag), tensor)
        except MPI.Exception:
            return None  # nothing issued: the usual path issues it again, words its error
        # Its handle is made once it is posted; done after two tests (the commonest, a small send),
        # it is made done; else the poller follows it, and ``kept`` notes it in flight.
        try:
            if _TEST(request, self._status) or _TEST(request, self._status):
                return Handle(self._loop, what, None, None, True)  # (made done)
        except MPI.Exception as exc:  # (the request is freed: only its error is left)
            handle: Handle[Any] = Handle(self._loop, what, None)
            handle._fail(self._classify(exc), exc)
            return handle
        handle = Handle(self._loop, what, None, tensor)
        if kept is not None:
            kept[1] = handle
        self._poller.follow(request, handle, None)
        return handle

    def quick_recv(self, tensor: Any, src: int, tag: int,
                   what: tuple[Any, ...]) -> Handle[Any] | None:
        if self.lost is not None:
            return None  # the usual path fails it
        where = self._span(tensor, _DATATYPE_HANDLES)
        if where is None:
            return None
        handle: Handle[Any] = Handle(self._loop, what, src, tensor)
        if self._probe_first:  # see PROBE_FIRST
            self._recv_probed(handle, tensor, src, tag)
            return handle
        try:  # (as ``quick_send``)
            request, kept = self._recvs.start((where, src, tag), tensor)
        except MPI.Exception:
            return None
        if kept is not None:
            kept[1] = handle
        self._poller.watch(request, handle, None, False)
        return handle

    @in_turn
    def all_reduce(self, sink: Sink, tensor: torch.Tensor, op: ReduceOp) -> None:
        mpi_op = MPI_OPS.get((tensor.dtype, op)) or mpi_operator(tensor.dtype, op)  # (a hot path)
        reductions = self._reductions
        kinds = reductions.table(tensor.dtype, op)
        kept = None if kinds is None else reductions.next(kinds, tensor, tensor.nbytes, mpi_op)
        if kept is not None:  # (see ``mpi_reduce``)
            reductions.start(sink, kept, tensor, self._average(tensor, op))
            return
        request = self._comm.Iallreduce(MPI.IN_PLACE, spec(tensor), mpi_op)
        self._poller.watch(request, sink, self._average(tensor, op))

    @in_turn
    def reduce(self, sink: Sink, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        mpi_op = mpi_operator(tensor.dtype, op)
        if self.rank == dst:
            request = self._comm.Ireduce(MPI.IN_PLACE, spec(tensor), mpi_op, root=dst)
            self._watch(sink, request, self._average(tensor, op))
        else:
            self._watch(sink, self._comm.Ireduce(spec(tensor), None, mpi_op, root=dst))

    @in_turn
    def all_gather(self, sink: Sink, out: Tensors, tensor: torch.Tensor) -> None:
        flat = _consecutive(out)
        gathered = flat if flat is not None else tensor.new_empty(tensor.numel() * self.size)
        request = self._comm.Iallgather(spec(tensor), spec(gathered))
        self._watch(sink, request, _unflatten(gathered, out), keep=gathered)

    @in_turn
    def gather(self, sink: Sink, out: Tensors | None, tensor: torch.Tensor, dst: int) -> None:
        if out is None:
            self._watch(sink, self._comm.Igather(spec(tensor), None, root=dst))
            return
        flat = _consecutive(out)
        gathered = flat if flat is not None else tensor.new_empty(tensor.numel() * self.size)
        request = self._comm.Igather(spec(tensor), spec(gathered), root=dst)
        self._watch(sink, request, _unflatten(gathered, out), keep=gathered)

    @in_turn
    def scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors | None,
                src: int) -> None:
        if chunks is None:
            self._watch(sink, self._comm.Iscatter(None, spec(tensor), root=src))
            return
        flat = _flatten(chunks)
        self._watch(sink, self._comm.Iscatter(spec(flat), spec(tensor), root=src), keep=flat)

    @in_turn
    def reduce_scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors,
                       op: ReduceOp) -> None:
        flat = _flatten(chunks)
        request = self._comm.Ireduce_scatter_block(spec(flat), spec(tensor),
                                                   mpi_operator(tensor.dtype, op))
        self._watch(sink, request, self._average(tensor, op), keep=flat)

    @in_turn
    def all_to_all(self, sink: Sink, outputs: Tensors, inputs: Tensors) -> None:
        send_flat, recv_flat = _flatten(inputs), _flatten(outputs)
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        send_displs = np.cumsum([0, *send_counts[:-1]]).tolist()
        recv_displs = np.cumsum([0, *recv_counts[:-1]]).tolist()
        words, datatype = spec(send_flat)
        recv_words, _ = spec(recv_flat)
        request = self._comm.Ialltoallv([words, (send_counts, send_displs), datatype],
                                        [recv_words, (recv_counts, recv_displs), datatype])
        self._watch(sink, request, _unflatten(recv_flat, outputs), keep=(send_flat, recv_flat))

    # -- point to point --------------------------------------------------------------

    def send(self, sink: Sink, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._watch(sink, self._comm.Isend(spec(tensor), dst, tag))

    def recv(self, sink: Sink, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        source = MPI.ANY_SOURCE if src is None else src
        if self._probe_first:  # see PROBE_FIRST
            self._recv_probed(sink, tensor, source, tag)
            return
        self._watch(sink, self._comm.Irecv(spec(tensor), source, tag), active=False)

    def _recv_probed(self, sink: Sink, tensor: torch.Tensor, source: int, tag: int) -> None:
        """Receive into ``tensor`` once a matched probe has found a message that fits."""
        receive = (sink, tensor, source, tag)
        if not self._probing:  # (else it looks after those issued before it)
            alone = [receive]
            self._probe_receives(alone)
            if not alone:
                return  # found (or failed)
            self._poller.add_pump(self._probe_waiting)
        self._probing.append(receive)
        if hasattr(sink, "_spin"):  # a handle: awaited, it looks for its message itself
            sink._spin = (self,)

    def spin(self, sink: Handle[Any]) -> bool:
        """An awaited receive that probes first: look for its message a while now, as a
        channel's receive does (``Poller.spin_until``: the poller's pump looks, for this
        receive and those before it, in order). Return whether its handle may look again
        after a loop turn (see ``Handle.__await__``): once its message is found, as the
        poller's requests do; while it is not, no (it waits; the poller goes on looking)."""
        sink._spin = None  # (taken, its receive is done, or the poller's: see ``follow``)
        if not self._poller.spin_until(lambda: sink.done() or sink._spin is not None):
            if any(r[0] is sink for r in self._probing):
                sink._spin = (self,)  # (awaited again later, it looks again)
            return False
        engine = sink._spin  # found: its receive is posted, and the poller's to finish
        return engine is not None and bool(engine[0].spin(sink))

    def _probe_waiting(self) -> bool:
        """The poller's pump while receives wait for their messages (see PROBE_FIRST)."""
        found = self._probe_receives(self._probing)
        if not self._probing:
            self._poller.remove_pump(self._probe_waiting)
        return found

    def _probe_receives(self, receives: list[_Probing]) -> bool:
        """Let each of ``receives`` (in the order issued) look for its message; a message
        found goes to the first of them that takes its source and tag, as MPI matches.
        Return whether any found one; those that did leave the list."""
        status, found = self._status, False
        for receive in list(receives):
            if receive not in receives:
                continue  # given a message meanwhile
            try:
                message = self._comm.Improbe(receive[2], receive[3], status)
            except MPI.Exception as exc:
                receives.remove(receive)
                receive[0]._fail(classify(exc), exc)
                continue
            if message is None:
                continue
            sender = status.Get_source()
            owner = receive if len(receives) == 1 else next(
                r for r in receives if r[3] == receive[3] and r[2] in (sender, MPI.ANY_SOURCE))
            receives.remove(owner)
            self._take(owner, message, sender, status.Get_count(MPI.BYTE))
            found = True
        return found

    def _take(self, receive: _Probing, message: Any, sender: int, size: int) -> None:
        sink, tensor = receive[0], receive[1]
        if size <= AT_ONCE_BYTES and size <= tensor.nbytes:  # here whole: taken at once
            try:
                message.Recv(spec(tensor))
            except MPI.Exception as exc:
                sink._fail(self._classify(exc), exc)
                return
            sink._succeed(sender)
            return
        if size <= tensor.nbytes:
            self._watch(sink, message.Irecv(spec(tensor)), active=False)
            return
        scratch = bytearray(size)  # taken whole, and dropped
        refuse = functools.partial(reraise, truncated(sender, size, tensor.nbytes))
        self._watch(sink, message.Irecv([scratch, MPI.BYTE]), refuse, keep=scratch)

    def post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Posted:
        return _PostedRequest(self._comm.Isend(spec(tensor), dst, tag), tensor, self,
                              (self.rank, "send", dst, tag))

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Posted:
        what = (self.rank, "recv", src, tag)
        if self._probe_first:  # see PROBE_FIRST
            return _PostedProbe(self._comm, tensor, self, what)
        return _PostedRequest(self._comm.Irecv(spec(tensor), src, tag), tensor, self, what)

    # -- groups and lifecycle --------------------------------------------------------

    async def split(self, ranks: Sequence[int]) -> tuple[Backend, Backend] | None:
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        await self._reductions.settled()  # (a collective: after those held, see ``mpi_reduce``)
        comm = await self._loop.run_in_executor(None, self._comm.Split, color, key)
        if comm == MPI.COMM_NULL:
            return None
        own = await self._loop.run_in_executor(None, comm.Dup)
        return MpiBackend(comm, self._loop), MpiBackend(own, self._loop)

    async def shrink(self, failed: Callable[[], Sequence[int]], timeout: float
                     ) -> tuple[list[int], tuple[Backend, Backend]]:
        # MPICH as pip installs it has no fault tolerance (ULFM): its process manager ends
        # the survivors when a rank dies, even with -disable-auto-cleanup, and MPI_Init
        # fails with MPIR_CVAR_ENABLE_FT=1. An MPI that shrinks (MPIX_Comm_shrink) and keeps
        # the survivors alive is what this needs.
        library = " ".join(MPI.Get_library_version().split()[:3])
        raise NotImplementedError(
            f"rank {self.rank}: shrink: this MPI ({library}) "
            "cannot go on without a dead rank: it has no fault tolerance (ULFM's "
            "MPIX_Comm_shrink); use the gloo backend to survive a rank's death")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for posted in self.posted.pending():  # the threads waiting for receives return
            posted.cancel()
        self.posted.settle(timeout=2.0)
        _orphans.extend(self._poller.drain())  # (see ``_orphans``: nothing is cancelled)
        for sink, *_ in self._probing:  # (nothing posted: nothing to keep)
            sink._fail(CommClosedError, CommClosedError("the communicator was closed"))
        self._probing.clear()
        self._reductions.close()
        self._drop_unreceived()
        self._sends.close()  # (those in flight are the poller's orphans now)
        self._recvs.close()
        self._comm.Free()

    def _drop_unreceived(self) -> None:
        """Receive and drop the messages nobody received here, and say so.

        MPI gives a freed communicator's context to a later one, and a message
        left in MPI's queue would be received there (a later group's receive on
        the same tag got it, truncated). Closing is collective (every peer's
        goodbye is in first, see ``_core.link``), so what the peers sent is here.
        """
        status, dropped = MPI.Status(), []
        deadline = time.monotonic() + 1.0  # a large message may need its sender, which may
        while True:  # be gone or busy elsewhere: a second for them all, then left posted
            try:
                message = self._comm.Improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            except MPI.Exception:
                break
            if message is None:
                break
            dropped.append((status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)))
            buffer = bytearray(dropped[-1][2])
            try:
                request = message.Irecv([buffer, MPI.BYTE])
                while not request.Test():
                    if time.monotonic() > deadline:
                        _orphans.append((request, buffer, False))
                        break
            except MPI.Exception:
                pass  # its sender is gone already (a large message is read from its memory)
        if dropped:
            logging.getLogger("asyncomm").warning(
                "rank %d: %d message(s) nobody received on a communicator that closed, dropped "
                "(source, tag, bytes): %s", self.rank, len(dropped), dropped[:8])

    def link(self) -> Link:
        kind = ProbeLink if self._probe_first else PostedLink  # (see PostedLink's note)
        return kind(self, self._comm, self._loop, self._poller, classify)

    def abort_job(self, code: int) -> None:
        """End the job; this process ends here, at once, even where ``MPI_Abort`` returns.

        MPICH's returns once it has told the process manager, which kills the
        ranks a moment later: the error meanwhile went on up the stack, and
        under load Python began printing a second traceback before the kill.
        """
        if MPI.COMM_WORLD.Get_size() > 1:
            time.sleep(0.5)  # let the launcher forward this rank's last output
            try:
                MPI.COMM_WORLD.Abort(code)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


class _PostedRequest(Posted):
    """A send or receive a thread issued and waits for in ``MPI_Wait`` (the GIL released).

    It keeps its tensor alive: MPI has only its address (a tensor made for the call
    and dropped after it was freed while MPI wrote into it: heap corruption).
    """

    def __init__(self, request: Any, tensor: torch.Tensor, backend: MpiBackend,
                 what: tuple[int, str, int, int]) -> None:
        super().__init__(what, backend.posted, remembering(backend, classify))
        self._request = request
        self._tensor = tensor

    def _block(self) -> None:
        status = MPI.Status()
        self._request.Wait(status)
        if status.Is_cancelled():
            raise CommClosedError(f"{self.describe()}: cancelled")

    def cancel(self) -> None:
        if self._what[1] != "recv":
            return  # cancelling a send is erroneous in MPI
        with contextlib.suppress(MPI.Exception):  # completed (and freed by its wait) meanwhile
            self._request.Cancel()  # MPI ends the wait of the thread inside it


async def open_mpi(loop: asyncio.AbstractEventLoop) -> tuple[Backend, Backend]:
    """Duplicate ``MPI.COMM_WORLD`` twice: the user's communicator and asyncomm's own."""
    user = await loop.run_in_executor(None, MPI.COMM_WORLD.Dup)
    own = await loop.run_in_executor(None, MPI.COMM_WORLD.Dup)
    return MpiBackend(user, loop), MpiBackend(own, loop)


class _PostedProbe(Posted):
    """A receive a thread issued where receives probe first (see PROBE_FIRST): its wait
    looks for the message by matched probe, every ``LOOK_S``, and takes it if it fits."""

    LOOK_S = 50e-6

    def __init__(self, comm: Any, tensor: torch.Tensor, backend: MpiBackend,
                 what: tuple[int, str, int, int]) -> None:
        super().__init__(what, backend.posted, remembering(backend, classify))
        self._comm = comm
        self._tensor = tensor
        self._cancelled = threading.Event()

    def _block(self) -> None:
        status, (_, _, src, tag) = MPI.Status(), self._what
        while (message := self._comm.Improbe(src, tag, status)) is None:
            if self._cancelled.wait(self.LOOK_S):
                raise CommClosedError(f"{self.describe()}: cancelled")
        size = status.Get_count(MPI.BYTE)
        if size > self._tensor.nbytes:
            message.Recv([bytearray(size), MPI.BYTE])  # taken whole, and dropped
            raise MismatchError(f"{self.describe()}: {truncated(src, size, self._tensor.nbytes)}")
        message.Recv(spec(self._tensor))

    def cancel(self) -> None:
        self._cancelled.set()
