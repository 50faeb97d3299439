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
import collections
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from asyncomm._core import settings
from asyncomm._core.errors import CommClosedError, CommError

Finish = Callable[[Any], object]
Classify = Callable[[BaseException], type[CommError]]


class Sink(Protocol):
    """What a finished request is reported to (on the loop thread)."""

    def _succeed(self, value: object) -> None: ...

    def _fail(self, kind: type[CommError], cause: BaseException) -> None: ...

    def _abandon(self, kind: type[CommError], cause: BaseException) -> None:
        """Fail without releasing buffers: the backend may still use them."""


def _deliver(sink: Sink, finish: Finish | None, outcome: Any, classify: Classify) -> None:
    """Settle ``sink`` with ``finish(outcome)``, or (no ``finish``) with the outcome itself."""
    if finish is None:
        sink._succeed(outcome)
        return
    try:
        value = finish(outcome)
    except BaseException as exc:  # the backend's error, re-raised by finish
        sink._fail(classify(exc), exc)
    else:
        sink._succeed(value)


class Inbox:
    """Carry completions from backend threads to the loop: a queue and one wake-up fd.

    Note on waking the loop
    -----------------------
    ``call_soon_threadsafe`` wakes the loop while the calling thread still
    holds the GIL, so the woken loop thread at once blocks on the GIL again
    (one more thread hand-off, costly on small machines). ``os.write``
    releases the GIL around the system call: the loop thread wakes to a
    free GIL. Completions queue up between wake-ups and are delivered in
    one batch; a wake-up is written only when none is pending.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, classify: Classify) -> None:
        self._loop = loop
        self._classify = classify
        self._queue: collections.deque[tuple[Sink, Finish, Any]] = collections.deque()
        self._signalled = False
        if hasattr(os, "eventfd"):
            self._read_fd = self._write_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - not Linux
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
        loop.add_reader(self._read_fd, self._drain)
        self._closed = False

    def put(self, sink: Sink, finish: Finish, outcome: Any) -> None:
        """Deliver ``finish(outcome)`` to ``sink`` on the loop; callable from any thread."""
        if self._closed:
            return  # the loop is gone: nobody can await this any more
        self._queue.append((sink, finish, outcome))
        if not self._signalled:
            self._signalled = True
            try:
                os.write(self._write_fd, b"\x01\0\0\0\0\0\0\0")
            except OSError:
                pass  # closed meanwhile

    def _drain(self) -> None:
        try:
            os.read(self._read_fd, 8)
        except BlockingIOError:
            pass
        self._signalled = False  # before draining: a later put signals again
        queue, classify = self._queue, self._classify
        while queue:
            sink, finish, outcome = queue.popleft()
            _deliver(sink, finish, outcome, classify)

    def close(self) -> None:
        """Deliver what is queued, stop listening and close the fds."""
        if self._closed:
            return
        self._drain()
        self._closed = True
        self._loop.remove_reader(self._read_fd)
        os.close(self._read_fd)
        if self._write_fd != self._read_fd:
            os.close(self._write_fd)


class FutureBridge:
    """Complete requests whose backend future fires on a backend thread.

    Note on callbacks at exit
    -------------------------
    The callback given to a backend future is Python: the backend's thread
    takes the GIL to run it, and again to release it. A thread that wants
    the GIL once the interpreter has begun to finalize is ended with
    ``pthread_exit``, whose unwinding through the backend's C++ frames calls
    ``std::terminate``. So a future must not be left pending when the process
    exits: ``pending`` says whether any callback still exists (each is held
    weakly here, and dies once the backend has run and released it).
    """

    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox
        self._callbacks: weakref.WeakSet[Callable[[Any], None]] = weakref.WeakSet()

    def watch(self, future: Any, sink: Sink, finish: Finish) -> None:
        """Settle ``sink`` with ``finish(future)`` once ``future`` is done."""
        put = self._inbox.put

        def done(future: Any) -> None:
            put(sink, finish, future)

        self._callbacks.add(done)
        future.add_done_callback(done)

    @property
    def pending(self) -> int:
        """Return how many callbacks the backend has not run and released yet."""
        return len(self._callbacks)


class Waiters:
    """Complete requests that only finish inside a blocking ``wait()``.

    Note on threads
    ---------------
    One thread is busy per request in flight; threads are reused, never
    created per request while idle ones exist. Invariant: ``_idle`` counts
    threads free to take a queued job, so a job never waits behind a
    blocked ``wait()``. A request watched as ``endless`` may never end
    once its communicator is gone (see ``TorchBackend``'s note on teardown):
    closing does not wait for its thread, which stays parked in ``wait()``.
    """

    def __init__(self, inbox: Inbox, idle_s: float = 30.0) -> None:
        self._inbox = inbox
        self._idle_s = idle_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Sink, Finish, bool] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: set[threading.Thread] = set()
        self._waiting: dict[threading.Thread, bool] = {}  # inside wait(): whether endless
        self._closed = False

    def watch(self, wait: Callable[[], object], sink: Sink, finish: Finish,
              endless: bool = False) -> None:
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
        self._jobs.put((wait, sink, finish, endless))

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
            wait, sink, finish, endless = job
            with self._lock:
                self._waiting[me] = endless
            try:
                wait()
            except BaseException as exc:
                error: BaseException | None = exc
            else:
                error = None
            with self._lock:  # free before the report: the loop may post the next job at once
                del self._waiting[me]
                self._idle += 1
            self._report(sink, finish, error)

    def _report(self, sink: Sink, finish: Finish, error: BaseException | None) -> None:
        if error is not None:
            def finish_with_error(_: object, exc: BaseException = error) -> object:
                raise exc

            finish = finish_with_error
        self._inbox.put(sink, finish, None)

    def waiting(self, endless: bool = False) -> int:
        """Return how many threads are inside a ``wait()``: the endless ones, or the others."""
        with self._lock:
            return sum(1 for kind in self._waiting.values() if kind is endless)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the idle threads; wait up to ``timeout`` for busy ones (but endless) to return."""
        with self._lock:
            self._closed = True
            threads = [t for t in self._threads if not self._waiting.get(t, False)]
            count = len(self._threads)
        for _ in range(count):
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class Reaper:
    """See off requests nobody awaits (eager sends), in batches, on one thread.

    ``watch(wait)`` queues a request; the thread wakes when ``batch`` are
    queued (or every ``period_s``) and calls ``wait()`` on each in turn, so
    it costs one wake-up per batch rather than one per request. A request
    that raised is kept in ``failures``, under the key it was watched with
    (its destination), for its owner to report.
    """

    def __init__(self, batch: int = 16, period_s: float = 0.1) -> None:
        self._batch = batch
        self._period_s = period_s
        self._jobs: collections.deque[tuple[Callable[[], object], object]] = (
            collections.deque())
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.issued = 0  # written by the owner's thread only
        self.reaped = 0  # written by the reaper thread only
        self.failures: dict[object, BaseException] = {}  # the first failure, per key

    @property
    def in_flight(self) -> int:
        """Return how many requests are not seen off yet."""
        return self.issued - self.reaped

    def watch(self, wait: Callable[[], object], key: object = None) -> None:
        """Queue ``wait`` to be called on the reaper thread; a failure is kept under ``key``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="asyncomm-reaper",
                                            daemon=True)
            self._thread.start()
        self.issued += 1
        self._jobs.append((wait, key))
        if len(self._jobs) >= self._batch:
            with self._ready:
                self._ready.notify()

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._closing or len(self._jobs) >= self._batch,
                                     self._period_s)
                closing = self._closing
            while self._jobs:
                wait, key = self._jobs.popleft()
                try:
                    wait()
                except BaseException as exc:
                    self.failures.setdefault(key, exc)
                self.reaped += 1
            if closing:
                return

    @property
    def running(self) -> bool:
        """Return whether the thread is alive (it may be inside a request's ``wait()``)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread once the queued requests are seen off (or ``timeout`` passed)."""
        if self._thread is not None:
            with self._ready:
                self._closing = True
                self._ready.notify()
            self._thread.join(timeout)


FAIR_S = 1e-3  # tasks that hurry hold the loop from its other work at most about so long


class Hurry:
    """How long a task about to wait looks for what it waits for itself, learnt from its waits.

    Note on learning
    ----------------
    A task first looks ``tests`` times (a request done within microseconds
    then costs no loop iteration). Beyond that it looks for up to
    ``budget_s``, learnt: when a task parked after looking and what it
    waited for came within ``max_s`` of its first look (an answer to a
    question, in a ping-pong or an actor call), the budget grows to cover
    that wait half again; when it came later (an idle wait), the budget
    halves. So request-response traffic is caught without parking, while a
    rank whose waits are long looks ``tests`` times and parks: the loop is
    never held more than ``max_s`` by one look, and only while looking paid
    off recently.

    A task that finds what it looks for goes on without a loop iteration,
    so tasks that hurry with success one after the other (a ping-pong)
    could keep the loop from everything else. Each look therefore asks the
    loop for a turn, and no task looks while a turn asked for more than
    ``FAIR_S`` ago has not come: it parks, and the loop turns.
    """

    __slots__ = ("_loop", "_since", "_turn", "budget_s", "max_s", "tests")

    def __init__(self, loop: asyncio.AbstractEventLoop, tests: int, max_s: float) -> None:
        self._loop = loop
        self.tests = tests
        self.max_s = max_s
        self.budget_s = 0.0
        self._since = 0.0  # when the look that gave up began (0: no parked look pending)
        self._turn = 0.0  # when the loop was asked for a turn that has not come yet (0: none)

    def run(self, look: Callable[[], bool]) -> bool:
        """Call ``look()`` until it returns true (return true) or the budget is spent.

        With no tests (``ASYNCOMM_HURRY_TESTS=0``) there is no hurrying at all.
        """
        if not self.allowed():
            return False
        start = time.perf_counter()
        for _ in range(self.tests):
            if look():
                return True
        if self.budget_s:
            clock, end = time.perf_counter, start + self.budget_s
            while clock() < end:
                if look():
                    return True
        self._since = start
        return False

    def allowed(self) -> bool:
        """Return whether a task may look now (see the note: never without tests, and not
        while a loop turn asked for ``FAIR_S`` ago has not come); ask for a turn if none is."""
        if not self.tests:
            return False
        if not self._turn:
            self._turn = time.perf_counter()
            self._loop.call_soon(self._turned)
            return True
        return time.perf_counter() - self._turn <= FAIR_S

    def _turned(self) -> None:
        self._turn = 0.0

    def came(self) -> None:
        """What a task that gave up looking waits for may have come: learn how long it took."""
        if self._since:
            waited = time.perf_counter() - self._since
            self._since = 0.0
            if waited <= self.max_s:
                self.budget_s = min(self.max_s, max(self.budget_s, 1.5 * waited))
            else:
                self.budget_s = self.budget_s / 2 if self.budget_s > 1e-6 else 0.0


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
    most every ``max_backoff_s``, so waiting costs little CPU. *Probes*
    (``probe``) are called at every poll, with or without requests in
    flight: the MPI channel link finds its messages so. ``kick`` resets the
    back-off when something is expected soon.

    Note on hurrying
    ----------------
    A task that awaits a request first tests it ``hurry_tests`` times itself
    (``hurry``, from ``Handle.__await__``): a request that completes within
    microseconds (a collective its peers have entered, a reply on its way)
    then costs no loop iteration, as in a busy-poll loop, while one that
    takes longer parks the task and leaves the loop to others. The bound is
    the loop's fairness: 32 tests hold the loop for about 10 µs at most. A
    channel receive, an actor call or an idle actor about to wait sweeps
    (``hurry_until``: the requests and the probes, so the MPI link finds its
    messages) for as long as ``Hurry`` has learnt pays off.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 test: Callable[[Any], tuple[bool, Any]],
                 testsome: Callable[[Sequence[Any]], list[tuple[int, Any]]],
                 classify: Classify) -> None:
        self._loop = loop
        self._test = test
        self._testsome = testsome
        self._classify = classify
        polling = settings.read()
        self._spin_s = polling.spin_s
        self._active_spin_s = polling.active_spin_s
        self._max_backoff_s = polling.max_backoff_s
        self._hurry = Hurry(loop, polling.hurry_tests, polling.hurry_max_s)
        self._requests: list[Any] = []
        self._entries: list[tuple[Sink, Finish | None, bool]] = []
        self._active = 0  # pending requests that need polling to make progress
        self._fresh: list[Any] = []  # sinks whose requests join the lists as the iteration ends
        self._probes: list[Callable[[], bool]] = []
        self._timer: asyncio.Handle | None = None
        self._spinning = False  # a poll runs or is due at the next loop iteration
        self._delay = 0.0
        self._last_busy = 0.0

    def watch(self, request: Any, sink: Sink, finish: Finish | None,
              active: bool = True) -> None:
        """Settle ``sink`` with ``finish(outcome)`` (or the outcome) once ``request`` completes.

        A request its task may finish itself (a handle: see ``hurry``) joins
        the requests polled only when the loop iteration ends, if it is still
        pending then: most are done by then, and cost no bookkeeping.
        """
        try:
            done, outcome = self._test(request)
        except BaseException as exc:
            sink._fail(self._classify(exc), exc)
            return
        if done:
            _deliver(sink, finish, outcome, self._classify)
            return
        entry = (sink, finish, active)
        if self._hurry.tests and hasattr(sink, "_hurry"):
            sink._hurry = (self, request, entry)
            fresh = self._fresh
            if not fresh:
                self._loop.call_soon(self._enlisted)
            fresh.append(sink)
            return
        self._add(request, entry)

    def _add(self, request: Any, entry: tuple[Sink, Finish | None, bool]) -> None:
        self._requests.append(request)
        self._entries.append(entry)
        self._active += entry[2]
        self.kick()

    def _enlist(self) -> bool:
        """Poll the requests issued (``watch``) and still pending; return whether any were."""
        fresh, self._fresh = self._fresh, []
        added = False
        for sink in fresh:
            hurried = sink._hurry
            if hurried is not None and hurried[2] is not None:  # not finished by its task
                sink._hurry = (self, hurried[1], None)
                self._add(hurried[1], hurried[2])
                added = True
        return added

    def _enlisted(self) -> None:
        """The iteration that issued requests ended: those still pending are polled now."""
        if self._enlist() and self._timer is not None:
            self._timer.cancel()  # the poll ``kick`` asked for comes next iteration: now
            self._poll()

    def hurry(self, sink: Any) -> None:
        """Test ``sink``'s request a bounded number of times; settle it now if it completes.

        Only ``tests`` times, never for a learnt while: tasks that await requests are
        often many at once (a gather of sends), and each would hold the others back.
        """
        hurry, test = self._hurry, self._test
        if not hurry.allowed():
            return
        _, request, entry = sink._hurry
        for _ in range(hurry.tests):
            try:
                done, outcome = test(request)
            except BaseException as exc:
                done, outcome = True, exc
            if done:
                break
        else:
            return
        sink._hurry = None
        if entry is None:  # polled already: no longer
            try:
                index = self._requests.index(request)
            except ValueError:
                return  # settled meanwhile (or drained)
            del self._requests[index]
            entry = self._entries.pop(index)
            self._active -= entry[2]
        self._settle(entry, outcome)

    def _settle(self, entry: tuple[Sink, Finish | None, bool], outcome: Any) -> None:
        """Settle the sink of a request that completed (taken out of the lists already)."""
        sink, finish, _ = entry
        if isinstance(outcome, BaseException):
            sink._fail(self._classify(outcome), outcome)
        else:
            _deliver(sink, finish, outcome, self._classify)

    def probe(self, probe: Callable[[], bool]) -> None:
        """Call ``probe()`` at every poll until ``unprobe``; it returns whether it found work.

        A probe keeps the poller polling with nothing in flight (backing off when idle).
        """
        self._probes.append(probe)
        self.kick()

    def unprobe(self, probe: Callable[[], bool]) -> None:
        """Stop calling ``probe``."""
        if probe in self._probes:
            self._probes.remove(probe)

    def kick(self) -> None:
        """Poll at once and spin a while: something is expected soon."""
        self._last_busy = time.monotonic()
        self._delay = 0.0
        if not self._spinning:
            if self._timer is not None:
                self._timer.cancel()
            self._spinning = True
            self._timer = self._loop.call_soon(self._poll)

    def sweep(self) -> bool:
        """Test the requests in flight and call the probes, once; return whether any had news."""
        if self._fresh:  # (a task that sweeps may wait for them)
            self._enlist()
        requests = self._requests
        news = False
        if requests:
            if len(requests) == 1:  # the common case: one request, no index bookkeeping
                try:
                    done, outcome = self._test(requests[0])
                except BaseException as exc:
                    done, outcome = True, exc
                completed = [(0, outcome)] if done else []
            else:
                completed = self._testsome(requests)
            if completed:
                news = True
                finished = []
                for index, outcome in sorted(completed, key=lambda pair: pair[0], reverse=True):
                    del requests[index]
                    entry = self._entries.pop(index)
                    self._active -= entry[2]
                    finished.append((entry, outcome))
                for entry, outcome in reversed(finished):
                    self._settle(entry, outcome)
        for probe in tuple(self._probes) if len(self._probes) > 1 else self._probes:
            if probe():  # (a probe may unregister itself: a copy of several)
                news = True
        return news

    def hurry_until(self, done: Callable[[], bool]) -> bool:
        """A task is about to wait for ``done()``: sweep while hurrying (see ``Hurry``).

        Return whether ``done()`` became true.
        """
        sweep = self.sweep
        return self._hurry.run(lambda: sweep() and done())

    def _poll(self) -> None:
        self._timer = None
        self._spinning = True  # what is issued from here on is polled when this poll ends
        now = time.monotonic()
        if self.sweep():
            self._last_busy = now
            self._delay = 0.0
            self._hurry.came()
        if not self._requests and not self._probes:
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

    def drain(self) -> list[tuple[Any, Sink, bool]]:
        """Stop polling and fail every pending sink as closed.

        Return the pending requests with their sinks: the backend cancels
        what it can, and must keep the sinks (which hold the buffers) for as
        long as the requests may still use them.
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._spinning = False
        self._probes.clear()
        self._enlist()
        pending = [(request, sink, active) for request, (sink, _, active)
                   in zip(self._requests, self._entries, strict=True)]
        self._requests, self._entries, self._active = [], [], 0
        closed = CommClosedError("the communicator was closed with this operation in flight")
        for _, sink, _ in pending:
            sink._abandon(CommClosedError, closed)
        return pending
