"""The gloo link's data lane: the bytes of large frames on connections of asyncomm's own.

Note on why
-----------
Large frames streamed through gloo's pairs fall well short of raw gloo ``isend``/``irecv``,
however little Python goes around them: the receiving rank's gloo I/O thread wakes many
times per message, and both ranks run out of CPU. So a frame's envelope still travels as a
gloo link message, and its data follows on the lane: one connection each way per pair of
ranks that exchange data, a *writer* thread per destination and a *reader* thread per
source. Over the socket alone (peers on other hosts) a reader costs about what gloo's I/O
thread does; see the note on memory for peers on one host.

Note on order and matching
--------------------------
A connection is FIFO and a source's data is asked for in the order of its envelopes (the listener's
order), so the n-th buffer read from a source is the n-th buffer it wrote to this rank: nothing is
tagged, and bytes written before their envelope arrives wait in the connection. Each direction has
its own connection and threads: a writer held by a receiver that does not read holds no other peer's
data, and no reader waits for a writer (no cycle of ranks can deadlock the lane).

Note on memory
--------------
Peers on one host (the same listening address) skip the socket's copies. First choice, *direct*: the
writer only says where a buffer is and how large (16 bytes on the socket); the reader copies it
straight out of the writer's process into its own buffer (``process_vm_readv``, one copy, without
the GIL) and says so (one byte), and the writer's ``done`` follows then (a thread per destination
hears it: the writer never waits). The sending rank then spends no CPU on the bytes, where a ring
costs a copy on each side. The reader takes the offer only after reading a token from where the
offer says (same host, same processes, and the kernel lets it: Yama's ``ptrace_scope`` >= 1 or a
container's seccomp forbid it); else it declines and the writer offers a *ring*: ``RING_BYTES`` of
shared memory per direction, the writer copying bytes in (``memmove``, without the GIL) and sending
the count written so far; the reader copies them out and sends back the count read once it has read
another quarter of the ring (the writer takes them every 16 copies, and whenever it runs low: they
never pile up unread). A file in ``/dev/shm`` carries the ring only for the handshake: the writer
unlinks it once the reader mapped it. A ring declined (another container's ``/dev/shm`` behind the
address), or none to be made, leaves the socket. ``ASYNCOMM_LANE_DIRECT=0`` skips the direct offer,
``ASYNCOMM_LANE_SHM=0`` both. The copies take the tensors' addresses and sizes only: a torch call
that lets the GIL go (``reshape``, ``view``) costs a hand-off between the loop and the lane's
threads. The reader takes a frame's buffers only when its bytes are next (``recv``'s ``take``), not
when its envelope came: a stream's buffers are then mostly the ones its receiver just freed, still
in the cache.

Note on connecting
------------------
Each rank listens on the address its gloo device uses, says where in the rendezvous store
(``lane/LABEL/RANK``) and connects to a peer the first time it has data for it (on the
writer thread: the store's ``get`` waits for the peer to say where it listens), saying its
rank first, then offering the ways above in turn (each answered: taken, or declined and the
next offered; the socket last). A source has one connection: another that says it comes
from that source is closed. A failure to connect, write or read fails that buffer and every
later one of that peer with a ``PeerFailedError`` (the peer died, or its host did); nothing
is retried: a lost buffer breaks its frame, and the peer's frames behind it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from asyncomm._core import shm
from asyncomm._core.errors import PeerFailedError

Done = Callable[[PeerFailedError | None], None]  # called on the lane's thread
_HELLO = struct.Struct("<iH")  # the connecting rank, and the length of its ring's name
_COUNT = struct.Struct("<Q")  # bytes written (or read) so far, on a ring's socket
RING_BYTES = 4 << 20  # a ring's shared memory
_CHUNK = RING_BYTES // 2  # the most bytes copied in before the reader is told
_NEXT = struct.Struct("<H")  # the length of the next offer, after one was declined
_MAPPED, _DECLINED = b"\x01", b"\x00"  # a reader's answer to an offer
_DIRECT = "direct "  # an offer to be read from: "direct PID ADDRESS TOKEN"
_WHERE = struct.Struct("<QQ")  # where a buffer is, and its size (read from there)
_TOOK = b"\x01"  # the reader's word that it copied a buffer out
_HELLO_S = 10.0  # the longest a hello may take


class Store(Protocol):
    """What the lane needs of torch's rendezvous store."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...


class Lane:
    """Connections of this rank's own to its peers, for the data of large frames."""

    def __init__(self, rank: int, store: Store, key: str, address: str,
                 shared: bool = True, direct: bool = True) -> None:
        self._rank = rank
        self._store = store
        self._key = key
        self._shared = shared  # peers on this host share memory (see the note on memory)
        self._direct = shared and direct and _READV is not None  # ... and read each other's
        self._lock = threading.Lock()
        self._writers: dict[int, _Queue] = {}
        self._readers: dict[int, _Queue] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        # the first failure of each peer whose connection broke (``GlooLink.probe`` reports it)
        self.lost: dict[int, PeerFailedError] = {}
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._server = socket.create_server((address, 0), family=family, backlog=64)
        self._host, port = self._server.getsockname()[:2]
        store.set(f"{key}/{rank}", f"{self._host} {port}")
        self._start(self._accept, "asyncomm-lane-accept")

    def send(self, dst: int, tensor: torch.Tensor, done: Done) -> None:
        """Write ``tensor``'s bytes to ``dst`` after what was sent it before; ``done`` follows."""
        items = self._writers.get(dst)
        if items is None:  # (the first to dst: its writer starts)
            items = self._queue(self._writers, dst)
            if self._claim(items):
                self._start(functools.partial(self._write, dst, items),
                            f"asyncomm-lane-to-{dst}")
        items.put((tensor, done))

    def recv(self, src: int, take: Callable[[], Sequence[torch.Tensor]], done: Done) -> None:
        """Read ``src``'s next bytes into the buffers ``take()`` returns (called when their
        bytes are next: see the note on memory), in order; ``done`` once all are full."""
        self._queue(self._readers, src).put((take, done))

    def close(self) -> None:
        """End the threads once done with what they were given (the listening one at once)."""
        with self._lock:
            self._closed = True
            queues = [*self._writers.values(), *self._readers.values()]
        for items in queues:
            items.put(None)
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` in all for the threads to end (after ``close``)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- threads ----------------------------------------------------------------------

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _queue(self, queues: dict[int, _Queue], peer: int) -> _Queue:
        """Return ``peer``'s queue, made once (the listener and the accepting thread ask)."""
        with self._lock:
            items = queues.get(peer)
            if items is None:
                items = queues[peer] = _Queue()
                if self._closed:  # (nothing more is read or written)
                    items.put(None)
            return items

    def _claim(self, items: _Queue) -> bool:
        """Return whether ``items`` had no thread to serve it (it has now)."""
        with self._lock:
            taken, items.served = items.served, True
        return not taken

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                if self._closed:
                    self._server.close()
                    return
                time.sleep(0.01)  # (out of descriptors, say: not a busy loop)
                continue
            try:
                src, stream = _welcome(sock)
            except (OSError, ValueError, struct.error, UnicodeDecodeError):
                sock.close()  # (not one of ours, or gone at once: its peer's reads will fail)
                continue
            items = self._queue(self._readers, src)
            if not self._claim(items):  # (src has a connection: this one is not its)
                stream.close()
                continue
            self._start(functools.partial(self._read, src, stream, items),
                        f"asyncomm-lane-from-{src}")

    def _read(self, src: int, stream: _In, items: _Queue) -> None:
        failure: PeerFailedError | None = None
        while (item := items.get()) is not None:
            take, done = item
            if failure is None:
                try:
                    for buffer in take():
                        stream.read(buffer)
                except OSError as exc:
                    failure = PeerFailedError(f"rank {self._rank}: data from rank {src} lost: "
                                              f"{exc}")
                    self.lost.setdefault(src, failure)
                    stream.close()  # (nothing more is read: the writer hears so at once)
            done(failure)
        if failure is None:
            stream.close()

    def _write(self, dst: int, items: _Queue) -> None:
        failure: PeerFailedError | None = None
        stream: _Out | None = None
        lost = f"rank {self._rank}: data to rank {dst} lost"
        while (item := items.get()) is not None:
            tensor, done = item
            if failure is None:
                try:
                    if stream is None:
                        stream = self._connect(dst, lost)
                    stream.write(tensor, done)  # (done: now, or once the reader took it)
                    continue
                except (OSError, RuntimeError, ValueError) as exc:
                    failure = PeerFailedError(f"{lost}: {exc}")
                    self.lost.setdefault(dst, failure)
            done(failure)
        if stream is not None:
            stream.close()

    def _connect(self, dst: int, lost: str) -> _Out:
        """Connect to ``dst``'s lane and agree on how bytes go: read by ``dst`` from this
        rank's buffers, else through a ring, else the socket (see the note on memory)."""
        host, port = self._store.get(f"{self._key}/{dst}").decode().split()
        sock = socket.create_connection((host, int(port)))
        _nodelay(sock)
        here = self._shared and host == self._host
        try:
            if here and self._direct and _DirectOut.offer(sock, self._rank):
                stream = _DirectOut(sock, lost, functools.partial(self.lost.setdefault, dst))
                self._start(stream.hear, f"asyncomm-lane-acks-{dst}")
                return stream
            said = here and self._direct  # (the hello went with the first offer)
            if here:
                try:
                    ring = shm.reserved_file(f"asyncomm-lane-{os.getpid()}-{dst}", RING_BYTES)
                except OSError:  # no shared memory here (or not enough): the socket alone
                    pass
                else:
                    return _RingOut.offer(sock, self._rank, said, *ring)
            sock.sendall(_offer(self._rank, said, b""))
            return _TcpOut(sock)
        except BaseException:
            sock.close()
            raise


def _welcome(sock: socket.socket) -> tuple[int, _In]:
    """Read a connecting peer's hello and offers; return its rank and the stream to read.

    The peer offers ways in turn (see the note on memory), the socket last (an empty offer).
    One this rank cannot take (another host's ring, or shared memory of its own: another
    container; a process it may not read) is declined, and the peer offers the next.
    """
    _nodelay(sock)
    sock.settimeout(_HELLO_S)  # (a stranger that says nothing holds no one up)
    src, named = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
    while named:
        name = _recv_exactly(sock, named).decode()
        try:
            stream: _In = (_DirectIn.accept(sock, name) if name.startswith(_DIRECT)
                           else _RingIn.accept(sock, name))
        except OSError:
            sock.sendall(_DECLINED)
            (named,) = _NEXT.unpack(_recv_exactly(sock, _NEXT.size))
            continue
        sock.settimeout(None)
        return src, stream
    sock.settimeout(None)
    return src, _TcpIn(sock)


def _offer(rank: int, said: bool, name: bytes) -> bytes:
    """The bytes of an offer (empty: the socket), after the hello unless ``said``."""
    return _NEXT.pack(len(name)) + name if said else _HELLO.pack(rank, len(name)) + name


# -- streams: a connection's bytes, through the socket or a ring of shared memory ----------


class _Out(Protocol):
    def write(self, tensor: torch.Tensor, done: Done) -> None: ...

    def close(self) -> None: ...


class _In(Protocol):
    def read(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class _Tcp:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def close(self) -> None:
        self._sock.close()


class _TcpOut(_Tcp):
    def write(self, tensor: torch.Tensor, done: Done) -> None:
        self._sock.sendall(_flat(tensor).numpy().data)
        done(None)


class _TcpIn(_Tcp):
    def read(self, tensor: torch.Tensor) -> None:
        view = _flat(tensor).numpy().data
        got, size = 0, len(view)
        while got < size:
            n = self._sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            if not n:
                raise ConnectionError("the connection closed")
            got += n


class _Ring:
    """A ring of shared memory, and the socket that says how far each end got."""

    def __init__(self, sock: socket.socket, fd: int) -> None:
        self._sock = sock
        try:  # (a file of another size, another version's, is not mapped: no SIGBUS later)
            if os.fstat(fd).st_size != RING_BYTES:
                raise OSError("a ring of another size")
            self._map = mmap.mmap(fd, RING_BYTES)
        finally:
            os.close(fd)
        self._ring = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = self._ring.data_ptr()
        self._done = 0  # bytes this end wrote (or read)
        self._told = 0  # bytes read that the writer was told of (the reader's)
        self._other = 0  # bytes the other end said it read (or wrote)
        self._said = bytearray(_COUNT.size * 512)
        self._kept = 0  # bytes of a count not read whole yet
        self._writes = 0  # copies in (the writer's)

    def _hear(self, block: bool) -> None:
        """Take the other end's counts (waiting for one if ``block``); keep the last."""
        view = memoryview(self._said)
        try:
            n = self._sock.recv_into(view[self._kept:], len(view) - self._kept,
                                     0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not n:
            raise ConnectionError("the connection closed")
        end = self._kept + n
        whole = end - end % _COUNT.size
        if whole:
            (self._other,) = _COUNT.unpack_from(self._said, whole - _COUNT.size)
        self._kept = end - whole
        self._said[:self._kept] = self._said[whole:end]

    def close(self) -> None:
        self._sock.close()
        del self._ring
        with contextlib.suppress(BufferError):  # (a view still lives: the mapping goes with it)
            self._map.close()


class _RingOut(_Ring):
    @staticmethod
    def offer(sock: socket.socket, rank: int, said: bool, fd: int, path: str) -> _Out:
        """Name the ring at ``path`` to the peer; return it once the peer mapped it (the
        socket alone if it declined)."""
        try:
            sock.sendall(_offer(rank, said, os.path.basename(path).encode()))
            answer = _recv_exactly(sock, 1)
            if answer == _DECLINED:
                sock.sendall(_offer(rank, True, b""))
        except OSError:
            os.close(fd)
            raise
        finally:
            os.unlink(path)  # (the peer mapped it, or never will)
        if answer == _DECLINED:
            os.close(fd)
            return _TcpOut(sock)
        return _RingOut(sock, fd)

    def write(self, tensor: torch.Tensor, done: Done) -> None:
        sent, size, address = 0, tensor.nbytes, tensor.data_ptr()  # (see the note on memory)
        while sent < size:
            free = RING_BYTES - (self._done - self._other)
            if free < min(size - sent, _CHUNK):
                self._hear(block=True)
                continue
            at = self._done % RING_BYTES
            n = min(free, size - sent, RING_BYTES - at, _CHUNK)
            ctypes.memmove(self._base + at, address + sent, n)  # (without the GIL)
            self._done += n
            sent += n
            self._sock.sendall(_COUNT.pack(self._done))
            self._writes += 1
            if not self._writes % 16 or free - n < RING_BYTES // 2:
                self._hear(block=False)  # (the reader's counts never pile up unread)
        done(None)


class _RingIn(_Ring):
    @classmethod
    def accept(cls, sock: socket.socket, name: str) -> _RingIn:
        """Map the ring the peer made (named in its hello); say so."""
        if "/" in name or not name.startswith("asyncomm-lane-"):
            raise ValueError(f"not a ring: {name!r}")
        ring = cls(sock, os.open(os.path.join(shm.FOLDER, name), os.O_RDWR))
        sock.sendall(_MAPPED)
        return ring

    def read(self, tensor: torch.Tensor) -> None:
        got, size, address = 0, tensor.nbytes, tensor.data_ptr()
        while got < size:
            ready = self._other - self._done
            if not ready:
                self._hear(block=True)
                continue
            at = self._done % RING_BYTES
            n = min(ready, size - got, RING_BYTES - at)
            ctypes.memmove(address + got, self._base + at, n)
            self._done += n
            got += n
            if self._done - self._told >= RING_BYTES // 4:
                self._told = self._done
                self._sock.sendall(_COUNT.pack(self._done))


class _DirectOut(_Tcp):
    """Says where each buffer is; the reader copies it out of this process and says so
    (``_TOOK``, heard on a thread of its own: ``hear``), and its ``done`` follows then."""

    @staticmethod
    def offer(sock: socket.socket, rank: int) -> bool:
        """Offer to be read from; return whether the peer could (it read a token)."""
        token = secrets.token_bytes(16)
        kept = ctypes.create_string_buffer(token, len(token))  # (alive until answered)
        name = f"{_DIRECT}{os.getpid()} {ctypes.addressof(kept)} {token.hex()}"
        sock.sendall(_offer(rank, False, name.encode()))
        return _recv_exactly(sock, 1) == _MAPPED

    def __init__(self, sock: socket.socket, lost: str,
                 losing: Callable[[PeerFailedError], object]) -> None:
        super().__init__(sock)
        self._lost = lost  # what a failure says
        self._losing = losing  # told of the failure that lost buffers (``Lane.lost``)
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[torch.Tensor, Done]] = collections.deque()
        self._failure: PeerFailedError | None = None
        self._users = 2  # the writer and ``hear``: the last one done closes the socket

    def write(self, tensor: torch.Tensor, done: Done) -> None:
        with self._lock:
            if self._failure is not None:
                raise ConnectionError("the connection failed earlier")
            self._pending.append((tensor, done))  # (kept alive until the reader took it)
        try:
            self._sock.sendall(_WHERE.pack(tensor.data_ptr(), tensor.nbytes))
        except OSError as exc:
            self._fail(exc)

    def hear(self) -> None:
        """Hear the reader take buffers, in order (a thread of its own, until the end)."""
        took = bytearray(512)
        try:
            while n := self._sock.recv_into(took):
                for _ in range(n):
                    with self._lock:
                        _, done = self._pending.popleft()
                    done(None)
            raise ConnectionError("the connection closed")  # (nothing more is taken)
        except (OSError, IndexError) as exc:  # (IndexError: told of a buffer never sent)
            self._fail(exc)
        finally:
            self._leave()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = PeerFailedError(f"{self._lost}: {exc}")
            failed, self._pending = self._pending, collections.deque()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # (``hear`` ends too)
        if failed:  # (a connection that ends with nothing pending lost nothing)
            self._losing(self._failure)
        for _, done in failed:
            done(self._failure)

    def close(self) -> None:
        """Nothing more to write: the reader's word on what it has still comes."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._leave()

    def _leave(self) -> None:
        with self._lock:
            self._users -= 1
            last = not self._users
        if last:  # (never closed under a thread that still uses it: no descriptor reused)
            self._sock.close()


class _DirectIn(_Tcp):
    """Copies each buffer out of the writer's process (``process_vm_readv``), then says so."""

    @classmethod
    def accept(cls, sock: socket.socket, name: str) -> _DirectIn:
        """Read the token the peer's offer says where to find; take the offer if it is
        there (this process may read the peer's: same host, same processes, allowed)."""
        _, pid, address, token = name.split()
        expected = bytes.fromhex(token)
        got = ctypes.create_string_buffer(len(expected))
        _copy_from(int(pid), ctypes.addressof(got), int(address), len(expected))
        if got.raw != expected:
            raise OSError("another process's memory")
        sock.sendall(_MAPPED)
        return cls(sock, int(pid))

    def __init__(self, sock: socket.socket, pid: int) -> None:
        super().__init__(sock)
        self._pid = pid

    def read(self, tensor: torch.Tensor) -> None:
        address, size = _WHERE.unpack(_recv_exactly(self._sock, _WHERE.size))
        if size != tensor.nbytes:
            raise ConnectionError(f"a buffer of {size} bytes where {tensor.nbytes} were next")
        if size:
            _copy_from(self._pid, tensor.data_ptr(), address, size)
        self._sock.sendall(_TOOK)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("size", ctypes.c_size_t)]


def _vm_readv() -> Any:
    """``process_vm_readv`` (Linux), or ``None``."""
    try:
        call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    iov = ctypes.POINTER(_Iovec)
    call.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    call.restype = ctypes.c_ssize_t
    return call


_READV = _vm_readv()


def _copy_from(pid: int, into: int, address: int, size: int) -> None:
    """Copy ``size`` bytes at ``address`` in process ``pid`` to ``into`` (without the GIL)."""
    if _READV is None:
        raise OSError("no process_vm_readv here")
    done = 0
    while done < size:
        local = _Iovec(into + done, size - done)
        remote = _Iovec(address + done, size - done)
        n = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            error = ctypes.get_errno() if n < 0 else 0
            raise OSError(error, os.strerror(error) if error else "nothing read")
        done += n


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    if size and sock.recv_into(data, size, socket.MSG_WAITALL) != size:
        raise ConnectionError("the connection closed")
    return bytes(data)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor, as a flat uint8 tensor on its memory."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class _Queue(queue.SimpleQueue[Any]):
    """A peer's queue of buffers, and whether a thread serves it yet."""

    served = False


def _nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
