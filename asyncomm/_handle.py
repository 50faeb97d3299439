"""``Handle``: the awaitable result of one issued operation; ``Deadlines``: their timeouts."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from asyncomm._errors import CommError, CommTimeoutError, describe

T = TypeVar("T")

_PENDING, _DONE, _FAILED = 0, 1, 2

FROM_BACKEND: Any = object()  # a handle whose result is the value its backend reports


class Handle(Generic[T]):
    """The awaitable result of an operation that was issued when it was called.

    ``await handle`` gives the result; awaiting it again gives it again.
    Cancelling the awaiting task (or its own deadline passing) does not
    un-issue the operation: the handle keeps the buffers the operation uses
    alive until the backend has finished with them.
    """

    __slots__ = ("__weakref__", "_callbacks", "_error", "_events", "_keep", "_loop", "_result",
                 "_state", "_value", "_waiters", "_what")

    def __init__(self, loop: asyncio.AbstractEventLoop, what: tuple[Any, ...],
                 result: Any = FROM_BACKEND, keep: object = None) -> None:
        self._loop = loop
        self._what = what  # (rank, op, seq, peer, tag): worded only on error
        self._result = result  # what a success resolves to, unless FROM_BACKEND
        self._keep = keep  # buffers the backend is using, kept until it is done
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] | None = None
        self._events: list[threading.Event] | None = None
        self._callbacks: list[Callable[[Handle[T]], None]] | None = None

    def __repr__(self) -> str:
        state = ("pending", "done", "failed")[self._state]
        return f"<Handle {describe(*self._what)} {state}>"

    def done(self) -> bool:
        """Return whether the operation has completed (or failed)."""
        return self._state != _PENDING

    def result(self) -> T:
        """Return the result of a completed operation; raise its error if it failed."""
        if self._state == _DONE:
            return self._value  # type: ignore[no-any-return]
        if self._state == _FAILED:
            assert self._error is not None
            raise self._error
        raise asyncio.InvalidStateError(f"{describe(*self._what)} is still in flight")

    def __await__(self) -> Generator[Any, None, T]:
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
        return self.result()

    def add_done_callback(self, callback: Callable[[Handle[T]], None]) -> None:
        """Call ``callback(self)`` on the loop thread once the operation ends (now, if it has).

        Unlike a future's, the callback runs at once, in the same loop iteration.
        """
        if self._state != _PENDING:
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation completes and return its result.

        For code without a running event loop (a worker thread, a script).
        Raise ``CommTimeoutError`` if ``timeout`` seconds pass first (the
        operation stays in flight).
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
            else:
                finished = self._loop.run_until_complete(self._settled(timeout))
            if not finished:
                raise CommTimeoutError(f"{describe(*self._what)}: wait() gave up after {timeout} s")
        return self.result()

    async def _settled(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(self._quiet())), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _quiet(self) -> None:
        try:
            await self
        except BaseException:  # the error is raised by result()
            pass

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
        error = kind(f"{describe(*self._what)}: {cause}")
        error.__cause__ = cause
        self._settle(_FAILED, error)

    def _expire(self, timeout: float) -> None:
        if self._state == _PENDING:
            error = CommTimeoutError(f"{describe(*self._what)} timed out after {timeout:g} s")
            self._give_up(error)

    def _abandon(self, kind: type[CommError], cause: BaseException) -> None:
        if self._state == _PENDING:
            error = kind(f"{describe(*self._what)}: {cause}")
            error.__cause__ = cause
            self._give_up(error)

    def _give_up(self, error: CommError) -> None:
        self._state = _FAILED
        self._error = error
        self._wake()  # but keep the buffers: the backend still holds the request

    def _settle(self, state: int, error: BaseException | None) -> None:
        self._state = state
        self._error = error
        self._keep = None
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
    """Expire pending handles at their deadlines, with one timer per distinct timeout.

    Note on cost
    ------------
    Handles of one timeout are added in deadline order, so each timeout has
    a FIFO queue whose head is the next to expire: adding is an append, and
    a single loop timer waits for the head. Settled handles leave lazily
    (only weak references are queued, so they never hold buffers), and a
    queue is compacted when settled entries pile up behind a long wait.
    """

    _COMPACT = 4096

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queues: dict[float, _Queue] = {}

    def add(self, handle: Handle[Any], timeout: float) -> None:
        """Fail ``handle`` with ``CommTimeoutError`` if it is pending ``timeout`` s from now."""
        queue = self._queues.get(timeout)
        if queue is None:
            queue = self._queues[timeout] = _Queue(self._loop, timeout)
        queue.add(handle)


class _Queue:
    __slots__ = ("_added", "_entries", "_loop", "_timeout", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._loop = loop
        self._timeout = timeout
        self._entries: collections.deque[tuple[float, weakref.ref[Handle[Any]]]] = (
            collections.deque())
        self._timer: asyncio.TimerHandle | None = None
        self._added = 0

    def add(self, handle: Handle[Any]) -> None:
        self._entries.append((time.monotonic() + self._timeout, weakref.ref(handle)))
        self._added += 1
        if self._added % Deadlines._COMPACT == 0:
            self._compact()
        if self._timer is None:
            self._arm()

    def _compact(self) -> None:
        self._entries = collections.deque(
            (deadline, ref) for deadline, ref in self._entries
            if (handle := ref()) is not None and not handle.done())

    def _arm(self) -> None:
        delay = self._entries[0][0] - time.monotonic()
        self._timer = self._loop.call_later(max(delay, 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        entries = self._entries
        while entries:
            deadline, ref = entries[0]
            handle = ref()
            if handle is not None and not handle.done():
                if deadline > now:  # loop timers round to milliseconds: never fire early
                    break
                handle._expire(self._timeout)
            entries.popleft()
        if entries:
            self._arm()
