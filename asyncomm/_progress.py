"""Progress: carry the completion of backend requests onto the rank's event loop.

Three engines, one per way a backend can report that a request is done:

- ``FutureBridge``: the backend completes a future on one of its own threads
  (torch collectives); its callback hops to the loop with
  ``call_soon_threadsafe``.
- ``Waiters``: the request only completes inside a blocking ``wait()`` (gloo
  send/recv cannot be polled). Reusable threads block in ``wait()``, one per
  request *in flight*, so a receive that waits long never delays another
  request's completion. Idle threads are kept for reuse and retire after a while.
- ``Poller``: the request must be tested (MPI). The loop calls the backend's
  ``testsome`` — spinning with ``call_soon`` while completions are expected,
  backing off exponentially to ``max_backoff_s`` when idle, so a rank waiting
  for a message that does not come uses little CPU.

Every engine calls the backend's ``finish(outcome)`` on the loop thread (copy
results out, read a source rank) and then settles a ``Sink`` (the ``Handle``).
Backend exceptions are classified by the backend's ``classify`` into a
``CommError`` subclass; the sink words the message.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asyncomm._errors import CommClosedError, CommError

Finish = Callable[[Any], object]
Classify = Callable[[BaseException], type[CommError]]


class Sink(Protocol):
    """What a finished request is reported to (on the loop thread)."""

    def _succeed(self, value: object) -> None: ...

    def _fail(self, kind: type[CommError], cause: BaseException) -> None: ...

    def _abandon(self, kind: type[CommError], cause: BaseException) -> None:
        """Fail without releasing buffers: the backend may still use them."""


def _deliver(sink: Sink, finish: Finish, outcome: Any, classify: Classify) -> None:
    try:
        value = finish(outcome)
    except BaseException as exc:  # the backend's error, re-raised by finish
        sink._fail(classify(exc), exc)
    else:
        sink._succeed(value)


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) * 1e-6 if value else default


class FutureBridge:
    """Complete requests whose backend future fires on a backend thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, classify: Classify) -> None:
        self._loop = loop
        self._classify = classify

    def watch(self, future: Any, sink: Sink, finish: Finish) -> None:
        """Settle ``sink`` with ``finish(future)`` once ``future`` is done."""
        loop, classify = self._loop, self._classify

        def on_done(done: Any) -> None:  # runs on a backend thread
            try:
                loop.call_soon_threadsafe(_deliver, sink, finish, done, classify)
            except RuntimeError:
                pass  # the loop is closed: nobody can await this any more

        future.add_done_callback(on_done)


class Waiters:
    """Complete requests that only finish inside a blocking ``wait()``.

    Note on threads
    ---------------
    One thread is busy per request in flight; threads are reused, never
    created per request while idle ones exist. Invariant: ``_idle`` counts
    threads free to take a queued job, so a job never waits behind a
    blocked ``wait()``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, classify: Classify,
                 idle_s: float = 30.0) -> None:
        self._loop = loop
        self._classify = classify
        self._idle_s = idle_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Sink, Finish] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def watch(self, wait: Callable[[], object], sink: Sink, finish: Finish) -> None:
        """Settle ``sink`` with ``finish(None)`` once ``wait()`` has returned."""
        with self._lock:
            if self._closed:
                raise CommClosedError("the communicator is closed")
            if self._idle > 0:
                self._idle -= 1
            else:
                thread = threading.Thread(target=self._serve, name="asyncomm-waiter", daemon=True)
                self._threads.add(thread)
                thread.start()
        self._jobs.put((wait, sink, finish))

    @property
    def threads(self) -> int:
        """Return how many waiter threads exist now."""
        return len(self._threads)

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no job is reserved for an idle thread: retire one
                        self._idle -= 1
                        self._threads.discard(me)
                        return
                continue
            if job is None:
                with self._lock:
                    self._threads.discard(me)
                return
            wait, sink, finish = job
            try:
                wait()
            except BaseException as exc:
                error: BaseException | None = exc
            else:
                error = None
            self._report(sink, finish, error)
            with self._lock:
                self._idle += 1

    def _report(self, sink: Sink, finish: Finish, error: BaseException | None) -> None:
        if error is not None:
            def finish_with_error(_: object, exc: BaseException = error) -> object:
                raise exc

            finish = finish_with_error
        try:
            self._loop.call_soon_threadsafe(_deliver, sink, finish, None, self._classify)
        except RuntimeError:
            pass  # the loop is closed: nobody can await this any more

    def close(self, timeout: float = 5.0) -> None:
        """Stop the idle threads; wait up to ``timeout`` for busy ones to return."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Poller:
    """Complete requests by testing them from the event loop: spin while busy, back off when idle.

    The backend supplies ``test(request)`` -> ``(done, outcome)`` and
    ``testsome(requests)`` -> ``[(index, outcome), ...]`` for the completed
    ones; an outcome that is an exception fails its request.

    Note on spinning
    ----------------
    A request is tested once when it is issued (an eager send is often done
    at once: its ``await`` then never suspends). After that the loop polls
    with ``call_soon`` for a while after the last issue or completion, then
    backs off exponentially. *Active* requests -- collectives and sends, which
    MPI only advances inside MPI calls -- keep the loop spinning for
    ``active_spin_s`` so that large transfers are not slowed by back-off;
    a rank with only receives waiting backs off after ``spin_s`` and polls at
    most every ``max_backoff_s``, so waiting costs little CPU.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 test: Callable[[Any], tuple[bool, Any]],
                 testsome: Callable[[Sequence[Any]], list[tuple[int, Any]]],
                 classify: Classify) -> None:
        self._loop = loop
        self._test = test
        self._testsome = testsome
        self._classify = classify
        self._spin_s = _env_seconds("ASYNCOMM_SPIN_US", 2e-3)
        self._active_spin_s = _env_seconds("ASYNCOMM_ACTIVE_SPIN_US", 0.1)
        self._max_backoff_s = _env_seconds("ASYNCOMM_MAX_BACKOFF_US", 1e-3)
        self._requests: list[Any] = []
        self._entries: list[tuple[Sink, Finish, bool]] = []
        self._active = 0  # pending requests that need polling to make progress
        self._timer: asyncio.Handle | None = None
        self._spinning = False
        self._delay = 0.0
        self._last_busy = 0.0

    def __len__(self) -> int:
        return len(self._requests)

    def watch(self, request: Any, sink: Sink, finish: Finish, active: bool = True) -> None:
        """Settle ``sink`` with ``finish(outcome)`` once ``request`` completes."""
        try:
            done, outcome = self._test(request)
        except BaseException as exc:
            sink._fail(self._classify(exc), exc)
            return
        if done:
            _deliver(sink, finish, outcome, self._classify)
            return
        self._requests.append(request)
        self._entries.append((sink, finish, active))
        self._active += active
        self._last_busy = time.monotonic()
        self._delay = 0.0
        if not self._spinning:
            if self._timer is not None:
                self._timer.cancel()
            self._spinning = True
            self._timer = self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        self._timer = None
        requests = self._requests
        if len(requests) == 1:  # the common case: one request, no index bookkeeping
            try:
                done, outcome = self._test(requests[0])
            except BaseException as exc:
                done, outcome = True, exc
            completed = [(0, outcome)] if done else []
        else:
            completed = self._testsome(requests) if requests else []
        now = time.monotonic()
        if completed:
            self._last_busy = now
            self._delay = 0.0
            finished = []
            for index, outcome in sorted(completed, key=lambda pair: pair[0], reverse=True):
                del requests[index]
                finished.append((self._entries.pop(index), outcome))
            for (sink, finish, active), outcome in reversed(finished):
                self._active -= active
                if isinstance(outcome, BaseException):
                    sink._fail(self._classify(outcome), outcome)
                else:
                    _deliver(sink, finish, outcome, self._classify)
        if not self._requests:
            self._spinning = False
            return
        window = self._active_spin_s if self._active else self._spin_s
        if now - self._last_busy < window:
            self._spinning = True
            self._timer = self._loop.call_soon(self._poll)
        else:
            self._spinning = False
            self._delay = min(max(2 * self._delay, 1e-5), self._max_backoff_s)
            self._timer = self._loop.call_later(self._delay, self._poll)

    def drain(self) -> list[tuple[Any, Sink]]:
        """Stop polling and fail every pending sink as closed.

        Return the pending requests with their sinks: the backend cancels
        what it can, and must keep the sinks (which hold the buffers) for as
        long as the requests may still use them.
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._spinning = False
        pending = [(request, sink) for request, (sink, _, _) in zip(self._requests, self._entries,
                                                                    strict=True)]
        self._requests, self._entries, self._active = [], [], 0
        closed = CommClosedError("the communicator was closed with this operation in flight")
        for _, sink in pending:
            sink._abandon(CommClosedError, closed)
        return pending
