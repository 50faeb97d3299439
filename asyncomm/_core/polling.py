"""Polling: how a waiting task, or the loop, finds that a request is done.

``Spin`` spins, then parks, for a task awaiting a request; ``Poller`` tests MPI's requests from
the loop; ``Ticker`` wakes a backing-off poller finer than the loop's millisecond timers. The
engines that complete requests on threads are in ``progress``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from asyncomm._core import instrument, settings
from asyncomm._core.errors import CommClosedError
from asyncomm._core.handle import Classify, Finish, Sink, deliver

TICKING_S = 0.25  # a poller backing off is woken by the ticker this long after it found news
# Tracing: a longer time with requests in flight and none tested is reported as a stall
# (see the note on stalls).
STALL_S = 0.001
_tested = [0.0]  # when this process's last test of requests ended (kept only while tracing)


FAIR_S = 1e-3  # tasks that spin hold the loop from its other work at most about so long
MISSES = 8  # spins in a row that found nothing, after which a task spins 1 wait in MISSES

_due: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], object]]] = (
    weakref.WeakKeyDictionary())


def due_at(loop: asyncio.AbstractEventLoop) -> list[Callable[[], object]]:
    """Return ``loop``'s work due at its iteration's end (see ``Spin``'s note on what is due): one
    list per loop, which its owners append to and remove from in place."""
    return _due.setdefault(loop, [])


class _Turn:
    """The loop turn that a loop's spinning tasks asked for (see ``Spin``'s note on fairness):
    one per loop, shared by its spins, so that its other work knows when tasks hold it."""

    __slots__ = ("asked",)

    def __init__(self) -> None:
        self.asked = 0.0  # when a turn was asked that has not come yet (0: none)

    def came(self) -> None:
        """The loop's turn came: the tasks that spun gave the loop back."""
        self.asked = 0.0


_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Turn] = weakref.WeakKeyDictionary()


class Spin:
    """Spin-then-park for the tasks of one engine: a few ``tests``, then polls for up to
    ``max_s``; found, the task goes on with no loop iteration and no wake-up; not found, it
    parks, and the loop's poller (or a thread) wakes it. The MPI poller polls a request's
    ``Test`` or the link's receive; the future bridge of gloo's collectives blocks in one
    bounded ``wait`` instead (``block``).

    Note on misses
    --------------
    A spin that found nothing cost its ``max_s`` for nothing. After ``MISSES`` such waits in a row
    (a rank whose waits are long: idle, or computing), a task spins only every ``MISSES``-th wait
    until one finds what it waits for again; so request-response traffic is caught without parking,
    and a rank that waits long wastes at most ``max_s`` in every ``MISSES`` waits.

    Note on fairness
    ----------------
    A task that finds what it spins for goes on without a loop iteration, so tasks that succeed one
    after the other (a ping-pong) could keep the loop from everything else. Each spin therefore asks
    the loop for a turn (one turn for all the spins of a loop, ``_Turn``), and no task spins while a
    turn asked for more than ``FAIR_S`` ago has not come: it yields that turn instead (``refused``).

    Note on what is due
    -------------------
    Some work waits for the loop iteration's end: a link's packet of small frames (so that the
    frames of one iteration travel together). A task that spins holds the loop, so the iteration
    cannot end while it does; and what it waits for may be the peer's answer to that very work. So
    such work is also listed in its loop's ``due`` list, and a task about to spin does it first.
    """

    __slots__ = ("_due", "_loop", "_turn", "max_s", "misses", "refused", "tests")

    def __init__(self, loop: asyncio.AbstractEventLoop, tests: int, max_s: float) -> None:
        self._loop = loop
        self._due = due_at(loop)
        self.tests = tests  # 0: no spinning at all
        self.max_s = max_s
        self.misses = 0  # waits in a row whose spin found nothing
        self._turn = _turns.setdefault(loop, _Turn())
        # whether the last ``run`` was refused until that turn comes (not: it polled): its
        # task yields the turn and spins then (parking costs it a poll and a wake-up)
        self.refused = False

    def run(self, poll: Callable[[], bool], done: Callable[[], bool] = lambda: True,
            then: Callable[[], bool] | None = None) -> bool:
        """Call ``poll()`` until it and then ``done()`` return true (return true), or the
        spin ends: after ``tests`` polls at least, and ``max_s`` (see the note on misses).

        ``done`` is asked only after a poll that found something; from then on ``then``
        polls, where given.
        """
        if not self.allowed():
            self.refused = self.tests > 0
            return False
        self.refused = False
        polls, spins, clock = 0, self._spins(), time.perf_counter
        end = clock() + self.max_s if spins else 0.0
        while polls < self.tests or (spins and clock() < end):
            polls += 1
            if poll():
                if done():
                    self.misses = 0
                    return True
                poll = then or poll
        self.misses += 1
        return False

    def block(self, wait: Callable[[float], bool]) -> bool:
        """Call ``wait(max_s)`` once (blocking so long at most; 0: not at all, see the note
        on misses); return whether what it waits for came."""
        if wait(self.max_s if self._spins() else 0.0):
            self.misses = 0
            return True
        self.misses += 1
        return False

    def _spins(self) -> bool:
        return bool(self.max_s) and (self.misses < MISSES or not self.misses % MISSES)

    def allowed(self) -> bool:
        """Return whether a task may spin now (never without tests, and not while a loop
        turn asked for ``FAIR_S`` ago has not come); ask for a turn if none is asked.

        A task that may spin does the work due at the iteration's end first."""
        if not self.tests:
            return False
        if self._due:  # what the peers may be waiting for goes first (see the note)
            self._run_due()
        turn = self._turn
        if not turn.asked:
            turn.asked = time.perf_counter()
            self._loop.call_soon(turn.came)
            return True
        return time.perf_counter() - turn.asked <= FAIR_S

    def holding(self) -> bool:
        """Return whether tasks of this loop (any poller's) hold it spinning: a turn they
        asked for has not come yet."""
        return bool(self._turn.asked)

    def _run_due(self) -> None:
        """Do the work due at the iteration's end now, in the order it was listed."""
        due = self._due
        while due:
            work = due.pop(0)
            try:
                work()
            except Exception as exc:  # a bug: said as the loop's callback would, not
                self._loop.call_exception_handler({  # raised into the task that spins
                    "message": "asyncomm: work due at the loop iteration's end failed",
                    "exception": exc})


class Ticker:
    """Wake a loop's pollers every ``tick_s`` while they ask: finer than the loop's timers.

    Note on ticking
    ---------------
    An event loop's timers count whole milliseconds (libuv's, and the selectors' waits): a poller
    that backs off polls at once or a millisecond later, nothing in between. A rank whose stage
    computes on a thread while its next activation arrives then saw each message up to a millisecond
    late, several times a pipeline step. So for ``TICKING_S`` after its last news a poller backing
    off also asks the ticker, a thread that sleeps ``tick_s`` (the OS sleeps finer than the loop)
    and then schedules the poll on the loop; the millisecond timer stays as a floor. It ticks only
    then, so a rank whose waits are long is not woken by it; and not while tasks hold the loop
    spinning (``Spin.holding``: a turn they asked for has not come). They give the loop a turn at
    least every ``FAIR_S``, which a tick would wait for too; while they spin, a message for this
    poller waits for such a turn and the poller's own timer (at most ``max_backoff_s``) instead,
    and the thread's wake-ups do not take the GIL and a core from them and their peers.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float) -> None:
        self._loop = loop
        self.tick_s = tick_s
        self._wanted: list[Callable[[], None]] = []
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._users = 0  # pollers holding it (``hold``, ``release``)

    def hold(self) -> None:
        """A poller uses the ticker (until ``release``)."""
        self._users += 1

    def release(self) -> None:
        """A poller is done with the ticker: the last one ends its thread."""
        self._users -= 1
        if not self._users:
            self.stop()

    def want(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop after about ``tick_s`` (once per ``want``)."""
        with self._ready:
            if callback not in self._wanted:
                self._wanted.append(callback)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asyncomm-ticker",
                                                daemon=True)
                self._thread.start()
            self._ready.notify()

    def stop(self) -> None:
        """End the thread now (the last poller is drained); a later ``want`` starts one."""
        with self._ready:
            thread, self._thread = self._thread, None
            self._wanted.clear()
            self._ready.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._ready:
                if not self._wanted and not self._ready.wait_for(
                        lambda: self._wanted or self._thread is not me, 1.0):
                    self._thread = None  # unwanted for a second: a later ``want`` starts one
                    return
                if self._thread is not me:  # stopped
                    return
            time.sleep(self.tick_s)
            with self._ready:
                if self._thread is not me:
                    return
                wanted, self._wanted = self._wanted, []
            for callback in wanted:
                try:
                    self._loop.call_soon_threadsafe(callback)
                except RuntimeError:  # the loop is closed
                    with self._ready:
                        if self._thread is me:
                            self._thread = None
                    return


_tickers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Ticker] = (
    weakref.WeakKeyDictionary())  # one per loop, shared by its pollers


_computes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[int]] = (
    weakref.WeakKeyDictionary())


def computing(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Return ``loop``'s count of computes in flight, a cell its users change in place.

    ``asyncomm.compute`` counts its jobs in and out (on the loop thread); pollers
    read it (see the note on busy polling).
    """
    return _computes.setdefault(loop, [0])


class Poller:
    """Complete requests by testing them from the loop: every turn while busy, less when idle.

    The backend supplies ``test(request, scratch)`` -> whether it is done (``outcome()`` then says
    what it reported, from ``scratch``: both are called on every test, so they are best the engine's
    own, such as ``MPI.Request.Test`` and ``Status.Get_source``, with no Python frame) and
    ``testsome(requests)`` -> ``[(index, outcome), ...]`` for the completed ones; an outcome that is
    an exception fails its request.

    Note on busy polling
    --------------------
    (docs/api.md, "How completion reaches the loop", gives the defaults.) After the last issue or
    completion the loop polls with ``call_soon`` for a while, then backs off exponentially: for
    ``active_busy_s`` while *active* requests (collectives and sends, which MPI advances only inside
    MPI calls) are in flight, so that large transfers are not slowed, else for ``busy_s``, then
    polling at most every ``max_backoff_s``. *Pumps* (``add_pump``) are called at every poll, with
    or without requests in flight: the MPI channel link finds its messages so. ``kick`` resets the
    back-off. While a compute runs on the loop's threads (counted by ``computing``) and the ticker
    wakes the poller, it does not poll busily for receives: a busy loop takes the core and the GIL
    the compute needs, and the ticker sees their messages within ``tick_s``.

    Note on spinning
    ----------------
    ``watch`` tests a request twice as it is issued (an eager send is often done at once; MPICH's
    first test of a small collective often only starts it). A task that awaits a request first tests
    it ``spin_tests`` times itself (``spin``, from ``Handle.__await__``): one that completes within
    microseconds then costs no loop iteration, one that takes longer parks the task. A channel
    receive, an actor call or an idle actor about to wait spins (``spin_until``: the requests and
    the probes) as ``Spin`` says.

    Note on stalls
    --------------
    MPI moves the data of a request only inside MPI calls (MPICH without its asynchronous progress
    thread), and every test advances every request of the process. A request in flight while nothing
    tests it (the loop held by a computation, or backing off) is not progressing, and communication
    that sits so under compute is not hidden by it. While tracing, each time requests are issued or
    tested with requests in flight, a gap of over ``STALL_S`` since the end of the process's last
    test is reported as a stall (``Recording.stalled``); communication under compute during a stall
    is not counted as hidden (docs/tracing.md).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 test: Callable[[Any, Any], bool], scratch: Any, outcome: Callable[[], Any],
                 testsome: Callable[[Sequence[Any]], list[tuple[int, Any]]],
                 classify: Classify) -> None:
        self._loop = loop
        self._test = test
        self._scratch = scratch
        self._outcome = outcome
        self._testsome = testsome
        self._classify = classify
        polling = settings.read()
        self._busy_s = polling.busy_s
        self._active_busy_s = polling.active_busy_s
        self._max_backoff_s = polling.max_backoff_s
        self._spin = Spin(loop, polling.spin_tests, polling.spin_max_s)
        self._ticker: Ticker | None = None
        if 0 < polling.tick_s < polling.max_backoff_s:
            self._ticker = _tickers[loop] = _tickers.get(loop) or Ticker(loop, polling.tick_s)
            self._ticker.hold()  # until ``drain``
        self._computing = computing(loop)
        self._requests: list[Any] = []
        self._entries: list[tuple[Sink, Finish | None, bool]] = []
        self._active = 0  # pending requests that need polling to make progress
        self._fresh: list[Any] = []  # sinks whose requests join the lists as the iteration ends
        self._pumps: list[Callable[[], bool]] = []
        self._timer: asyncio.Handle | None = None
        self._busy = False  # a poll runs or is due at the next loop iteration
        self._delay = 0.0
        self._last_busy = 0.0  # when a request was issued or completed, or a poll expected
        self._last_news = 0.0  # when a poll last found something

    def watch(self, request: Any, sink: Sink, finish: Finish | None,
              active: bool = True) -> None:
        """Settle ``sink`` with ``finish(outcome)`` (or the outcome) once ``request`` completes.

        A request its task may finish itself (a handle: see ``spin``) joins
        the requests polled only when the loop iteration ends, if it is still
        pending then: most are done by then, and cost no bookkeeping.
        """
        recording = instrument.recording()
        if recording is not None:
            self._testing(recording)
        try:
            test, scratch = self._test, self._scratch
            # twice: a collective's first test often only starts it (see the note on spinning)
            done = test(request, scratch) or test(request, scratch)
            outcome = self._outcome() if done else None
        except BaseException as exc:
            sink._fail(self._classify(exc), exc)
            return
        finally:
            if recording is not None:
                _tested[0] = time.perf_counter()
        if done:
            deliver(sink, finish, outcome, self._classify)
            return
        self.follow(request, sink, finish, active)

    def follow(self, request: Any, sink: Sink, finish: Finish | None,
               active: bool = True) -> None:
        """``watch`` a request its issuer has just tested and found pending (no test here)."""
        recording = instrument.recording()
        if recording is not None:
            self._testing(recording)  # (its issuer's test has just ended)
            _tested[0] = time.perf_counter()
        entry = (sink, finish, active)
        if self._spin.tests and hasattr(sink, "_spin"):
            sink._spin = (self, request, entry, 0.0)
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
            spun = sink._spin
            if spun is not None and spun[2] is not None:  # not finished by its task
                request = spun[1]
                sink._spin = (self, request, None, spun[3])
                self._add(request, spun[2])
                added = True
        return added

    def _enlisted(self) -> None:
        """The iteration that issued requests ended: those still pending are polled now."""
        if self._enlist() and self._timer is not None:
            self._timer.cancel()  # the poll ``kick`` asked for comes next iteration: now
            self._poll()

    def spin(self, sink: Any) -> bool:
        """Test ``sink``'s request a bounded number of times; settle it now if it completes.

        Only ``tests`` times, never for a while: tasks that await requests are often many at once (a
        gather of sends), and each would hold the others back. Return whether its task is to yield
        the loop a turn and test again: when the loop's turn is due first (``Spin.allowed``), or
        while the wait is young (within ``max_s`` of its first test: an answer a little slower than
        the tests then costs a loop turn, not a park and a poll's wake-up).
        """
        spin, test, scratch = self._spin, self._test, self._scratch
        if not spin.allowed():
            return spin.tests > 0
        _, request, entry, since = sink._spin
        recording = instrument.recording()
        if recording is not None:
            self._testing(recording)
        try:
            for _ in range(spin.tests):
                if test(request, scratch):
                    break
            else:  # not done: its task looks again after a loop turn while the wait is young
                now = time.perf_counter()
                if not since:
                    sink._spin = (self, request, entry, now)
                    return True
                return bool(now - since < spin.max_s)
            outcome = self._outcome()
        except BaseException as exc:
            outcome = exc
        finally:
            if recording is not None:
                _tested[0] = time.perf_counter()
        sink._spin = None
        if entry is None:  # polled already: no longer
            try:
                index = self._requests.index(request)
            except ValueError:
                return False  # settled meanwhile (or drained)
            del self._requests[index]
            entry = self._entries.pop(index)
            self._active -= entry[2]
        self._settle(entry, outcome)
        return False

    def _settle(self, entry: tuple[Sink, Finish | None, bool], outcome: Any) -> None:
        """Settle the sink of a request that completed (taken out of the lists already)."""
        sink, finish, _ = entry
        if isinstance(outcome, BaseException):
            sink._fail(self._classify(outcome), outcome)
        else:
            deliver(sink, finish, outcome, self._classify)

    def add_pump(self, pump: Callable[[], bool]) -> None:
        """Call ``pump()`` at every poll until ``remove_pump``; it returns whether it found work
        (it takes what arrived: a link's receive, say).

        A pump keeps the poller polling with nothing in flight (backing off when idle).
        """
        self._pumps.append(pump)
        self.kick()

    def remove_pump(self, pump: Callable[[], bool]) -> None:
        """Stop calling ``pump``."""
        if pump in self._pumps:
            self._pumps.remove(pump)

    def kick(self) -> None:
        """Poll at once and busily for a while: something is expected soon."""
        self._last_busy = time.monotonic()
        self._delay = 0.0
        if not self._busy:
            if self._timer is not None:
                self._timer.cancel()
            self._busy = True
            self._timer = self._loop.call_soon(self._poll)

    def sweep(self) -> bool:
        """Test the requests in flight and call the probes, once; return whether any had news."""
        if self._fresh:  # (a task that sweeps may wait for them)
            self._enlist()
        requests = self._requests
        news = False
        if requests:
            recording = instrument.recording()
            if recording is not None:
                self._testing(recording)
            if len(requests) == 1:  # the common case: one request, no index bookkeeping
                try:
                    completed = ([(0, self._outcome())] if self._test(requests[0], self._scratch)
                                 else [])
                except BaseException as exc:
                    completed = [(0, exc)]
            else:
                completed = self._testsome(requests)
            if recording is not None:
                _tested[0] = time.perf_counter()
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
        for pump in tuple(self._pumps) if len(self._pumps) > 1 else self._pumps:
            if pump():  # (a pump may remove itself: a copy of several)
                news = True
        return news

    def _testing(self, recording: instrument.Recording) -> None:
        """Tracing: requests are about to be tested; report the time since the end of the
        process's last test as a stall if requests were in flight all along (see the note on
        stalls). The caller notes in ``_tested`` when its tests end."""
        now = time.perf_counter()
        if (self._requests or self._fresh) and now - _tested[0] > STALL_S:
            recording.stalled(_tested[0], now)

    def spin_until(self, done: Callable[[], bool]) -> bool:
        """A task is about to wait for ``done()``: sweep while spinning (see ``Spin``).

        Return whether ``done()`` became true.
        """
        if len(self._pumps) == 1 and not self._requests and not self._fresh:
            # the commonest (one link, no request in flight): the pump alone, until it
            # finds something not awaited (a frame whose data it began to receive)
            return self._spin.run(self._pumps[0], done, self.sweep)
        return self._spin.run(self.sweep, done)

    def refused(self) -> bool:
        """Return whether the last ``spin_until`` was refused until the loop turns (see
        ``Spin``)."""
        return self._spin.refused

    def _poll(self) -> None:
        self._timer = None
        self._busy = True  # what is issued from here on is polled when this poll ends
        now = time.monotonic()
        if self.sweep():
            self._last_busy = self._last_news = now
            self._delay = 0.0
        if not self._requests and not self._pumps:
            self._busy = False
            return
        window = (self._active_busy_s if self._active else
                  0.0 if self._computing[0] and self._ticker is not None else self._busy_s)
        if now - self._last_busy < window:
            self._busy = True
            self._timer = self._loop.call_soon(self._poll)
        else:
            self._busy = False
            self._delay = min(max(2 * self._delay, 1e-5), self._max_backoff_s)
            self._timer = self._loop.call_later(self._delay, self._poll)
            if (self._ticker is not None and now - self._last_news < TICKING_S
                    and not self._spin.holding()):
                self._ticker.want(self._ticked)  # sooner than the loop's timers can

    def _ticked(self) -> None:
        """The ticker's wake-up (see ``Ticker``): poll now unless a poll is due anyway."""
        if not self._busy and self._timer is not None:
            self._timer.cancel()
            self._poll()

    def drain(self) -> list[tuple[Any, Sink, bool]]:
        """Stop polling and fail every pending sink as closed.

        Return the pending requests with their sinks: the backend must keep the sinks (which hold
        the buffers) for as long as the requests may still use them.
        """
        self._enlist()  # (first: enlisting asks for a poll, cancelled here)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._busy = False
        self._pumps.clear()
        if self._ticker is not None:
            self._ticker.release()
            self._ticker = None
        pending = [(request, sink, active) for request, (sink, _, active)
                   in zip(self._requests, self._entries, strict=True)]
        self._requests.clear()
        self._entries.clear()
        self._active = 0
        closed = CommClosedError("the communicator was closed with this operation in flight")
        for _, sink, _ in pending:
            sink._abandon(CommClosedError, closed)
        return pending
