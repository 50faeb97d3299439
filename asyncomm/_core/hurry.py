"""``Hurry``: how long a task about to wait looks for what it waits for itself.

Two engines use it: the MPI poller (a request's ``Test``, looked at a bounded
number of times and for a learnt while) and the future bridge of gloo's
collectives (one ``wait`` bounded by the learnt while: ``block``).

Note on what is due
-------------------
Some work waits for the loop iteration's end: a link's packet of small
frames (so that the frames of one iteration travel together). A task that
looks holds the loop, so the iteration cannot end while it does; and what
it looks for may be the peer's answer to that very work (a channel message,
then an awaited collective the peer joins once the message is in). So such
work is queued in ``DUE`` as well, and a task that may look does it first
(``run_due``). (Not the credit a router owes: a task about to wait holds a
lone batch of it back on purpose, see the note on credit in ``router``.)
Measured before: a channel message followed by an awaited 8-byte gloo
all_reduce reached its peer 1.3 ms late (the look's whole budget; ~0.15
ms after), and 18 µs against 10 on MPI.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

FAIR_S = 1e-3  # tasks that hurry hold the loop from its other work at most about so long

Due = tuple[asyncio.AbstractEventLoop, Callable[[], object]]  # work, on its loop
# Work due when its loop's iteration ends, not done yet (one loop per thread): its owner
# appends it and removes it once done; a task that looks does it first (``run_due``).
DUE: list[Due] = []


def run_due(loop: asyncio.AbstractEventLoop) -> None:
    """Do the work due at ``loop``'s iteration end now, in the order it was queued (and
    forget the work of loops closed before their iteration ended)."""
    for entry in [entry for entry in DUE if entry[0] is loop or entry[0].is_closed()]:
        if entry in DUE:  # (work may do other work)
            DUE.remove(entry)
            if entry[0] is loop:
                try:
                    entry[1]()
                except Exception as exc:  # a bug: said as the loop's callback would, not
                    loop.call_exception_handler({  # raised into the task that looks
                        "message": "asyncomm: work due at the loop iteration's end failed",
                        "exception": exc})


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
    ``FAIR_S`` ago has not come: it parks, and the loop turns (an awaited
    ``Handle`` yields for that turn, and looks again after it: parking would
    cost it a thread's wake-up or a poll).
    """

    __slots__ = ("_loop", "_since", "_turn", "budget_s", "max_s", "refused", "tests")

    def __init__(self, loop: asyncio.AbstractEventLoop, tests: int, max_s: float) -> None:
        self._loop = loop
        self.tests = tests
        self.max_s = max_s
        self.budget_s = 0.0
        self._since = 0.0  # when the look that gave up began (0: no parked look pending)
        self._turn = 0.0  # when the loop was asked for a turn that has not come yet (0: none)
        # whether the last ``run`` was refused until that turn comes (not: it looked): its
        # task yields the turn and looks then (parking costs it a poll and a wake-up)
        self.refused = False

    def run(self, look: Callable[[], bool], done: Callable[[], bool] = lambda: True,
            then: Callable[[], bool] | None = None) -> bool:
        """Call ``look()`` until it and then ``done()`` return true (return true) or the
        budget is spent (``done`` is asked only after a look that found something; from
        then on ``then`` looks, where given).

        With no tests (``ASYNCOMM_HURRY_TESTS=0``) there is no hurrying at all.
        """
        if not self.allowed():
            self.refused = self.tests > 0
            return False
        self.refused = False
        start = time.perf_counter()
        for _ in range(self.tests):
            if look():
                if done():
                    return True
                look = then or look
        if self.budget_s:
            clock, end = time.perf_counter, start + self.budget_s
            while clock() < end:
                if look():
                    if done():
                        return True
                    look = then or look
        self._since = start
        return False

    def block(self, wait: Callable[[float], bool]) -> bool:
        """Call ``wait(budget_s)`` once (blocking so long at most; 0: not at all); return
        whether what it waits for came. For requests only a blocking wait sees soonest."""
        start = time.perf_counter()
        if wait(self.budget_s):
            return True
        self._since = start
        return False

    def allowed(self) -> bool:
        """Return whether a task may look now (see the note: never without tests, and not
        while a loop turn asked for ``FAIR_S`` ago has not come); ask for a turn if none is.

        A task that may look does the work due at the iteration's end first."""
        if not self.tests:
            return False
        if DUE:  # what the peers may be waiting for goes first (see the note on what is due)
            run_due(self._loop)
        if not self._turn:
            self._turn = time.perf_counter()
            self._loop.call_soon(self.turned)
            return True
        return time.perf_counter() - self._turn <= FAIR_S

    def turned(self) -> None:
        """The loop turned (asked for by ``allowed``, or by a compiled lane's look)."""
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
