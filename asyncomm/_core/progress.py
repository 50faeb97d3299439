"""Progress: carry the completion of backend requests from threads onto the rank's event loop.

``FutureBridge``, ``Waiters`` and ``Reaper`` carry completions from backend threads through the
``Inbox``; ``polling.Poller`` tests requests from the loop. Every engine runs the backend's
``finish`` on the loop and settles a ``Sink`` (``handle.deliver``); backend exceptions are
classified into ``CommError`` subclasses.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from asyncomm._core import instrument
from asyncomm._core.errors import CommClosedError
from asyncomm._core.handle import TAKEN, Classify, Finish, Sink, deliver, reraise
from asyncomm._core.polling import Spin


class Inbox:
    """Carry completions from backend threads to the loop: a queue and one wake-up fd.

    Note on waking the loop
    -----------------------
    ``call_soon_threadsafe`` wakes the loop while the calling thread still holds the GIL, so the
    woken loop thread at once blocks on the GIL again (one more thread hand-off, costly on small
    machines). ``os.write`` releases the GIL around the system call: the loop thread wakes to a free
    GIL. Completions queue up between wake-ups and are delivered in one batch; a wake-up is written
    only when none is pending.
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

    def settle(self, sink: Sink, finish: Finish, outcome: Any) -> None:
        """Deliver ``finish(outcome)`` to ``sink`` now (on the loop thread)."""
        deliver(sink, finish, outcome, self._classify)

    def _drain(self) -> None:
        try:
            os.read(self._read_fd, 8)
        except BlockingIOError:
            pass
        self._signalled = False  # before draining: a later put signals again
        queue, classify = self._queue, self._classify
        while queue:
            sink, finish, outcome = queue.popleft()
            deliver(sink, finish, outcome, classify)

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

    Note on spinning
    ----------------
    The callback's hop costs two thread hand-offs (the backend's thread takes the GIL, the loop
    wakes): on a small machine they are most of a small collective's time. So a request watched with
    a bounded ``wait`` is not given its callback when it is issued: a task that awaits its handle
    waits for it itself, in one blocking call that releases the GIL, for up to ``Spin.max_s`` (or
    only looks, after many waits that timed out: see ``Spin``). The callback is given only to the
    requests still pending when the loop iteration that issued them ends, and to those whose task
    gave up.

    Note on callbacks at exit
    -------------------------
    The callback given to a backend future is Python: the backend's thread takes the GIL to run it,
    and again to release it. A thread that wants the GIL once the interpreter has begun to finalize
    is ended with ``pthread_exit``, whose unwinding through the backend's C++ frames calls
    ``std::terminate``. So a future must not be left pending when the process exits: ``pending``
    says whether any callback still exists (each is held weakly here, and dies once the backend has
    run and released it).
    """

    def __init__(self, inbox: Inbox, loop: asyncio.AbstractEventLoop,
                 spin: Spin | None = None) -> None:
        self._inbox = inbox
        self._loop = loop
        self._spin = spin if spin is not None and spin.tests else None
        self._fresh: list[Any] = []  # handles issued this iteration, their callbacks not given
        self._callbacks: weakref.WeakSet[Callable[[Any], None]] = weakref.WeakSet()

    def watch(self, future: Any, sink: Sink, finish: Finish,
              wait: Callable[[float], bool] | None = None) -> None:
        """Settle ``sink`` with ``finish(future)`` once ``future`` is done.

        ``wait(seconds)``: block at most about so long for the request (0: not at
        all) and return whether it is done; it raises nothing (a request that failed
        is done: ``finish`` raises its error). With it, an awaiting task may wait itself.
        """
        if wait is not None and self._spin is not None and hasattr(sink, "_spin"):
            sink._spin = (self, future, finish, wait)  # a handle: see the note
            if not self._fresh:
                self._loop.call_soon(self.enlist)
            self._fresh.append(sink)
            return
        self._call_back(future, sink, finish)

    def spin(self, sink: Any) -> bool:
        """A task awaits ``sink``: wait for it a while (``Spin.block``); settle it if done.

        Return whether the loop's turn is due first (``Spin.allowed``): then look again.
        """
        spin = self._spin
        assert spin is not None
        if not spin.allowed():
            return True
        _, future, finish, wait = sink._spin
        if spin.block(wait):
            sink._spin = None
            self._inbox.settle(sink, finish, future)
        return False

    def enlist(self) -> None:
        """Give their callbacks to the futures issued and still pending (see the note).

        A task may still look at the future after (a task that let the loop turn,
        a handle awaited later): whichever sees it done first settles the handle.
        """
        fresh, self._fresh = self._fresh, []
        for sink in fresh:
            spun = sink._spin
            if spun is not None:  # not settled by its task
                self._call_back(spun[1], sink, self._unless_settled(sink, spun[2]))

    @staticmethod
    def _unless_settled(sink: Any, finish: Finish) -> Finish:
        """``finish``, unless the task that awaits ``sink`` saw it done first and finished it
        (``TAKEN`` then)."""

        def settle(future: Any) -> object:
            if sink._spin is None:
                return TAKEN
            sink._spin = None
            return finish(future)

        return settle

    def _call_back(self, future: Any, sink: Sink, finish: Finish) -> None:
        put = self._inbox.put

        def done(future: Any) -> None:
            recording = instrument.recording()
            if recording is not None:  # the trace's span ends here, not when the loop sees it
                recording.completed(sink, time.perf_counter())
            put(sink, finish, future)

        self._callbacks.add(done)
        future.add_done_callback(done)

    @property
    def pending(self) -> int:
        """Return how many callbacks the backend has not run and released yet."""
        return len(self._callbacks)


WAITER = "asyncomm-waiter"  # a waiter thread's name
ENDLESS = "asyncomm-waiter-endless"  # ... while it waits for an operation that may never end
LOST = "asyncomm-lost"  # a thread left in the wait of an operation its backend lost (gloo's)


class Waiters:
    """Complete requests that only finish inside a blocking ``wait()``.

    Note on threads
    ---------------
    One thread is busy per request in flight; threads are reused, never created per request while
    idle ones exist. Invariant: ``_idle`` counts threads free to take a queued job, so a job never
    waits behind a blocked ``wait()``. A request watched as ``endless`` may never end once its
    communicator is gone (see ``TorchBackend``'s note on teardown): closing does not wait for its
    thread, which stays parked in ``wait()``.
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
                thread = threading.Thread(target=self._serve, name=WAITER, daemon=True)
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
            me.name = ENDLESS if endless else WAITER  # (a thread parked for good says why)
            with self._lock:
                self._waiting[me] = endless
            try:
                wait()
            except BaseException as exc:
                finish = functools.partial(reraise, exc)
            with self._lock:  # free before the report: the loop may post the next job at once
                del self._waiting[me]
                self._idle += 1
            self._inbox.put(sink, finish, None)

    def waiting(self, endless: bool = False) -> int:
        """Return how many threads are inside a ``wait()``: the endless ones, or the others."""
        with self._lock:
            return sum(1 for kind in self._waiting.values() if kind is endless)

    def abandon(self) -> None:
        """Name the threads still inside a ``wait()`` (but endless) ``LOST``: the backend
        lost their operations, so they stay parked for good (``TorchBackend``'s note)."""
        with self._lock:
            for thread, endless in self._waiting.items():
                if not endless:
                    thread.name = LOST

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

    ``watch(wait)`` queues a request; the thread wakes when ``batch`` are queued (or every
    ``period_s``) and calls ``wait()`` on each in turn, so it costs one wake-up per batch rather
    than one per request. A request that raised is kept in ``failures``, under the key it was
    watched with (its destination), for its owner to report.
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

    def abandon(self) -> None:
        """Name the thread ``LOST`` if it is still inside a ``wait()`` (see ``Waiters.abandon``)."""
        if self._thread is not None and self.in_flight:
            self._thread.name = LOST

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread once the queued requests are seen off (or ``timeout`` passed)."""
        if self._thread is not None:
            with self._ready:
                self._closing = True
                self._ready.notify()
            self._thread.join(timeout)
