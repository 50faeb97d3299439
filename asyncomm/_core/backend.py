"""The backend interface: what a communicator asks of torch.distributed or MPI.

A ``Backend`` issues non-blocking primitives and reports each one's end to a ``Sink`` through one of
the progress engines. One is chosen when a communicator is made (``asyncomm._backends``); nothing
above asks which it is. Ranks, tags and buffers reach a backend already checked by ``Comm``: tensors
are contiguous, on the backend's device, with matching shapes.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncomm._core.errors import CommError, PeerFailedError, describe, gist
from asyncomm._core.handle import Classify, Sink
from asyncomm._core.ops import ReduceOp

if TYPE_CHECKING:
    from asyncomm._core.handle import Handle
    from asyncomm._core.link import Link

Tensors = Sequence[torch.Tensor]


class Posted(ABC):
    """A point-to-point operation issued by a thread other than the loop's, for it to wait on.

    ``Comm.post_send``/``post_recv`` give them, and take the same arguments as ``send``/
    ``recv`` (but a source must be named). No handle, no progress engine, no loop hop: a
    thread that runs a fixed sequence of computes and messages (a pipeline's driver, say)
    sends, and blocks on what it receives, as a program written against the backend would.
    Bad arguments raise ``ValueError``/``TypeError``, a closed communicator
    ``CommClosedError``, before anything is sent. The wait has no deadline of its own: it
    ends when the operation does, when a peer's failure fails it (gloo sees a peer's exit at
    once; under MPI the launcher ends the job), or when ``cancel`` or the communicator's
    close ends it (where the backend can). On gloo, wait for every posted operation before
    closing the communicator. A backend implements ``_block`` (and ``cancel`` where it can);
    ``wait`` keeps the communicator's ``InFlight`` count and words the backend's errors.
    """

    def __init__(self, what: tuple[int, str, int, int], in_flight: InFlight,
                 classify: Classify) -> None:
        self._what = what  # (rank, op, peer, tag): worded only on error
        self._in_flight = in_flight
        self._classify = classify
        in_flight.add(self)

    def wait(self) -> None:
        """Block the calling thread until the operation completes.

        Raises:
            CommError: (a subclass) it failed, or was cancelled (``CommClosedError``).
        """
        self._in_flight.enter()
        try:
            self._block()
        except CommError:
            raise
        except BaseException as exc:
            raise self._classify(exc)(f"{self.describe()}: {gist(exc)}") from exc
        finally:
            self._in_flight.leave(self)

    def describe(self) -> str:
        """Return who did what with whom: how its errors begin."""
        rank, op, peer, tag = self._what
        return describe(rank, op, None, peer, tag)

    @abstractmethod
    def _block(self) -> None:
        """Wait in the backend; raise its error, or ``CommError`` of asyncomm's own."""

    def cancel(self) -> None:  # noqa: B027
        """From any thread: end a pending receive, whose ``wait`` then raises
        ``CommClosedError``. Backends that cannot (gloo) leave it pending."""


class InFlight:
    """One communicator's ``Posted`` operations not waited for yet, and threads inside a wait
    (closing the communicator ends what it can of them first, and waits for the threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: set[Posted] = set()
        self.waiting = 0  # threads inside a wait

    def add(self, posted: Posted) -> None:
        with self._lock:
            self._pending.add(posted)

    def enter(self) -> None:
        with self._lock:
            self.waiting += 1

    def leave(self, posted: Posted) -> None:
        with self._lock:
            self.waiting -= 1
            self._pending.discard(posted)

    def pending(self) -> list[Posted]:
        """Return the operations no wait has seen complete yet."""
        with self._lock:
            return list(self._pending)

    def settle(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until no thread is inside a wait."""
        deadline = time.monotonic() + timeout
        while self.waiting and time.monotonic() < deadline:
            time.sleep(0.001)


class Backend(ABC):
    """One communicator of one backend: non-blocking primitives over ``size`` ranks."""

    name: str
    rank: int
    size: int
    max_tag: int  # the largest tag users may pass; tags above it are asyncomm's own
    raw: object
    cuda: bool = False  # whether it moves CUDA tensors (else CPU ones)
    # the first error that said a peer is gone, or that the backend halted: later
    # operations fail at once
    lost: BaseException | None = None
    dtypes: frozenset[torch.dtype] | None = None  # the dtypes it moves; None: every one
    ends_job_on_error: bool = False  # whether ``abort_job`` ends every rank's process
    # whether its link can tell that a peer is gone (``Link.probe``); else a dead peer ends
    # the whole job (MPI), and nobody is left to tell
    probes_peers: bool = False
    # whether its operations progress on the backend's own threads (torch's), not only when
    # the loop polls them (MPI)
    progresses_alone: bool = False

    def check_reduce(self, dtype: torch.dtype, op: ReduceOp, what: str) -> None:  # noqa: B027
        """Raise ``TypeError`` for reductions the backend lacks beyond the common rules."""

    # -- quick operations: see the note in ``Comm`` ---------------------------------

    quick: bool = False  # whether it has quick operations (``quick_send`` and the others)

    def quick_op(self, dtype: torch.dtype, op: ReduceOp) -> object | None:
        """Return what ``quick_all_reduce`` takes for ``op`` on ``dtype`` (``None``: it is not
        quick here; the backend has no quick path, or ``op`` needs a step after the reduction)."""
        return None

    def quick_all_reduce(self, tensor: object, ops: dict[torch.dtype, Any],
                         what: tuple[Any, ...]) -> Handle[Any] | None:
        """Issue an all-reduce of ``tensor`` as the user gave it (``Comm`` checked the rest) by
        ``ops[tensor.dtype]`` (``quick_op``'s), in the fewest steps: posted, then its handle
        made (named ``what``). ``None``: not issued, take the usual path (not a plain
        contiguous tensor in the backend's memory, or of a dtype ``ops`` lacks)."""
        return None

    def quick_send(self, tensor: object, dst: int, tag: int,
                   what: tuple[Any, ...]) -> Handle[Any] | None:
        """Issue a send as ``quick_all_reduce`` issues its all-reduce (``None``: not
        issued; as there, or not a dtype the backend moves)."""
        return None

    def quick_recv(self, tensor: object, src: int, tag: int,
                   what: tuple[Any, ...]) -> Handle[Any] | None:
        """Issue a receive from ``src`` as ``quick_send`` issues its send."""
        return None

    @abstractmethod
    def barrier(self, sink: Sink) -> None:
        """Issue a barrier."""

    @abstractmethod
    def broadcast(self, sink: Sink, tensor: torch.Tensor, src: int) -> None:
        """Issue a broadcast of ``tensor`` from ``src``."""

    @abstractmethod
    def all_reduce(self, sink: Sink, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Issue an in-place all-reduce."""

    @abstractmethod
    def reduce(self, sink: Sink, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        """Issue an in-place reduce to ``dst``."""

    @abstractmethod
    def all_gather(self, sink: Sink, out: Tensors, tensor: torch.Tensor) -> None:
        """Issue an all-gather of ``tensor`` into ``out`` (one per rank)."""

    @abstractmethod
    def gather(self, sink: Sink, out: Tensors | None, tensor: torch.Tensor, dst: int) -> None:
        """Issue a gather of ``tensor`` into ``out`` on ``dst`` (``None`` elsewhere)."""

    @abstractmethod
    def scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors | None,
                src: int) -> None:
        """Issue a scatter of ``chunks`` (on ``src``) into ``tensor``."""

    @abstractmethod
    def reduce_scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors,
                       op: ReduceOp) -> None:
        """Issue a reduce-scatter: ``tensor`` = reduction over ranks of ``chunks[rank]``."""

    @abstractmethod
    def all_to_all(self, sink: Sink, outputs: Tensors, inputs: Tensors) -> None:
        """Issue an all-to-all: ``outputs[j]`` receives rank j's ``inputs[rank]``."""

    @abstractmethod
    def send(self, sink: Sink, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Issue a send."""

    @abstractmethod
    def recv(self, sink: Sink, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        """Issue a receive; the sink gets the source rank (``src=None``: any source)."""

    @abstractmethod
    def post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Posted:
        """From any thread: send ``tensor`` (not to be written until the wait returns)."""

    @abstractmethod
    def post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Posted:
        """From any thread: receive into ``tensor`` from ``src``."""

    @abstractmethod
    async def split(self, ranks: Sequence[int]) -> tuple[Backend, Backend] | None:
        """Make the user's and asyncomm's communicators over ``ranks`` (sorted).

        Collective over this communicator; ``None`` on ranks not in ``ranks``.
        """

    async def shrink(self, failed: Callable[[], Sequence[int]], timeout: float
                     ) -> tuple[list[int], tuple[Backend, Backend]]:
        """Agree with the other survivors on who is alive (``failed()``: the ranks this one
        knows gone so far; asked again while waiting, from another thread); return them
        and the user's and asyncomm's communicators over them."""
        raise NotImplementedError(f"rank {self.rank}: shrink: the {self.name} backend cannot "
                                  "make a communicator of the survivors")

    @abstractmethod
    def link(self) -> Link:
        """Return a link carrying channel frames over this communicator (see ``link``)."""

    def stuck(self) -> list[int]:
        """Return the tags of receives in flight that only a peer's message can end, one entry
        per receive (gloo's any-source receives: see ``TorchBackend``'s note on teardown). A
        communicator about to close asks a live peer to ``release`` them."""
        return []

    def release(self, peer: int, tag: int) -> None:  # noqa: B027
        """Send ``peer`` the empty message that ends its stuck receive on ``tag``."""

    async def released(self, timeout: float) -> None:  # noqa: B027
        """Wait (up to ``timeout``) until no receive is stuck any more."""

    def on_halt(self, listener: Callable[[CommError], None]) -> None:  # noqa: B027
        """Call ``listener(error)`` on the loop if the backend halts: it can move nothing
        more in this process (gloo, when its own thread failed). Most never do."""

    def abort_job(self, code: int) -> None:  # noqa: B027
        """End the whole job after an uncaught error, where the launcher would not."""

    @abstractmethod
    def close(self) -> None:
        """Fail what is in flight, release the communicator and join threads. Idempotent."""


def nothing(_: object) -> object:
    """A finish that makes an operation's result ``None``, whatever it completed with."""
    return None


def remembering(backend: Backend, classify: Classify) -> Classify:
    """Wrap a backend's ``classify`` so that the first peer failure stays in ``backend.lost``."""
    def remember(exc: BaseException) -> type[CommError]:
        kind = classify(exc)
        if issubclass(kind, PeerFailedError) and backend.lost is None:
            backend.lost = exc
        return kind

    return remember
