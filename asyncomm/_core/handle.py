"""``Handle``: the awaitable result of one issued operation; ``Deadlines``: their timeouts;
``deliver``: how a progress engine settles a handle (a ``Sink``) with its request's outcome."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from asyncomm._core.errors import CommError, CommTimeoutError, PeerFailedError, describe, restated

T = TypeVar("T")

_PENDING, _DONE, _FAILED = 0, 1, 2

FROM_BACKEND: Any = object()  # a handle whose result is the value its backend reports

Finish = Callable[[Any], object]
Classify = Callable[[BaseException], type[CommError]]


class Sink(Protocol):
    """What a finished request is reported to (on the loop thread)."""

    def _succeed(self, value: object) -> None: ...

    def _fail(self, kind: type[CommError], cause: BaseException) -> None: ...

    def _abandon(self, kind: type[CommError], cause: BaseException) -> None:
        """Fail without releasing buffers: the backend may still use them."""


# What a ``finish`` returns where the request was taken care of already (its task saw it
# done first): nothing to deliver. (The sink may still be pending then: a peer's failure is
# held until the communicator can say which rank it was, and must not be succeeded over.)
TAKEN: Any = object()


def deliver(sink: Sink, finish: Finish | None, outcome: Any, classify: Classify) -> None:
    """Settle ``sink`` with ``finish(outcome)``, or (no ``finish``) with the outcome itself;
    not at all where ``finish`` returns ``TAKEN``."""
    if finish is None:
        sink._succeed(outcome)
        return
    try:
        value = finish(outcome)
    except BaseException as exc:  # the backend's error, re-raised by finish
        sink._fail(classify(exc), exc)
    else:
        if value is not TAKEN:
            sink._succeed(value)


def reraise(error: BaseException, _: object) -> NoReturn:
    """With ``error`` bound (``functools.partial``): the finish of a request that failed on
    a thread."""
    raise error


class Handle(Generic[T]):
    """The awaitable result of an operation that was issued when it was called.

    ``await handle`` gives the result; awaiting it again gives it again. Cancelling the awaiting
    task (or its own deadline passing) does not un-issue the operation: the handle keeps the buffers
    the operation uses alive until the backend has finished with them.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_error",
        "_events",
        "_hold",
        "_keep",
        "_loop",
        "_result",
        "_spin",
        "_state",
        "_value",
        "_waiters",
        "_what",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, what: tuple[Any, ...],
                 result: Any = FROM_BACKEND, keep: object = None, done: bool = False) -> None:
        self._loop = loop
        self._what = what  # (rank, op, seq, peer, tag): worded only on error
        self._result = result  # what a success resolves to, unless FROM_BACKEND
        # buffers the backend is using, kept until it is done (None then: an engine that
        # starts a request again reads it, see ``_backends.mpi_kept``)
        self._keep = keep
        # ``done``: the operation completed as it was issued (a quick one), with ``result``
        self._state = _DONE if done else _PENDING
        self._value: Any = result if done else None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] | None = None
        self._events: list[threading.Event] | None = None
        # a communicator's, to name the rank behind a peer's failure (``Peers._held``)
        self._hold: Callable[[Handle[Any], CommError], None] | None = None
        self._callbacks: list[Callable[[Handle[T]], None]] | None = None
        # set by an engine that can finish the request here and now (``Poller.spin``,
        # ``FutureBridge.spin``): the engine first, then what it needs
        self._spin: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<Handle {describe(*self._what)} {state}>"

    @property
    def op(self) -> str:
        """The operation's name (``"all_reduce"``, ``"recv"``, ...)."""
        return str(self._what[1])

    @property
    def seq(self) -> int | None:
        """The operation's number on its communicator: 1, 2, ... (errors name it, ``#3``)."""
        seq = self._what[2]
        return None if seq is None else int(seq)

    @property
    def peer(self) -> int | None:
        """The peer of a point-to-point operation (``None``: a collective, or any source)."""
        peer = self._what[3]
        return None if peer is None else int(peer)

    @property
    def tag(self) -> int | None:
        """The tag of a point-to-point operation (``None`` for a collective)."""
        tag = self._what[4]
        return None if tag is None else int(tag)

    def done(self) -> bool:
        """Return whether the operation has completed (or failed)."""
        return self._state != _PENDING

    def result(self) -> T:
        """Return the result of a completed operation; raise its error if it failed.

        Raises:
            CommError: the operation failed (its subclass says how: timeout, peer, ...).
            asyncio.InvalidStateError: the operation is still in flight.
        """
        if self._state == _DONE:
            return self._value  # type: ignore[no-any-return]
        if self._state == _FAILED:
            assert self._error is not None
            raise self._error
        raise asyncio.InvalidStateError(f"{describe(*self._what)} is still in flight")

    def __await__(self) -> Generator[Any, None, T]:
        """``await handle``: the operation's result, or its error (``CommError``) raised."""
        while self._state == _PENDING and self._spin is not None:
            # perhaps done within microseconds (MPI) or a little more (gloo's collectives):
            # no thread's wake-up, no loop iteration
            if not self._spin[0].spin(self):
                break
            yield  # the loop's turn is due first (see ``Spin``); spin again after it
        if self._state == _PENDING:
            waiter = self._loop.create_future()
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
            try:
                yield from waiter
            finally:
                if not waiter.done() and self._waiters:  # cancelled: forget only this await
                    self._waiters.remove(waiter)
        if self._state == _DONE:
            return self._value  # type: ignore[no-any-return]
        return self.result()

    def add_done_callback(self, callback: Callable[[Handle[T]], None]) -> None:
        """Call ``callback(self)`` on the loop thread once the operation ends (now, if it has):
        unlike a future's, at once, in the same loop iteration.

        Args:
            callback: called with this handle; it reads the outcome with ``result()``.
        """
        if self._state != _PENDING:
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation completes and return its result; for code without a
        running event loop (a worker thread, a script).

        Args:
            timeout: seconds to wait at most (default: until it completes).

        Returns:
            The operation's result.

        Raises:
            CommTimeoutError: ``timeout`` passed first (the operation stays in flight).
            RuntimeError: called on the thread of the event loop the operation needs.
            CommError: the operation failed.
        """
        if self._state == _PENDING:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                raise RuntimeError("Handle.wait() would block the event loop it needs: use await")
            if self._loop.is_running():
                event = threading.Event()
                self._loop.call_soon_threadsafe(self._add_event, event)
                finished = event.wait(timeout)
            else:  # (a wait that times out leaves the task be, to end with the handle)
                task = asyncio.ensure_future(self._quiet(), loop=self._loop)
                done, _ = self._loop.run_until_complete(asyncio.wait([task], timeout=timeout))
                finished = bool(done)
            if not finished:
                raise CommTimeoutError(f"{describe(*self._what)}: wait() gave up after {timeout} s")
        return self.result()

    async def _quiet(self) -> None:
        with contextlib.suppress(BaseException):  # the error is raised by result()
            await self

    def _add_event(self, event: threading.Event) -> None:
        if self._state != _PENDING:
            event.set()
        elif self._events is None:
            self._events = [event]
        else:
            self._events.append(event)

    # -- called by the progress engines, on the loop thread -----------------

    def _succeed(self, value: object) -> None:
        if self._state != _PENDING:  # timed out earlier: the backend is done now
            self._keep = None
            return
        self._value = value if self._result is FROM_BACKEND else self._result
        self._settle(_DONE, None)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        if self._state != _PENDING:
            self._keep = None
            return
        # (where the backend raised says nothing: no traceback)
        error = restated(kind, describe(*self._what), cause.with_traceback(None))
        if self._hold is not None and issubclass(kind, PeerFailedError):
            self._hold(self, error)
            return
        self._settle(_FAILED, error)

    def _expire(self, timeout: float, detail: str = "") -> None:
        if self._state == _PENDING:
            error = CommTimeoutError(f"{describe(*self._what)} timed out after {timeout:g} s"
                                     f"{detail}")
            self._give_up(error)

    def _abandon(self, kind: type[CommError], cause: BaseException) -> None:
        if self._state == _PENDING:
            self._give_up(restated(kind, describe(*self._what), cause))

    def _give_up(self, error: CommError) -> None:
        self._state = _FAILED
        self._error = error
        self._wake()  # but keep the buffers: the backend still holds the request

    def _settle(self, state: int, error: BaseException | None) -> None:
        self._state = state
        self._error = error
        self._keep = None
        if self._waiters or self._events or self._callbacks:
            self._wake()

    def _wake(self) -> None:
        if self._waiters:
            for waiter in self._waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._waiters = None
        if self._events:
            for event in self._events:
                event.set()
            self._events = None
        if self._callbacks:
            callbacks, self._callbacks = self._callbacks, None
            for callback in callbacks:
                callback(self)


class Deadlines:
    """Expire pending handles at their deadlines; find the ones pending long (stalls).

    Note on cost
    ------------
    Most handles settle within the loop iteration that issued them (an awaited request tested
    inline, an eager send): ``add`` only notes the handle and when it was issued, and once the
    iteration ends (one loop callback for all of them) those still pending join their queues, with
    the time they were issued. The quick operations' handles (``add_default``: the default timeout)
    are noted bare, and their deadlines counted from the iteration's end (one clock read for all,
    not one per operation on the hot path of an awaited point-to-point operation). Handles of one
    timeout are added in deadline order, so each timeout has a FIFO queue whose head is the next to
    expire: adding is an append, and a single loop timer waits for the head (none for ``math.inf``).
    Settled handles leave lazily (only weak references are queued, so they never hold buffers), and
    a queue is compacted when settled entries pile up behind a long wait. Stalls are looked for by
    one timer, armed only while something is pending, at the time the oldest handle not reported yet
    would stall: nothing is done per handle for them.

    ``expire(handle, timeout)`` is called when a deadline passes (the owner words the error);
    ``stalled(handles)`` with handles pending ``stall_s`` or longer, each once, oldest first;
    ``waiting(handles)`` every ``check_s`` with the handles pending that long (the owner checks on
    the peers they wait for), by a timer armed likewise only while something is pending.
    """

    _COMPACT = 4096

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 expire: Callable[[Handle[Any], float], None],
                 default: float,
                 stall_s: float,
                 stalled: Callable[[list[tuple[Handle[Any], float]]], None],
                 check_s: float,
                 waiting: Callable[[list[Handle[Any]]], None]) -> None:
        self._loop = loop
        self._queues: dict[float, _Queue] = {}
        self._expire = expire
        self._stall_s = stall_s
        self._stalled = stalled
        self._stall_timer: asyncio.TimerHandle | None = None
        self._reported: weakref.WeakSet[Handle[Any]] = weakref.WeakSet()
        self._check_s = check_s
        self._waiting = waiting
        self._check_timer: asyncio.TimerHandle | None = None
        # added in this loop iteration: (handle, timeout, issued at), queued when it ends;
        # and those of the ``default`` timeout, bare (``add_default``)
        self._fresh: list[tuple[Handle[Any], float, float]] = []
        self.default = default  # (the communicator's default timeout)
        self._bare: list[Handle[Any]] = []
        self._due = False  # ``_enqueue`` is due at the iteration's end

    def add(self, handle: Handle[Any], timeout: float) -> None:
        """Fail ``handle`` (through ``expire``) if it is pending ``timeout`` s from now."""
        if not self._due:
            self._due = True
            self._loop.call_soon(self._enqueue)
        self._fresh.append((handle, timeout, time.monotonic()))

    def add_default(self, handle: Handle[Any]) -> None:
        """``add`` with the default timeout, counted from the end of this loop iteration."""
        if not self._due:
            self._due = True
            self._loop.call_soon(self._enqueue)
        self._bare.append(handle)

    def _enqueue(self) -> None:
        """Queue the handles added in the iteration that ended (see the note on cost)."""
        self._due = False
        fresh, self._fresh = self._fresh, []
        if self._bare:
            now, timeout = time.monotonic(), self.default
            fresh += [(handle, timeout, now) for handle in self._bare if not handle._state]
            self._bare = []
        queues = self._queues
        queued = False
        for handle, timeout, issued in fresh:
            if handle._state == _PENDING:
                queue = queues.get(timeout)
                if queue is None:
                    queue = queues[timeout] = _Queue(self._loop, timeout, self._expire)
                queue.add(handle, issued)
                queued = True
        if not queued:
            return
        if self._stall_s and self._stall_timer is None:
            self._stall_timer = self._loop.call_later(self._stall_s, self._look_for_stalls)
        if self._check_s and self._check_timer is None:
            self._check_timer = self._loop.call_later(self._check_s, self._check)

    def _check(self) -> None:
        self._check_timer = None
        pending = self.pending()
        if not pending:
            return
        now = time.monotonic()
        long = [handle for handle, issued in pending if now - issued >= self._check_s]
        if long:
            self._waiting(long)
        self._check_timer = self._loop.call_later(self._check_s, self._check)

    def pending(self) -> list[tuple[Handle[Any], float]]:
        """Return the handles still pending with the ``time.monotonic()`` they were issued."""
        if self._due:
            self._enqueue()
        found = [(handle, issued) for queue in self._queues.values()
                 for issued, ref in queue.entries
                 if (handle := ref()) is not None and not handle.done()]
        found.sort(key=lambda pair: pair[1])
        return found

    def _look_for_stalls(self) -> None:
        self._stall_timer = None
        now = time.monotonic()
        waiting = [(h, issued) for h, issued in self.pending() if h not in self._reported]
        stalled = [(h, now - issued) for h, issued in waiting if now - issued >= self._stall_s]
        for handle, _ in stalled:
            self._reported.add(handle)
        if stalled:
            self._stalled(stalled)
        later = [issued for h, issued in waiting if now - issued < self._stall_s]
        if later:  # the oldest handle not reported yet stalls then
            self._stall_timer = self._loop.call_later(later[0] + self._stall_s - now,
                                                      self._look_for_stalls)

    def close(self) -> None:
        """Stop every timer: the owner is closed (what it had pending fails with it)."""
        for timer in (self._stall_timer, self._check_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._check_timer = None
        self._stall_s = self._check_s = 0.0
        self._fresh.clear()
        self._bare.clear()
        for queue in self._queues.values():
            queue.close()
        self._queues.clear()


class _Queue:
    __slots__ = ("_added", "_expire", "_loop", "_timeout", "_timer", "entries")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float,
                 expire: Callable[[Handle[Any], float], None]) -> None:
        self._loop = loop
        self._timeout = timeout
        self._expire = expire
        self.entries: collections.deque[tuple[float, weakref.ref[Handle[Any]]]] = (
            collections.deque())  # (issued at, handle), oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._added = 0

    def add(self, handle: Handle[Any], issued: float) -> None:
        self.entries.append((issued, weakref.ref(handle)))
        self._added += 1
        if self._added % Deadlines._COMPACT == 0:
            self._compact()
        if self._timer is None and self._timeout != math.inf:
            self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.entries.clear()

    def _compact(self) -> None:
        self.entries = collections.deque(
            (issued, ref) for issued, ref in self.entries
            if (handle := ref()) is not None and not handle.done())

    def _arm(self) -> None:
        delay = self.entries[0][0] + self._timeout - time.monotonic()
        self._timer = self._loop.call_later(max(delay, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        entries = self.entries
        while entries:
            issued, ref = entries[0]
            handle = ref()
            if handle is not None and not handle.done():
                if issued + self._timeout > now:  # loop timers round to ms: never fire early
                    break
                self._expire(handle, self._timeout)
            entries.popleft()
        if entries:
            self._arm()
