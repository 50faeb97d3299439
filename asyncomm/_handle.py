"""``Handle``: the awaitable result of one issued operation."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from asyncomm._errors import CommError, CommTimeoutError, describe

T = TypeVar("T")

_PENDING, _DONE, _FAILED = 0, 1, 2


class Handle(Generic[T]):
    """The awaitable result of an operation that was issued when it was called.

    ``await handle`` gives the result; awaiting it again gives it again.
    Cancelling the awaiting task (or its own deadline passing) does not
    un-issue the operation: the handle keeps the buffers the operation uses
    alive until the backend has finished with them.
    """

    __slots__ = (
        "__weakref__",
        "_error",
        "_events",
        "_keep",
        "_loop",
        "_result_of",
        "_state",
        "_timer",
        "_value",
        "_waiters",
        "_what",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, what: tuple[Any, ...],
                 result_of: Callable[[Any], T], keep: object = None,
                 timeout: float = math.inf) -> None:
        self._loop = loop
        self._what = what  # (rank, op, seq, peer, tag): worded only on error
        self._result_of = result_of
        self._keep = keep  # buffers the backend is using, kept until it is done
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._events: list[threading.Event] = []
        self._timer: asyncio.TimerHandle | None = None
        if timeout != math.inf:
            self._timer = loop.call_at(loop.time() + timeout, self._expire, timeout,
                                       time.monotonic() + timeout)

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
            self._waiters.append(waiter)
            try:
                yield from waiter
            finally:
                if not waiter.done():  # cancelled: forget only this await
                    self._waiters.remove(waiter)
        return self.result()

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
        if self._state == _PENDING:
            self._events.append(event)
        else:
            event.set()

    # -- called by the progress engines, on the loop thread -----------------

    def _succeed(self, value: object) -> None:
        if self._state != _PENDING:  # timed out earlier: the backend is done now
            self._keep = None
            return
        try:
            self._value = self._result_of(value)
        except BaseException as exc:
            self._settle(_FAILED, exc)
        else:
            self._settle(_DONE, None)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        if self._state != _PENDING:
            self._keep = None
            return
        if isinstance(cause, CommError) and type(cause) is kind:
            error: BaseException = type(cause)(f"{describe(*self._what)}: {cause}")
        else:
            error = kind(f"{describe(*self._what)}: {cause}")
        error.__cause__ = cause
        self._settle(_FAILED, error)

    def _expire(self, timeout: float, deadline: float) -> None:
        early = deadline - time.monotonic()
        if early > 0:  # loop timers are rounded to the millisecond: never fire early
            self._timer = self._loop.call_later(early, self._expire, timeout, deadline)
            return
        self._timer = None
        if self._state == _PENDING:
            error = CommTimeoutError(f"{describe(*self._what)} timed out after {timeout:g} s")
            self._state = _FAILED  # keep the buffers: the backend still holds the request
            self._error = error
            self._wake()

    def _settle(self, state: int, error: BaseException | None) -> None:
        self._state = state
        self._error = error
        self._keep = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        for event in self._events:
            event.set()
        self._events.clear()


def completed(loop: asyncio.AbstractEventLoop, what: tuple[Any, ...], value: T) -> Handle[T]:
    """Return a handle that is already done with ``value`` (operations with nothing to send)."""
    handle: Handle[T] = Handle(loop, what, lambda _: value)
    handle._succeed(None)
    return handle
