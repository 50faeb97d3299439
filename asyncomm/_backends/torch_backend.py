"""torch.distributed backends: gloo (CPU tensors) and nccl (CUDA tensors).

Collectives complete through their futures (``FutureBridge``; a task that awaits a gloo collective
first waits for its work itself, a bounded while). gloo's send/recv have no future and cannot be
polled, so they complete in ``Waiters``. Operations go straight to the ``ProcessGroup`` methods,
whose ranks are the group's own.

Note on eager sends
-------------------
gloo's send completes only once the receiver has posted its receive (a rendezvous), and each
completion reported through a waiter thread costs two thread hand-offs. A CPU send of at most
``ASYNCOMM_EAGER_BYTES`` (64 KiB) therefore sends a copy and completes at once, as MPI's eager
protocol does; one reaper thread sees the copies off. At most 64 are in flight per communicator
(later sends complete as usual). If a copy's transfer fails, the next point-to-point operation with
that peer, and the next collective, raise that error (a failed send to one peer does not fail sends
to others).

Note on CUDA (nccl)
-------------------
An nccl work is done, as far as the host goes, once enqueued, and asking for its future
costs as much as the operation: so none is asked for. As an operation is issued, the loop
thread calls ``work.wait()`` (the *current stream* waits for nccl's; the host does not) and
its handle is done (docs/api.md, "Backends", says what ``await`` then means). A barrier's
``wait()`` blocks the host until every rank is in, so a waiter thread calls it; so it does
every ``wait()`` under ``TORCH_NCCL_BLOCKING_WAIT`` (each then blocks the host).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import datetime
import functools
import gc
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncomm._backends import gloo_halt, gloo_lane, gloo_net, gloo_p2p, startup
from asyncomm._backends.gloo_link import GlooLink
from asyncomm._core import settings, tags
from asyncomm._core.backend import Backend, InFlight, Posted, Tensors, nothing, remembering
from asyncomm._core.env import LaunchEnv
from asyncomm._core.errors import CommClosedError, CommError, CommTimeoutError, PeerFailedError
from asyncomm._core.handle import Sink
from asyncomm._core.link import Link
from asyncomm._core.ops import ReduceOp
from asyncomm._core.polling import Spin
from asyncomm._core.progress import FutureBridge, Inbox, Reaper, Waiters

T = TypeVar("T")

_TORCH_OPS = {op: getattr(dist.ReduceOp, op.name) for op in ReduceOp}  # torch's, named alike

_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "socket closed", "peer", "remote process exited")
_EAGER_IN_FLIGHT = 64

# The global ranks at each gloo address of the world (see open_torch): errors name them.
_hosts: dict[str, list[int]] = {}

# How long a point-to-point wait may take, and the twin's group's timeout: gloo fails (and
# closes) a receive still waiting at its group's timeout, and the twin's standing channel
# receive may wait as long as the program runs. The twin is made only once every rank has
# joined, so its group never times out: asyncomm's own deadlines bound what waits on it.
_FOREVER = gloo_p2p.FOREVER

# Dtypes gloo cannot move in collectives ("Invalid scalar type"; its point-to-point moves
# any bytes): they travel as their bytes, and int16, which reduces, widened to int32.
_GLOO_LACKS = frozenset({torch.int16, torch.uint16, torch.uint32, torch.uint64})

_generation = 0


def classify(exc: BaseException) -> type[CommError]:
    """Map an exception raised by torch.distributed to the asyncomm error it means."""
    if isinstance(exc, CommError):
        return type(exc)  # asyncomm's own (a receive refused by gloo_p2p, say)
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return CommTimeoutError
    if any(sign in text for sign in _PEER_GONE):
        named = gloo_net.hosts_named(exc, _hosts) if _hosts else None
        if named is not None:
            exc.args = (named,)  # its words name the ranks behind the address
        return PeerFailedError
    return CommError


class _Destroyed:
    """What a closed backend holds instead of the group it destroyed (see ``_let_go``)."""

    def __getattr__(self, name: str) -> Any:
        raise CommClosedError(f"the process group was destroyed at close (.{name})")


_DESTROYED: Any = _Destroyed()

# Backends not closed yet: at exit, what they still have in flight is ended first.
_open: weakref.WeakSet[TorchBackend] = weakref.WeakSet()


@atexit.register
def _settle_at_exit() -> None:
    """End what open groups still have in flight before the interpreter finalizes.

    Then collect what reference cycles still hold (a closed communicator's works and futures among
    them): left to the interpreter's finalization, their destruction needs the GIL on threads that
    can no longer take it, and gloo's threads end the process (std::terminate).
    """
    gloo_halt.exit_if_halted()
    for backend in list(_open):
        with contextlib.suppress(Exception):  # exiting: nothing left to tell
            backend._settle()
    gc.collect()
    gloo_halt.restore()


def _value(future: Any) -> object:
    future.value()  # raises the backend's error, if any
    return None


def _wait_briefly(work: Any, seconds: float) -> bool:
    """Wait up to ``seconds`` (whole milliseconds, at least one) for a CPU collective's work,
    in the calling thread (0: do not wait); return whether it is done.

    ``wait(timeout)`` takes whole milliseconds (less is 0, which is no timeout at all);
    running out raises, but leaves the work as it was (it completes later as usual).
    """
    if seconds > 0 and not work.is_completed():
        try:
            work.wait(datetime.timedelta(milliseconds=max(1, math.ceil(seconds * 1e3))))
        except RuntimeError:
            pass  # out of time, or the work failed (its future raises that error)
    return bool(work.is_completed())


def _blocking_wait() -> bool:
    """Whether nccl's ``wait()`` blocks the host (``TORCH_NCCL_BLOCKING_WAIT``)."""
    value = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("NCCL_BLOCKING_WAIT", ""))
    return value.strip().lower() in ("1", "true", "yes", "on")


class TorchBackend(Backend):
    """A torch ``ProcessGroup`` driven without blocking."""

    def __init__(self, name: str, pg: dist.ProcessGroup, global_ranks: Sequence[int],
                 loop: asyncio.AbstractEventLoop, timeout: float,
                 release: Callable[[], None] | None, label: str,
                 user_backend: str) -> None:
        self.name = name
        self.raw = pg
        self.rank = pg.rank()
        self.size = pg.size()
        self.max_tag = tags.GLOO_TAG_LIMIT - tags.RESERVED
        self.probes_peers = name == "gloo"
        self.progresses_alone = True  # on gloo's (and nccl's) own threads
        self._pg = pg
        self._global_ranks = list(global_ranks)
        self._loop = loop
        self._timeout = timeout
        self._release = release  # destroys the group, if asyncomm made it
        self._label = label  # names this group's subgroups alike on every member
        self._user_backend = user_backend  # what groups split from this one run on
        self._splits = 0
        self._eager = Reaper()
        self._outgoing = gloo_p2p.Outgoing()  # the data tags of large sends (see gloo_p2p)
        self._spare: collections.deque[gloo_p2p.Buffer] = collections.deque()  # see gloo_p2p
        self.posted = InFlight()  # ``Posted`` operations (see the note on teardown)
        tuned = settings.read()
        self._eager_bytes = tuned.eager_bytes  # see the note on eager sends
        self.cuda = name == "nccl"
        self._blocking = self.cuda and _blocking_wait()  # see the note on CUDA
        self._inbox = Inbox(loop, remembering(self, classify))
        spin = None if self.cuda else Spin(loop, tuned.spin_tests, tuned.gloo_spin_max_s)
        self._bridge = FutureBridge(self._inbox, loop, spin)
        self._waiters = Waiters(self._inbox)
        self._link: GlooLink | None = None
        self._any_source: collections.Counter[int] = collections.Counter()  # tags pending
        self._halt_listeners: list[Callable[[CommError], None]] = []
        if not self.cuda:
            gloo_halt.watch(loop, self)
        _open.add(self)

    def on_halt(self, listener: Callable[[CommError], None]) -> None:
        self._halt_listeners.append(listener)

    def halted(self, what: str) -> None:
        """gloo's own thread failed (see ``gloo_halt``): nothing moves any more."""
        error = gloo_halt.error(what)  # (the communicator keeps it as ``lost``)
        for listener in self._halt_listeners:
            listener(error)

    # -- collectives ------------------------------------------------------------

    def _collective(self, sink: Sink, work: Any,
                    then: Callable[[], object] | None = None) -> None:
        if self.cuda:
            self._enqueued(sink, work, nothing)
            return
        finish = _value
        if then is not None:  # a widened reduction copies its result back (see _GLOO_LACKS)
            def finish(future: Any) -> object:
                _value(future)
                then()
                return None

        self._bridge.watch(work.get_future(), sink, finish, functools.partial(_wait_briefly, work))

    def _enqueued(self, sink: Sink, work: Any, finish: Callable[[Any], object]) -> None:
        """Settle the sink of an nccl work now, or on a waiter thread if its ``wait()``
        blocks the host (see the note on CUDA)."""
        if self._blocking:  # a waiter thread's wait, not the loop's
            self._waiters.watch(work.wait, sink, finish)
            return

        def waited(_: object) -> object:
            work.wait()  # the current stream waits for nccl's; the host does not
            return finish(None)

        self._inbox.settle(sink, waited, None)

    def _moved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor`` as gloo moves it: its bytes when gloo lacks its dtype."""
        if tensor.dtype in _GLOO_LACKS and not self.cuda:
            return tensor.reshape(-1).view(torch.uint8)
        return tensor

    def _all_moved(self, tensors: Tensors) -> list[torch.Tensor]:
        return [self._moved(t) for t in tensors]

    def _widened(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], object] | None]:
        """Return what gloo reduces for ``tensor``, and how its result comes back (or None)."""
        if tensor.dtype is torch.int16 and not self.cuda:
            wide = tensor.to(torch.int32)
            return wide, functools.partial(tensor.copy_, wide)
        return tensor, None

    def _raise_if_failed(self, peer: int | None = None) -> None:
        """Raise the failure of an earlier eager send: to ``peer``, or to anyone (collectives)."""
        failures = self._eager.failures
        if not failures:
            return
        failure = next(iter(failures.values())) if peer is None else failures.get(peer)
        if failure is not None:
            raise classify(failure)(f"an earlier eager send failed: {failure}") from failure

    def barrier(self, sink: Sink) -> None:
        self._raise_if_failed()
        work = self._pg.barrier()
        if self.cuda:  # nccl's wait() of a barrier blocks the host until every rank is in
            self._waiters.watch(work.wait, sink, nothing)
        else:
            self._collective(sink, work)

    def broadcast(self, sink: Sink, tensor: torch.Tensor, src: int) -> None:
        self._collective(sink, self._pg.broadcast(self._moved(tensor), src))

    def all_reduce(self, sink: Sink, tensor: torch.Tensor, op: ReduceOp) -> None:
        self._raise_if_failed()
        reduced, then = self._widened(tensor)
        self._collective(sink, self._pg.allreduce([reduced], _TORCH_OPS[op]), then)

    def reduce(self, sink: Sink, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
        reduced, then = self._widened(tensor)
        self._collective(sink, self._pg.reduce(reduced, dst, _TORCH_OPS[op]), then)

    def all_gather(self, sink: Sink, out: Tensors, tensor: torch.Tensor) -> None:
        self._collective(sink, self._pg.allgather([self._all_moved(out)], [self._moved(tensor)]))

    def gather(self, sink: Sink, out: Tensors | None, tensor: torch.Tensor, dst: int) -> None:
        opts = dist.GatherOptions()
        opts.rootRank = dst
        self._collective(sink, self._pg.gather([self._all_moved(out)] if out is not None else [],
                                               [self._moved(tensor)], opts))

    def scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors | None,
                src: int) -> None:
        opts = dist.ScatterOptions()
        opts.rootRank = src
        self._collective(sink, self._pg.scatter(
            [self._moved(tensor)], [self._all_moved(chunks)] if chunks is not None else [], opts))

    def reduce_scatter(self, sink: Sink, tensor: torch.Tensor, chunks: Tensors,
                       op: ReduceOp) -> None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[op]  # type: ignore[assignment]
        reduced, then = self._widened(tensor)
        parts = [self._widened(chunk)[0] for chunk in chunks]
        work = self._pg.reduce_scatter([reduced], [parts], opts)
        if self.cuda:
            self._collective(sink, work)
        else:  # no future on CPU
            self._waiters.watch(work.wait, sink, nothing if then is None else (lambda _: then()))

    def all_to_all(self, sink: Sink, outputs: Tensors, inputs: Tensors) -> None:
        self._collective(sink, self._pg.alltoall(self._all_moved(outputs),
                                                 self._all_moved(inputs)))

    # -- point to point -----------------------------------------------------------

    def send(self, sink: Sink, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._raise_if_failed(dst)
        if self.cuda:
            self._p2p(sink, self._pg.send([tensor], dst, tag), nothing)
            return
        first, data, data_tag = self._outgoing.message(tensor, dst)  # see gloo_p2p
        if data is None:  # the payload is in the first message, a copy
            self.send_raw(sink, first, dst, tag)
            return
        # (not the eager reaper's: the header waits for the receive too)
        self._waiters.watch(self._send_large(first, data, dst, tag, data_tag), sink, nothing)

    def _send_large(self, first: torch.Tensor, data: torch.Tensor, dst: int, tag: int,
                    data_tag: int) -> Callable[[], None]:
        """Send a large payload's header and data (see gloo_p2p); return what waits for
        both (from a thread) and frees the data tag."""
        works = (self._pg.send([first], dst, tag), self._pg.send([data], dst, data_tag))

        def sent() -> None:
            try:
                for work in works:
                    work.wait(_FOREVER)
            finally:  # failed: the connection is gone, and the tag with it
                self._outgoing.sent(dst, data_tag)

        return sent

    def send_raw(self, sink: Sink, tensor: torch.Tensor, dst: int, tag: int) -> None:
        """Send the bytes of ``tensor``, a buffer of its own (done at once if small enough)."""
        if (tensor.nbytes <= self._eager_bytes + gloo_p2p.HEADER.size
                and self._eager.in_flight < _EAGER_IN_FLIGHT):  # see the note on eager sends
            work = self._pg.send([tensor], dst, tag)
            self._eager.watch(functools.partial(work.wait, _FOREVER), dst)
            sink._succeed(None)
            return
        self._p2p(sink, self._pg.send([tensor], dst, tag), nothing)

    def recv(self, sink: Sink, tensor: torch.Tensor, src: int | None, tag: int) -> None:
        self._raise_if_failed(src)
        if self.cuda:
            if src is None:
                raise ValueError("nccl has no any-source receive: name the source")
            self._p2p(sink, self._pg.recv([tensor], src, tag), lambda _: src)
            return
        incoming = gloo_p2p.Incoming(tensor, self._spare)  # see gloo_p2p
        if src is not None:
            work = self._pg.recv([incoming.first], src, tag)
            self._waiters.watch(functools.partial(incoming.take, self._pg, work, src), sink,
                                lambda _: incoming.result(src))
            return
        work = self._pg.recv_anysource([incoming.first], tag)
        self._any_source[tag] += 1  # see stuck()

        def finish(_: object) -> object:
            self._any_source[tag] -= 1
            return incoming.result(work._source_rank())

        self._waiters.watch(functools.partial(incoming.take, self._pg, work, None), sink,
                            finish, endless=True)

    def _p2p(self, sink: Sink, work: Any, finish: Callable[[Any], object]) -> None:
        if self.cuda:
            self._enqueued(sink, work, finish)
        else:  # gloo: no future, no polling: a waiter thread calls wait()
            # An explicit deadline: gloo's own (the group's timeout) would close every
            # connection of the group when a receive the user gave up on stays unmatched.
            self._waiters.watch(functools.partial(work.wait, _FOREVER), sink, finish)

    def post_send(self, tensor: torch.Tensor, dst: int, tag: int) -> Posted:
        self._raise_if_failed(dst)
        first, data, data_tag = ((tensor, None, 0) if self.cuda  # (see gloo_p2p)
                                 else self._outgoing.message(tensor, dst))
        sent = (functools.partial(self._pg.send([first], dst, tag).wait, _FOREVER)
                if data is None else self._send_large(first, data, dst, tag, data_tag))
        return _PostedWork(sent, self, (self.rank, "send", dst, tag))

    def post_recv(self, tensor: torch.Tensor, src: int, tag: int) -> Posted:
        self._raise_if_failed(src)
        what = (self.rank, "recv", src, tag)
        if self.cuda:
            return _PostedWork(functools.partial(self._pg.recv([tensor], src, tag).wait,
                                                 _FOREVER), self, what)
        incoming = gloo_p2p.Incoming(tensor, self._spare)
        work = self._pg.recv([incoming.first], src, tag)

        def received() -> None:
            incoming.take(self._pg, work, src)
            incoming.result(src)

        return _PostedWork(received, self, what)

    def stuck(self) -> list[int]:
        return [tag for tag, count in self._any_source.items() for _ in range(count)]

    def release(self, peer: int, tag: int) -> None:
        try:
            work = self._pg.send([gloo_p2p.NOTHING], peer, tag)
        except RuntimeError:  # its connection is closed: the peer left, its receive with it
            return
        self._eager.watch(functools.partial(work.wait, _FOREVER), peer)

    async def released(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(self._any_source.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def link(self) -> Link:
        tuned = settings.read()
        # The lane says where it listens in the default group's store, on the address
        # gloo's device binds to.
        store = dist.distributed_c10d._get_default_store()  # type: ignore[attr-defined]
        address = gloo_net.own_address(os.environ) or "127.0.0.1"
        self._link = GlooLink(self, self._pg, self._loop, self._inbox, self._waiters, classify,
                              functools.partial(gloo_lane.Lane, self.rank, store,
                                                f"lane/{self._label}", address,
                                                tuned.lane_shm, tuned.lane_direct))
        return self._link

    # -- groups and lifecycle ---------------------------------------------------------

    async def split(self, ranks: Sequence[int]) -> tuple[Backend, Backend] | None:
        self._splits += 1  # on every rank, member or not: names must agree
        if self.rank not in ranks:
            return None
        members = [self._global_ranks[r] for r in ranks]
        label = f"{self._label}.{self._splits}"
        user = await self._new_group(members, self._user_backend, label, self._timeout)
        own = await self._new_group(members, "gloo", label + ".own", _FOREVER.total_seconds())
        return user, own

    async def shrink(self, failed: Callable[[], Sequence[int]], timeout: float
                     ) -> tuple[list[int], tuple[Backend, Backend]]:
        key = f"asyncomm.shrink.{self._label}.{self._splits + 1}"
        members = await self._loop.run_in_executor(
            None, startup.agree, dist.distributed_c10d._get_default_store(), key, self.rank,
            self.size, failed, timeout)
        if self.rank not in members:
            raise PeerFailedError(f"rank {self.rank}: shrink: the other survivors agreed "
                                  f"without this rank (on ranks {members})")
        made = await self.split(members)
        assert made is not None
        return members, made

    async def _new_group(self, members: list[int], name: str, label: str,
                         seconds: float) -> TorchBackend:
        timeout = datetime.timedelta(seconds=seconds)
        pg = await self._loop.run_in_executor(None, startup.make_group, members, name, label,
                                              timeout)
        startup.no_deadline(pg, name)
        # (a twin's too: the groups split from it run the user's on the user's backend)
        return TorchBackend(name, pg, members, self._loop, self._timeout,
                            functools.partial(dist.destroy_process_group, pg), label=label,
                            user_backend=self._user_backend)

    def close(self) -> None:
        if self not in _open:  # closed already
            return
        _open.discard(self)
        if gloo_halt.halted_by is not None:  # gloo cannot end anything now: left as it is
            self._inbox.close()
            return
        self._bridge.enlist()  # collectives issued this iteration: their callbacks count as busy
        self._eager.close(timeout=2.0)  # copies still on their way get a moment to arrive
        self._settle()
        if self._release is not None and dist.is_initialized():
            with contextlib.suppress(ValueError, RuntimeError):  # already gone with the world
                self._release()
        self._waiters.close(timeout=2.0)
        self._inbox.close()
        if self._release is not None:
            self._let_go()

    def _let_go(self) -> None:
        """Hold the group asyncomm destroyed no longer, so that its threads (one wakes every
        10 ms) and sockets end now: a closed communicator's objects hold each other, and the
        collector's next full pass, which would free them, may be minutes away."""
        self._release = None
        self.raw = None
        self._pg = _DESTROYED
        if self._link is not None:
            self._link.let_go()

    def _busy(self) -> bool:
        """Return whether gloo may still wake a thread or a callback of ours on this group."""
        link = self._link
        return bool(self._waiters.waiting(endless=False) or self._waiters.waiting(endless=True)
                    or self.posted.pending() or self._eager.in_flight or self._bridge.pending
                    or (link is not None and link.listening))

    def _ending(self) -> bool:
        """Return whether something that closing the connections ends has not ended yet."""
        return bool(self._waiters.waiting(endless=False) or self.posted.waiting
                    or self._eager.in_flight or self._bridge.pending)

    def _settle(self, timeout: float = 5.0) -> None:
        """End everything still in flight on the group, if asyncomm owns it (see the note).

        Note on teardown
        ----------------
        A thread that wakes inside a gloo call -- a waiter returning from ``wait()``, a thread
        inside a ``Posted.wait``, gloo's own thread running a future's Python callback -- once the
        interpreter has begun to exit is ended as ``FutureBridge``'s note on callbacks at exit says:
        the process dies of SIGABRT after the program succeeded. Such a late wake comes from an
        operation still pending at close (a timed-out receive or send, a posted one a thread may yet
        wait for, a collective a peer never joined, an eager send nobody receives), when the peer's
        exit closes the connection during ours. gloo can neither cancel nor abort an operation, but
        a receive waited for with a short timeout makes it close every connection of the group
        ("application timeout"), which fails every pending operation tied to a connection at once,
        here and now. So an owned group with anything in flight is ended that way, and the threads
        and callbacks it wakes are waited for, before it is destroyed. Peers see the connection
        close, as they would at its destruction; their other connections are untouched.

        But gloo loses a send whose write met its connection closing (the peer left mid-transfer):
        its ``wait()`` never returns (a deadline would, but one that passes closes the group), and
        its thread stays parked, named ``asyncomm-lost``.

        An any-source receive belongs to no connection: closing them does not end it, and no message
        can reach it afterwards. Before closing, the router asks a live peer to end it with an empty
        message (``stuck``/``release``); one still pending stays parked in its thread, harmlessly
        (nothing can wake it). A group the user made (``init`` adopted it) is left alone.
        """
        if (self._release is None or self.size == 1 or not dist.is_initialized()
                or not self._busy()):
            return
        # a receive whose timeout makes gloo close every connection of the group (see the note)
        scratch = torch.empty(1, dtype=torch.uint8)
        with contextlib.suppress(RuntimeError):  # the timeout, as intended
            self._pg.recv_anysource([scratch], tags.GLOO_ABORT).wait(
                datetime.timedelta(milliseconds=1))
        if self._link is not None:
            self._link.stop()
        deadline = time.monotonic() + timeout
        while self._ending() and time.monotonic() < deadline:
            time.sleep(0.001)
        self._waiters.abandon()  # what still waits now, gloo lost (see the note)
        self._eager.abandon()


class _PostedWork(Posted):
    """A send or receive a thread issued and waits for itself (gloo cannot cancel it):
    ``wait()`` returns once it is done."""

    def __init__(self, wait: Callable[[], object], backend: TorchBackend,
                 what: tuple[int, str, int, int]) -> None:
        super().__init__(what, backend.posted, remembering(backend, classify))
        self._wait = wait

    def _block(self) -> None:
        self._wait()


async def open_torch(name: str, env: LaunchEnv, timeout: float,
                     loop: asyncio.AbstractEventLoop) -> tuple[Backend, Backend]:
    """Join (or adopt) torch's default process group; return it and a private twin.

    Across hosts, gloo is given the interface that reaches ``MASTER_ADDR``
    when torch's default would be loopback (see ``gloo_net``); a rank that
    fails to join tells the others, which stop waiting (see ``startup``).
    """
    global _generation
    _generation += 1  # every rank opens as often as the others: labels agree
    if name == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA, and no GPU is visible")
        count = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", env.rank % count))
        if local >= count:  # (nccl refuses two ranks on one GPU)
            raise RuntimeError(f"rank {env.rank}: backend 'nccl' needs a GPU per rank of a "
                               f"host: this is local rank {local}, and {count} GPU(s) are "
                               "visible")
        torch.cuda.set_device(local)
    if env.size > 1:
        chosen = gloo_net.apply(os.environ, env.master_addr)
        if chosen is not None:
            logging.getLogger("asyncomm").info("rank %d: gloo uses %s: %s", env.rank,
                                               chosen.interface, chosen.reason)
    owns = not dist.is_initialized()
    watch: startup.Watch | None = None

    async def joined(step: Callable[[], T]) -> T:
        """Run a joining step off the loop; with a watch, failing fast (see ``startup``)."""
        if watch is None:
            return await loop.run_in_executor(None, step)
        return await watch.run(step)

    if owns:
        store = await startup.base_store(env, timeout)
        prefix = f"asyncomm/{_generation}"
        prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        if env.size > 1:
            watch = startup.Watch(env.rank, prefixed, env.master_addr,
                                  env.master_port, prefix, timeout)

        def init() -> None:
            prefixed.set(f"address/{env.rank}", gloo_net.own_address(os.environ))
            prefixed.set(f"joined/{env.rank}", "1")
            hook = sys.excepthook  # torch wraps it again at every init: "[rank1]: " per line
            try:
                dist.init_process_group(name, store=prefixed, rank=env.rank,
                                        world_size=env.size,
                                        timeout=datetime.timedelta(seconds=timeout))
                sys.excepthook = hook  # launchers label ranks' lines; see asyncomm._runtime
                if env.size > 1:  # (a store round trip: on the joining thread)
                    _hosts.clear()
                    _hosts.update(gloo_net.ranks_by_address(prefixed, env.size))
            except RuntimeError as exc:  # a store timeout: say who is missing
                _explained(exc, env.rank)
                missing = [r for r in range(env.size) if not prefixed.check([f"joined/{r}"])]
                if not missing:
                    raise
                raise CommTimeoutError(
                    f"rank {env.rank}: init: rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} of {env.size} did not join within "
                    f"{timeout:g} s (the init timeout; ASYNCOMM_TIMEOUT)") from exc

        await joined(init)
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    if owns:
        startup.no_deadline(world, name)
    ranks = list(range(world.size()))
    # asyncomm's own traffic (objects) is CPU bytes: always gloo.
    label = f"asyncomm{_generation}"

    def own_group() -> dist.ProcessGroup:
        try:
            return startup.make_group(ranks, "gloo", label + ".own", _FOREVER)
        except RuntimeError as exc:
            _explained(exc, env.rank)
            raise

    own_pg = await joined(own_group)
    release = dist.destroy_process_group if owns else None
    user = TorchBackend(name, world, ranks, loop, timeout, release, label, name)
    own = TorchBackend("gloo", own_pg, ranks, loop, timeout,
                       functools.partial(dist.destroy_process_group, own_pg), label, name)
    return user, own


def _explained(error: RuntimeError, rank: int) -> None:
    """Raise a gloo connection failure as a ``PeerFailedError`` that says what to set."""
    explanation = gloo_net.explain(error, rank)
    if explanation is not None:
        raise PeerFailedError(explanation) from error
