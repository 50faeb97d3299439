"""``Comm``: check arguments, issue operations in call order, hand back ``Handle``s."""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from asyncomm._comm.collectives import Buffer, Collectives
from asyncomm._comm.peers import Peers
from asyncomm._core import instrument, settings, tags
from asyncomm._core.arguments import Arguments
from asyncomm._core.backend import Backend, Posted
from asyncomm._core.errors import CommClosedError, CommError, MismatchError, PeerFailedError
from asyncomm._core.handle import FROM_BACKEND, Deadlines, Handle
from asyncomm._messaging.actors import Actor, ActorRef, Host
from asyncomm._messaging.channels import Channel, codec_of
from asyncomm._messaging.meshes import Mesh
from asyncomm._messaging.router import Router
from asyncomm._observe import recorder, status, watchdog
from asyncomm._observe.checks import Checker, checked

T = TypeVar("T")
_log = logging.getLogger("asyncomm")


class Comm(Collectives, Peers):
    """A communicator: this rank's view of a group of ranks, with awaitable operations.

    Every operation is issued when it is called, in program order, and
    returns a ``Handle``; ``await`` it for the result. Arguments are checked
    before anything is sent: bad ones raise ``ValueError``/``TypeError`` at
    the call and leave the communicator usable.

    Note on quick operations
    ------------------------
    ``all_reduce``, ``send`` and ``recv`` of a plain contiguous CPU tensor,
    with plain int ranks and tags in range and no deadline of their own, are
    issued in the fewest steps where the backend has a quick path (MPI): the
    rank and tag checks here (``_quickly``), the tensor's in the backend, the
    operation posted before its handle is made, the handle numbered after.
    Everything else (arrays, a ``timeout=``, any source, tracing, debug mode,
    a peer lost, a closed communicator, the first all-reduce of an (op, dtype))
    takes the usual path, which checks and words the errors. MPI's quick sends and receives
    start persistent requests (see ``_backends.mpi_kept``).
    """

    def __init__(self, backend: Backend, own: Backend, loop: asyncio.AbstractEventLoop,
                 timeout: float, label: str = "w0", world_ranks: Sequence[int] | None = None,
                 addresses: Sequence[str] = ()) -> None:
        self._backend = backend
        self._rank = backend.rank  # (the hot path's copy)
        self._own = own  # asyncomm's private twin: objects and groups travel here
        self._loop = loop
        self._timeout = timeout
        self._seq = 0
        self._last_op = ""  # what ``_seq`` numbered, and its tensor (for ``_status``)
        self._last_tensor: object = None
        self._closed = False
        self._children: list[Comm] = []  # open groups split from this one
        self._parent: Comm | None = None
        self._groups = 0  # groups split off so far: names the next one's label
        self._chain: asyncio.Future[Any] | None = None  # last multi-step op on ``_own``
        self._args = Arguments(backend, timeout)
        # per op given, per dtype: the backend's own reduction, where all_reduce is quick
        self._quick_ops: dict[object, dict[torch.dtype, object]] = {}
        # (the quick path's copies of the backend's facts: the ranks a point-to-point
        # operation may name, the largest tag)
        self._peers = frozenset(range(backend.size)) - {self._rank}
        self._max_tag = backend.max_tag
        # Diagnostics (see _status): the same label on every member, each member's rank in
        # the world it was split from, and where each rank of that world answers.
        self._label = label
        self._world_ranks = list(range(backend.size) if world_ranks is None else world_ranks)
        self._addresses = list(addresses)
        chosen = settings.read()
        self._timed_out: collections.deque[tuple[tuple[Any, ...], float]] = (
            collections.deque(maxlen=4))  # the last operations whose deadline passed
        self._deadlines = Deadlines(loop, self._expired, self._timeout, chosen.stall_s,
                                    self._stalled,
                                    chosen.probe_s if own.probes_peers else 0.0, self._check_peers)
        status.register(label, self._status)
        status.on_failure(self._told)
        self._checker: Checker | None = None
        if chosen.debug:
            self._checker = Checker(backend, loop)
            watchdog.watch(loop, f"rank {backend.rank}")
        # see the note on quick operations (false once closed: the usual path says so)
        self._quick = backend.quick and self._checker is None
        # Every communicator routes channel frames, so that closing is symmetric: each
        # router waits for every other's goodbye (see the note on closing in _core.link).
        recorder.start_from_env()  # before the instrument: traced from the first operation
        self._instrument = instrument.Instrument(backend.rank, backend.size, backend.name)
        self._router = Router(backend.rank, backend.size, own.link(), backend, self._instrument,
                              chosen.probe_s)
        self._router.on_dead.append(self._peer_died)
        backend.on_halt(self._halted)
        if own is not backend:
            own.on_halt(self._halted)
        self._failed: set[int] = set()  # see ``failed``
        self._hold = self._held  # every handle's (``Peers._held``): bound once, not per op
        self._router.stall_s, self._router.explain = chosen.stall_s, self._peers_say
        # Eager too: a call to an actor not served (yet) fails the same way on every rank.
        self._host = Host(self._router, self.rank, timeout)
        self._channels: dict[int, Channel] = {}

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<Comm {self.backend} rank {self.rank} of {self.size}{state}>"

    @property
    def rank(self) -> int:
        """This rank's number in the communicator, ``0 <= rank < size``."""
        return self._rank

    @property
    def size(self) -> int:
        """How many ranks the communicator spans."""
        return self._backend.size

    @property
    def backend(self) -> str:
        """``"gloo"``, ``"nccl"`` or ``"mpi"``."""
        return self._backend.name

    @property
    def raw(self) -> Any:
        """The underlying ``torch.distributed.ProcessGroup`` or ``mpi4py.MPI.Comm``."""
        return self._backend.raw

    @property
    def max_tag(self) -> int:
        """The largest tag point-to-point operations accept."""
        return self._backend.max_tag

    @property
    def timeout(self) -> float:
        """The default deadline of every operation, in seconds."""
        return self._timeout

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _open(self, op: str) -> None:
        if self._closed:
            raise CommClosedError(f"{self._args.what(op)}: the communicator is closed")

    # -- issuing ------------------------------------------------------------------

    def _issue(self, op: str, start: Callable[..., None], args: tuple[Any, ...], result: Any,
               keep: object, timeout: float | None, peer: int | None = None,
               tag: int | None = None) -> Handle[Any]:
        """Check the deadline, then start ``op`` on the backend: ``start(handle, *args)``."""
        if timeout is not None:
            timeout = self._args.deadline(timeout, op)
        self._open(op)
        self._seq = seq = self._seq + 1
        self._last_op, self._last_tensor = op, keep
        handle: Handle[Any] = Handle(self._loop, (self._rank, op, seq, peer, tag), result, keep)
        handle._hold = self._hold
        trace = self._instrument.recording
        if trace is not None:  # before starting: an eager send may finish inside
            trace.issued(handle, self._instrument.id, keep)
        if self._checker is not None and checked(op):  # debug mode: see _checks
            self._checker.submit(handle, op, args,
                                 lambda: self._start(handle, start, args, deferred=True))
        else:
            self._start(handle, start, args)
        if not handle.done():  # many operations (eager sends) are done at once
            self._deadlines.add(handle, self._timeout if timeout is None else timeout)
        return handle

    def _start(self, handle: Handle[Any], start: Callable[..., None], args: tuple[Any, ...],
               deferred: bool = False) -> None:
        """Start an operation on the backend; a bad argument raises unless it was deferred."""
        lost = self._backend.lost
        if lost is not None:  # a peer is gone, or the backend halted: fail now, not wait
            if isinstance(lost, MismatchError):
                handle._fail(MismatchError, CommError(f"an earlier operation failed: {lost}"))
            else:
                handle._fail(PeerFailedError, CommError(f"a peer failed earlier: {lost}"))
            return
        try:
            start(handle, *args)
        except (TypeError, ValueError) as exc:
            if deferred:
                handle._fail(CommError, exc)
                return
            handle._settle(2, None)  # never started
            raise
        except Exception as exc:
            handle._fail(type(exc) if isinstance(exc, CommError) else CommError, exc)

    # -- point to point -------------------------------------------------------------

    def send(self, tensor: torch.Tensor | np.ndarray, dst: int,  # type: ignore[type-arg]
             tag: int = 0, *, timeout: float | None = None) -> Handle[None]:
        """Send ``tensor`` to ``dst``; the handle completes when the buffer may be reused.

        Args:
            tensor: a tensor (or NumPy array) sent from its own memory; not to be written
                until the handle completes.
            dst: the receiving rank (not this one).
            tag: matches the receiver's ``tag``.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``None`` once ``tensor`` may be reused.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, CommClosedError: from the handle.
        """
        if timeout is None and self._quick:  # see the note on quick operations
            quick = self._quickly("send", self._backend.quick_send, tensor, dst, tag)
            if quick is not None:
                return quick
        t = self._args.tensor(tensor, "send", writes=False)
        dst = self._args.peer(dst, "send", "dst", self_ok=False)
        tag = self._args.tag(tag, "send")
        return self._issue("send", self._backend.send, (t, dst, tag), None, t, timeout, peer=dst,
                           tag=tag)

    def recv(self, tensor: torch.Tensor | np.ndarray,  # type: ignore[type-arg]
             src: int | None = None, tag: int = 0, *, timeout: float | None = None) -> Handle[int]:
        """Receive into ``tensor`` from ``src``; the handle resolves to the source rank.

        Args:
            tensor: a tensor (or NumPy array) received into in place.
            src: the sending rank; ``None``: any rank.
            tag: matches the sender's ``tag``.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to the source rank once ``tensor`` holds the message.

        Raises:
            TypeError, ValueError: bad arguments, before anything is posted.
            MismatchError: the message is larger than ``tensor`` (from the handle).
            CommTimeoutError, PeerFailedError, CommClosedError: from the handle.
        """
        if timeout is None and self._quick and src is not None:  # see the note
            quick = self._quickly("recv", self._backend.quick_recv, tensor, src, tag)
            if quick is not None:
                return quick
        t = self._args.tensor(tensor, "recv")
        peer = None if src is None else self._args.peer(src, "recv", "src", self_ok=False)
        tag = self._args.tag(tag, "recv")
        return self._issue("recv", self._backend.recv, (t, peer, tag), FROM_BACKEND, t, timeout,
                           peer=peer, tag=tag)

    def _quickly(self, op: str, quick: Callable[..., Handle[Any] | None], tensor: object,
                 peer: int, tag: int) -> Handle[Any] | None:
        """``send``'s or ``recv``'s quick path (see the note); ``None``: take the usual one."""
        if (type(peer) is int and type(tag) is int and peer in self._peers
                and 0 <= tag <= self._max_tag and self._instrument.recording is None):
            seq = self._seq + 1
            handle = quick(tensor, peer, tag, (self._rank, op, seq, peer, tag))
            if handle is not None:
                self._seq, self._last_op, self._last_tensor = seq, op, tensor
                if not handle._state:
                    handle._hold = self._hold
                    self._deadlines.add_default(handle)
                return handle
        return None

    def post_send(self, tensor: Buffer, dst: int, tag: int = 0) -> Posted:
        """Post a send from a thread that is not the loop's (a compute thread).

        Args:
            tensor: sent from its own memory; not to be written until ``wait()`` returns.
            dst: the receiving rank (not this one).
            tag: matches the receiver's ``tag``.

        Returns:
            A ``Posted``: its ``wait()`` blocks the calling thread until the send is done.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommClosedError: the communicator is closed.
        """
        return self._post("send", self._args.tensor(tensor, "send", writes=False), dst, tag)

    def post_recv(self, tensor: Buffer, src: int, tag: int = 0) -> Posted:
        """Post a receive into ``tensor`` from a thread that is not the loop's.

        Args:
            tensor: the buffer; it holds the message once ``wait()`` returns.
            src: the sending rank (not this one).
            tag: matches the sender's ``tag``.

        Returns:
            A ``Posted``: its ``wait()`` blocks the calling thread until the data is in.

        Raises:
            TypeError, ValueError: bad arguments, before anything is posted.
            CommClosedError: the communicator is closed.
        """
        return self._post("recv", self._args.tensor(tensor, "recv"), src, tag)

    def _post(self, op: str, t: torch.Tensor, peer: int, tag: int) -> Posted:
        name, post = ("dst", self._backend.post_send) if op == "send" else (
            "src", self._backend.post_recv)
        peer, tag = self._args.peer(peer, op, name, self_ok=False), self._args.tag(tag, op)
        self._open(op)
        return post(t, peer, tag)

    # -- objects and groups: multi-step operations on the private twin ----------------

    def _steps(self, op: str, body: Callable[[], Awaitable[T]],
               timeout: float | None) -> Handle[T]:
        """Run ``body`` after the previous multi-step operation, as one ``Handle``."""
        # starts nothing: the handle of a multi-step operation is settled by its task
        handle: Handle[T] = self._issue(op, lambda _: None, (), FROM_BACKEND, None, timeout)
        previous = self._chain

        async def run() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            try:
                value = await body()
            except Exception as exc:
                handle._fail(type(exc) if isinstance(exc, CommError) else CommError, exc)
            else:
                handle._succeed(value)

        self._chain = self._loop.create_task(run())
        return handle

    def channel(self, tag: int, codec: str = "default", *, timeout: float | None = None,
                senders: Iterable[int] | None = None) -> Channel:
        """Return the channel ``tag`` of this communicator (one object per tag).

        Args:
            tag: any int from 0 to 2**62 - 1 (channels are not limited by ``max_tag``).
            codec: ``"default"`` carries tensors, arrays, bytes, str, numbers, ``None``
                and lists/tuples/dicts of these, and never unpickles; ``"pickle"``
                carries any picklable object (trusted peers only).
            timeout: the default deadline of its sends (for credit) and receives.
            senders: the ranks that send on it; a receive from any rank (``async for``)
                ends once they have closed it (default: every other rank).

        Returns:
            The ``Channel``; the same object again for the same tag.

        Raises:
            ValueError: a bad tag, codec or rank, or the channel is open already with
                another codec or other senders.
            CommClosedError: the communicator is closed.
        """
        tag = self._args.tag(tag, "channel", tags.MAX_CHANNEL)
        wanted = codec_of(codec)
        who = None if senders is None else frozenset(
            self._args.peer(r, "channel", "senders") for r in senders)
        self._open("channel")
        existing = self._channels.get(tag)
        if existing is not None:
            if existing.codec is not wanted or who not in (None, existing.senders):
                raise ValueError(f"{self._args.what('channel')}: channel {tag} is open with codec "
                                 f"{existing.codec.name.lower()}, senders {existing.senders}")
            return existing
        made = Channel(self._router, tag, wanted, self._args.deadline(timeout, "channel"),
                       user=True, senders=who)
        self._channels[tag] = made
        return made

    def flush(self) -> None:
        """Send the small channel messages and actor calls issued so far now (on gloo,
        the heads of large messages too). The first to each rank leaves at once; those
        after it, when the loop iteration ends or a task of this rank begins to wait for
        a message. Call this before blocking the loop (a raw blocking call on
        ``comm.raw``) after a burst of sends if a peer needs them meanwhile.
        """
        self._router.link.flush()

    def serve(self, actor: Actor, name: str) -> None:
        """Serve ``actor`` on this rank under ``name``; any rank calls it through ``actor()``.

        Args:
            actor: the object whose ``@endpoint`` methods are served.
            name: the name callers give (unique on this rank).

        Raises:
            TypeError: ``actor`` is not an ``asyncomm.Actor``.
            ValueError: ``name`` is served already, or not a non-empty str.
            CommClosedError: the communicator is closed.
        """
        self._open("serve")
        self._host.serve(actor, name)

    def actor(self, rank: int, name: str) -> ActorRef:
        """Return a reference to the actor ``name`` served on ``rank``: ``await ref.method()``.

        Args:
            rank: the rank that serves it.
            name: the name it is served under.

        Returns:
            An ``ActorRef``; a call through it fails with ``RemoteError`` if the method
            raised, with ``PeerFailedError`` if ``rank`` is gone.

        Raises:
            ValueError: a bad rank or name.
            CommClosedError: the communicator is closed.
        """
        rank = self._args.peer(rank, "actor", "rank")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self._args.what('actor')}: name must be a non-empty str")
        self._open("actor")
        return ActorRef(self._host, rank, name)

    async def _exchange(self, payload: bytes, op: str) -> list[bytes]:
        """Gather ``payload`` from every rank on the private twin (numbering no operation)."""
        own, size = self._own, self.size
        mine = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [s.view(1) for s in torch.empty(size, dtype=torch.int64).unbind(0)]
        await self._own_op(op, own.all_gather, sizes, mine)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = list(torch.empty((size, longest), dtype=torch.uint8).unbind(0))
        await self._own_op(op, own.all_gather, rows, padded)
        return [row[: int(n.item())].numpy().tobytes() for row, n in zip(rows, sizes, strict=True)]

    async def _own_op(self, op: str, start: Callable[..., None], *args: Any) -> None:
        handle: Handle[None] = Handle(self._loop, (self.rank, op, self._seq, None, None), None,
                                      args)
        start(handle, *args)
        await handle

    def _pickle(self, obj: Any, op: str) -> bytes:
        try:
            return pickle.dumps(obj, protocol=5)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError(f"{self._args.what(op)}: cannot pickle {type(obj).__name__}: {exc}") \
                from exc

    def broadcast_object(self, obj: Any, src: int, *, timeout: float | None = None) -> Handle[Any]:
        """Send a picklable object from ``src`` to every rank (pickled: every rank trusts
        every other, as with torch).

        Args:
            obj: the object, on ``src`` (ignored elsewhere).
            src: the rank it comes from.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``src``'s object.

        Raises:
            TypeError: ``obj`` cannot be pickled (on ``src``, before anything is sent).
            ValueError: a bad rank.
        """
        src = self._args.peer(src, "broadcast_object", "src")
        payload = self._pickle(obj, "broadcast_object") if self.rank == src else b""
        own = self._own

        async def body() -> Any:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            await self._own_op("broadcast_object", own.broadcast, size, src)
            if self.rank == src:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            else:
                data = torch.empty(int(size.item()), dtype=torch.uint8)
            await self._own_op("broadcast_object", own.broadcast, data, src)
            return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

        return self._steps("broadcast_object", body, timeout)

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Handle[list[Any]]:
        """Gather a picklable object from every rank (pickled, as ``broadcast_object``).

        Args:
            obj: this rank's object.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to every rank's object, in rank order.

        Raises:
            TypeError: ``obj`` cannot be pickled (before anything is sent).
        """
        payload = self._pickle(obj, "all_gather_object")

        async def body() -> list[Any]:
            return [pickle.loads(data)
                    for data in await self._exchange(payload, "all_gather_object")]

        return self._steps("all_gather_object", body, timeout)

    def group(self, ranks: Iterable[int], *, timeout: float | None = None
              ) -> Handle[Comm | None]:
        """Make a communicator over ``ranks``, renumbered 0..k-1 in ascending order; every
        rank of this communicator calls it.

        Args:
            ranks: ranks of this communicator, no duplicates.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to the new ``Comm`` on members, ``None`` elsewhere.

        Raises:
            TypeError, ValueError: bad ranks, before anything is sent.
        """
        members = self._members(ranks, "group")
        self._groups += 1  # on every rank, member or not: labels must agree
        label = f"{self._label}.{self._groups}"

        async def body() -> Comm | None:
            made = await self._own.split(members)
            return None if made is None else self._child(made, members, label)

        return self._steps("group", body, timeout)

    def _members(self, ranks: Iterable[int], op: str) -> list[int]:
        """``ranks``, checked (ranks of this communicator, no duplicates, not none), sorted."""
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise TypeError(f"{self._args.what(op)}: ranks must be an iterable of ints")
        members = sorted(self._args.peer(r, op, "rank") for r in ranks)
        if not members:
            raise ValueError(f"{self._args.what(op)}: ranks is empty")
        if len(set(members)) != len(members):
            raise ValueError(f"{self._args.what(op)}: ranks has duplicates: {members}")
        return members

    def _child(self, made: tuple[Backend, Backend], members: list[int], label: str) -> Comm:
        child = Comm(made[0], made[1], self._loop, self._timeout, label,
                     [self._world_ranks[r] for r in members], self._addresses)
        child._parent = self
        self._children.append(child)
        return child

    # -- surviving a dead rank -------------------------------------------------------

    @property
    def failed(self) -> frozenset[int]:
        """The ranks known to have failed: dead, or raised and said so (see ``shrink``)."""
        return frozenset(self._failed)

    async def shrink(self, *, timeout: float | None = None) -> Comm:
        """Make a communicator of the ranks still alive, in order, renumbered 0..k-1; every
        surviving rank calls it once a rank has failed, and they agree on who is alive.

        Args:
            timeout: seconds to agree (default: the communicator's).

        Returns:
            The new ``Comm``.

        Raises:
            NotImplementedError: the backend cannot go on without a rank (MPI without
                fault tolerance).
            CommTimeoutError: the survivors did not agree in time.
        """
        self._open("shrink")
        limit = self._args.deadline(timeout, "shrink")
        self._groups += 1  # on every survivor: labels must agree
        label = f"{self._label}.{self._groups}"
        members, made = await self._own.shrink(lambda: tuple(self._failed), limit)
        return self._child(made, members, label)

    async def spawn(self, cls: Callable[..., Actor], *args: Any, name: str,
                    ranks: Iterable[int] | None = None, **kwargs: Any) -> Mesh:
        """Serve ``cls(*args, **kwargs)`` as ``name`` on each of ``ranks``; every rank of this
        communicator calls it, and gets the mesh.

        Args:
            cls: the actor's class (or any callable that makes the actor).
            args, kwargs: its arguments (each rank's own).
            name: the name each actor is served under.
            ranks: the ranks that serve one (default: all).

        Returns:
            The ``Mesh``: ``await mesh.method.call(...)`` calls every member.

        Raises:
            TypeError, ValueError: bad ranks or name, before anything is served.
        """
        members = list(range(self.size)) if ranks is None else self._members(ranks, "spawn")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self._args.what('spawn')}: name must be a non-empty str")
        self._open("spawn")
        if self.rank in members:
            self.serve(cls(*args, **kwargs), name)
        await self._own_op("spawn", self._own.barrier)  # every member serves before any call
        return Mesh(self._host, name, members, self._router.dead)

    # -- lifecycle ---------------------------------------------------------------

    async def close(self) -> None:
        """Close this communicator and the groups made from it; idempotent.

        Collective: waits (up to 30 s) for every other rank to close too (see
        the note on closing in ``_core.link``). Operations still in flight fail
        with ``CommClosedError``; later calls raise it at once.
        """
        await self._close(linger=30.0)

    async def _close(self, linger: float) -> None:
        """Close, waiting up to ``linger`` s for the other ranks (0 when leaving on an error)."""
        if self._closed:
            return
        self._closed = True
        self._quick = False
        closed = CommClosedError("the communicator was closed with this operation in flight")
        for handle, _ in self._deadlines.pending():  # the backend may still hold the buffers
            handle._abandon(CommClosedError, closed)
        self._deadlines.close()
        for child in list(self._children):
            await child._close(linger)
        if self._parent is not None:  # closed: let it go (its groups, threads, sockets)
            self._parent._children.remove(self)
            self._parent = None
        if self._chain is not None and not self._chain.done():
            self._chain.cancel()
        await self._host.close(linger)
        await self._router.close(linger)
        self._own.close()
        self._backend.close()
        self._instrument.close()

    @property
    def progresses_alone(self) -> bool:
        """Whether operations in flight progress while the loop is held (gloo's; not MPI's)."""
        return self._backend.progresses_alone

    def _abort_job(self, code: int) -> None:
        watchdog.stand_down(self._loop)  # (the loop is held until the job ends)
        self._backend.abort_job(code)

