"""``Spin``: spin-then-park, how a task about to wait polls for what it waits for itself.

A task that awaits something that may come within microseconds (a reply on
its way, a collective its peers have entered) first polls for it itself: a
few ``tests``, then for up to ``max_s``. Found, it goes on with no loop
iteration and no wake-up; not found, it parks, and the loop's poller (or a
thread) wakes it. Two engines use it: the MPI poller (a request's ``Test``,
or the link's probe) and the future bridge of gloo's collectives (one
``wait`` bounded by ``max_s``: ``block``).

Note on misses
--------------
A spin that found nothing cost its ``max_s`` for nothing. After ``MISSES``
such waits in a row (a rank whose waits are long: idle, or computing), a
task spins only every ``MISSES``-th wait until one finds what it waits for
again; so request-response traffic is caught without parking, and a rank
that waits long wastes at most ``max_s`` in every ``MISSES`` waits.

Note on fairness
----------------
A task that finds what it spins for goes on without a loop iteration, so
tasks that succeed one after the other (a ping-pong) could keep the loop
from everything else. Each spin therefore asks the loop for a turn, and no
task spins while a turn asked for more than ``FAIR_S`` ago has not come:
it yields that turn instead (``refused``).

Note on what is due
-------------------
Some work waits for the loop iteration's end: a link's packet of small
frames (so that the frames of one iteration travel together). A task that
spins holds the loop, so the iteration cannot end while it does; and what
it waits for may be the peer's answer to that very work. So such work is
also listed in its loop's ``due`` list, and a task about to spin does it
first.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable

FAIR_S = 1e-3  # tasks that spin hold the loop from its other work at most about so long
MISSES = 8  # spins in a row that found nothing, after which a task spins 1 wait in MISSES

_due: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], object]]] = (
    weakref.WeakKeyDictionary())


def due_at(loop: asyncio.AbstractEventLoop) -> list[Callable[[], object]]:
    """Return ``loop``'s work due at its iteration's end (see the note on what is due): one
    list per loop, which its owners append to and remove from in place."""
    due = _due.get(loop)
    if due is None:
        due = _due[loop] = []
    return due


class Spin:
    """Spin-then-park for the tasks of one engine (see the module's notes)."""

    __slots__ = ("_due", "_loop", "_turn", "max_s", "misses", "refused", "tests")

    def __init__(self, loop: asyncio.AbstractEventLoop, tests: int, max_s: float) -> None:
        self._loop = loop
        self._due = due_at(loop)
        self.tests = tests  # 0: no spinning at all
        self.max_s = max_s
        self.misses = 0  # waits in a row whose spin found nothing
        self._turn = 0.0  # when the loop was asked for a turn that has not come yet (0: none)
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
        if not self._turn:
            self._turn = time.perf_counter()
            self._loop.call_soon(self._turned)
            return True
        return time.perf_counter() - self._turn <= FAIR_S

    def _turned(self) -> None:
        self._turn = 0.0

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
