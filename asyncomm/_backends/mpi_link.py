"""The MPI link: channel frames in messages sized exactly, taken from a receive kept posted
(``PostedLink``, MPICH) or found by matched probe (``ProbeLink``, Open MPI)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from asyncomm._core import tags
from asyncomm._core.errors import CommError, ProtocolError
from asyncomm._core.handle import Classify, Handle
from asyncomm._core.link import Link, Transport
from asyncomm._core.messages import PREAMBLE, Pending
from asyncomm._core.polling import Poller

DATATYPES: dict[torch.dtype, Any] = {
    torch.bool: MPI.C_BOOL,
    torch.uint8: MPI.UINT8_T,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T,
    torch.uint64: MPI.UINT64_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.float16: MPI.FLOAT16_T if MPI.FLOAT16_T != MPI.DATATYPE_NULL else MPI.INT16_T,
    torch.bfloat16: MPI.INT16_T,  # moved as 16-bit words; reduced by mpi_backend's operators
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}


_specs: dict[tuple[int, int, torch.dtype], list[Any]] = {}
_SPECS = 256  # the specs kept: a program's hot tensors are far fewer


def spec(tensor: torch.Tensor) -> list[Any]:
    """Return an mpi4py buffer spec over the tensor's own memory (the caller keeps it alive).

    A spec is only an address, a length and a datatype, owning nothing: the spec of the
    same memory as the same dtype is kept and given again (making one costs as much as the
    operation it describes), and is right for a tensor made anew at that address too.
    """
    key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype)
    made = _specs.get(key)
    if made is None:
        if len(_specs) >= _SPECS:
            _specs.clear()
        # (mpi4py divides counts among ranks itself)
        made = _specs[key] = [MPI.buffer.fromaddress(key[0], key[1]), DATATYPES[key[2]]]
    return made

MESSAGE_BYTES = 64 << 10  # the largest link message: frames up to about this travel in one
# A message found by probe up to this size is received with a blocking matched receive:
# MPI sends messages this small eagerly (with the match), so it is here whole and the
# receive returns at once; larger ones are received without blocking (see ``_take``).
AT_ONCE_BYTES = 1024
PACKET_FRAMES = 16  # a burst's packets go so often: the receiver decodes as the sender issues


class MpiLink(Link):
    """Link messages of at most ``MESSAGE_BYTES``, sized exactly, polled from the loop: what
    both forms share (sending, data receives); each finds link messages its own way
    (``pump``, one of the poller's pumps)."""

    def __init__(self, backend: Transport, comm: Any, loop: asyncio.AbstractEventLoop,
                 poller: Poller, classify: Classify) -> None:
        super().__init__(backend, loop, MESSAGE_BYTES - PREAMBLE.size)
        self._rank = backend.rank
        self._comm = comm
        self._poller = poller
        self._classify = classify
        self._status = MPI.Status()
        self._outbox.packet_frames = PACKET_FRAMES
        self._open = False

    def open(self, arrivals: Any, limits: Any) -> None:
        super().open(arrivals, limits)
        self._open = True
        self._poller.add_pump(self.pump)

    def stop(self) -> None:
        self._open = False
        self._poller.remove_pump(self.pump)
        self._buffers.clear()

    polls = True

    def spin_until(self, done: Callable[[], bool]) -> bool:
        return self._poller.spin_until(done)

    def refused(self) -> bool:
        return self._poller.refused()

    def expect(self) -> None:
        self._poller.kick()

    def _post(self, buffer: bytes | bytearray | torch.Tensor, dst: int,
              tag: int) -> Handle[None] | None:
        try:
            message = spec(buffer) if isinstance(buffer, torch.Tensor) else [buffer, MPI.BYTE]
            request = self._comm.Isend(message, dst, tag)
            if request.Test():
                return None  # the common case: small messages are sent at once
        except MPI.Exception as failure:  # refused as it was posted
            handle: Handle[None] = Handle(self._loop, (self._rank, "send", None, dst, tag), None)
            handle._fail(self._classify(failure), failure)
            return handle
        return self._watched(request, "send", dst, tag, buffer)

    def _fetch_into(self, pending: Pending, tensor: torch.Tensor, src: int) -> None:
        # MPI copies a large message into its receive on this rank's calls, mostly all in
        # the first test: the frame is then whole at once, with no handle made for it.
        try:
            request = self._comm.Irecv(spec(tensor), src, tags.LINK_DATA)
            if request.Test():
                pending.arrived()
                return
        except MPI.Exception as exc:
            pending.fail(self._classify(exc)(f"rank {self._rank}: data of a frame from rank "
                                             f"{src} lost: {exc}"))
            return
        self._watched(request, "recv", src, tags.LINK_DATA, tensor, active=False
                      ).add_done_callback(pending.received)

    def _watched(self, request: Any, op: str, peer: int, tag: int, buffer: object,
                 active: bool = True) -> Handle[None]:
        """Return the handle of ``request``, polled until done; it keeps ``buffer`` till then."""
        handle: Handle[None] = Handle(self._loop, (self._rank, op, None, peer, tag), None, buffer)
        self._poller.watch(request, handle, None, active)
        return handle

    def _refuse(self, src: int, error: ProtocolError) -> None:
        """A message from ``src`` could not be taken: its stream ends with ``error``."""
        assert self._arrivals is not None
        self._arrivals.refuse(src, error, None)

    @abstractmethod
    def pump(self) -> bool:
        """Take the link messages that are there (a poller's pump); return whether any
        was."""


class ProbeLink(MpiLink):
    """Link messages found by matched probe from any source (Open MPI: see ``PostedLink``).

    The poller probes at every poll (``MPI_Improbe``), so a message is taken as soon as it
    is there, with no receive standing, into a buffer of the size the probe reports (at most
    ``MESSAGE_BYTES``). A message not complete at once (only large ones) delays the later
    messages of its source until it is, so data receives are posted in the order sent.
    """

    def __init__(self, backend: Transport, comm: Any, loop: asyncio.AbstractEventLoop,
                 poller: Poller, classify: Classify) -> None:
        super().__init__(backend, comm, loop, poller, classify)
        self._behind: dict[int, asyncio.Task[None]] = {}  # last pending message per source

    def pump(self) -> bool:
        """Take the messages that are there; return whether any was.

        A packet of small messages ends the call (whoever waits for one goes on at once,
        without a last probe that finds nothing: the poller calls again while messages
        come); other messages are taken one after the other, so that the data receives of
        every frame announced are posted at once.
        """
        found = False
        comm, status = self._comm, self._status
        while self._open:
            try:
                message = comm.Improbe(MPI.ANY_SOURCE, tags.LINK_MESSAGE, status)
            except MPI.Exception:
                return found  # freed under us
            if message is None:
                break
            found = True
            if self._take(message, status.Get_source(), status.Get_count(MPI.BYTE)):
                break
        return found

    def _take(self, message: Any, src: int, nbytes: int) -> bool:
        """Receive a message found by probe; return whether it was a packet, taken whole."""
        if nbytes > MESSAGE_BYTES:  # no sender of ours sends it: taken and dropped unread
            # (whole: a receive that truncates a message killed Open MPI 5's process)
            buffer = bytearray(nbytes)
            try:
                request = message.Irecv([buffer, MPI.BYTE])
            except MPI.Exception:
                pass
            else:
                self._watched(request, "recv", src, tags.LINK_MESSAGE, buffer, active=False)
            self._refuse(src, ProtocolError(f"message of {nbytes} bytes from rank {src} "
                                            f"(the most is {MESSAGE_BYTES})"))
            return False
        buffer = bytearray(nbytes)
        before = self._behind.get(src) if self._behind else None
        if before is None and nbytes <= AT_ONCE_BYTES:  # the commonest: here whole already
            try:
                message.Recv([buffer, MPI.BYTE])
            except MPI.Exception as exc:
                self._lost(src, exc)
                return False
            return self._arrive(src, buffer)
        try:
            request = message.Irecv([buffer, MPI.BYTE])
            if before is None and request.Test():
                return self._arrive(src, buffer)
        except MPI.Exception as exc:
            self._lost(src, exc)
            return False
        # matched: not cancellable; its data is on its way
        handle = self._watched(request, "recv", src, tags.LINK_MESSAGE, buffer)
        task = self._loop.create_task(self._in_order(src, before, handle, buffer))
        self._behind[src] = task
        task.add_done_callback(functools.partial(self._forget, src))
        return False

    async def _in_order(self, src: int, before: asyncio.Task[None] | None, handle: Handle[None],
                        buffer: bytearray) -> None:
        if before is not None:
            await asyncio.wait([before])
        try:
            await handle
        except CommError as exc:
            self._lost(src, exc)
            return
        self._arrive(src, buffer)

    def _lost(self, src: int, error: BaseException) -> None:
        """A message from ``src`` was found but could not be received: its stream ends."""
        self._refuse(src, ProtocolError(f"message from rank {src} lost: {error}"))

    def _forget(self, src: int, task: asyncio.Task[None]) -> None:
        if self._behind.get(src) is task:
            del self._behind[src]


_posted: set[PostedLink] = set()  # links whose receive is posted: cancelled at exit at last


@atexit.register  # (registered after mpi4py's finalize, so it runs before it)
def _cancel_posted() -> None:
    """Stop the links of communicators never closed: MPI finalizes with no receive posted
    (UCX warned of each one left)."""
    for link in list(_posted):
        link.stop()


class PostedLink(MpiLink):
    """Link messages received into one buffer kept posted, from any source.

    Note on the posted receive
    --------------------------
    A persistent any-source receive of ``MESSAGE_BYTES`` stays started on the link's tag: MPI
    matches each message to it as it lands, and the poller finds it with one ``Test`` (a probe's
    matched receive costs a probe, a receive and a buffer sized from the probe). Each message is
    copied out and the receive started again at once, before the message is taken, so the next one
    lands in it; messages that come meanwhile wait in MPI's queue, in order (one source's messages
    match the receive in the order they were sent). No sender of ours sends a link message beyond
    ``MESSAGE_BYTES``; a larger one is cut short by MPI (``MPI_ERR_TRUNCATE``, its source known):
    refused as a probed one would be, and the receive goes on. Only where a truncated receive is
    safe (MPICH; Open MPI's crashed the process: ``mpi_backend.PROBE_FIRST``); elsewhere the link
    probes (``ProbeLink``).
    """

    def __init__(self, backend: Transport, comm: Any, loop: asyncio.AbstractEventLoop,
                 poller: Poller, classify: Classify) -> None:
        super().__init__(backend, comm, loop, poller, classify)
        self._slot = bytearray(MESSAGE_BYTES)
        self._posted: Any = None  # the persistent receive, while the link is open

    def open(self, arrivals: Any, limits: Any) -> None:
        self._posted = self._comm.Recv_init([self._slot, MPI.BYTE], MPI.ANY_SOURCE,
                                            tags.LINK_MESSAGE)
        self._posted.Start()
        _posted.add(self)
        super().open(arrivals, limits)

    def stop(self) -> None:
        posted, self._posted = self._posted, None
        _posted.discard(self)
        super().stop()
        if posted is None:
            return
        status = MPI.Status()
        try:
            posted.Cancel()
            posted.Wait(status)
            posted.Free()
        except MPI.Exception:
            return
        if not status.Is_cancelled():  # a message came as it stopped (after every goodbye)
            logging.getLogger("asyncomm").warning(
                "rank %d: a link message from rank %d (%d bytes) came after the link "
                "closed; dropped", self._rank, status.Get_source(), status.Get_count(MPI.BYTE))

    def pump(self) -> bool:
        """Take the message that is there, if any; return whether one was.

        One message a call (the poller calls again while messages come): a frame's receiver
        takes it, and frees its buffer for the next, before the next is fetched. (Taking all
        that are there, as ``ProbeLink`` does, would take a stream's envelopes in one call,
        and each data message would go into a fresh buffer.)
        """
        if not self._open:
            return False
        posted, status = self._posted, self._status
        try:
            if not posted.Test(status):
                return False
            src = status.Get_source()
            message: bytearray | None = self._slot[:status.Get_count(MPI.BYTE)]
        except MPI.Exception as exc:  # cut short: more than ``MESSAGE_BYTES``
            message, error = None, exc
            src = status.Get_source()
        try:
            posted.Start()
        except MPI.Exception as exc:  # (not seen: the receive completed above)
            self._receive_failed(exc)
        if message is None:
            self._refuse(src, ProtocolError(
                f"message from rank {src} beyond {MESSAGE_BYTES} bytes: {error}"))
        else:
            self._arrive(src, message)
        return True

    def _receive_failed(self, error: BaseException) -> None:
        """The posted receive could not be started again: nothing more is received."""
        self._open = False
        self._loop.call_exception_handler({
            "message": f"asyncomm: rank {self._rank}: the link's receive failed; "
                       "channel messages are no longer received",
            "exception": error})
