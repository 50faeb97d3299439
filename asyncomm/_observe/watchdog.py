"""Debug mode: say where the event loop is stuck when a callback holds it too long.

A blocked loop stalls every operation of its rank, and through them the other ranks.
asyncio's own debug mode reports a slow callback once it has returned, without saying where
it spent the time; the watchdog reports *while* the loop is blocked, with the loop thread's
stack, once per stall. The loop beats (a timer every quarter threshold); a thread prints to
stderr when the beat is older than ``ASYNCOMM_BLOCKED_S`` while the loop is running.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
import weakref

from asyncomm._core import settings

_watched: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watchdog] = (
    weakref.WeakKeyDictionary())


def watch(loop: asyncio.AbstractEventLoop, label: str) -> None:
    """Watch ``loop`` (the running one) until it closes; once per loop, later calls do nothing."""
    if loop in _watched:
        return
    _watched[loop] = _Watchdog(loop, label, settings.read().blocked_s)


def stand_down(loop: asyncio.AbstractEventLoop) -> None:
    """Say nothing more of ``loop``: its rank is ending the job, and blocks it on purpose."""
    dog = _watched.get(loop)
    if dog is not None:
        dog.quiet = True


class _Watchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, label: str, threshold: float) -> None:
        self._loop = loop
        self._label = label
        self._threshold = threshold
        self._beat = time.monotonic()
        self._loop_thread = threading.get_ident()
        self.quiet = False  # (``stand_down``)
        self._tick()
        threading.Thread(target=self._watch, name="asyncomm-watchdog", daemon=True).start()

    def _tick(self) -> None:
        self._beat = time.monotonic()
        self._loop.call_later(self._threshold / 4, self._tick)

    def _watch(self) -> None:
        reported = 0.0
        while not self._loop.is_closed() and not self.quiet:
            time.sleep(self._threshold / 4)
            beat = self._beat
            held = time.monotonic() - beat
            if (held > self._threshold and beat != reported and self._loop.is_running()
                    and not self.quiet):
                reported = beat
                frame = sys._current_frames().get(self._loop_thread)
                stack = "".join(traceback.format_stack(frame)) if frame else "  (unknown)\n"
                sys.stderr.write(f"asyncomm: {self._label}: the event loop has been blocked "
                                 f"for {held:.2f} s (ASYNCOMM_BLOCKED_S={self._threshold:g}); "
                                 f"every operation of this rank waits. It is at:\n{stack}")
                sys.stderr.flush()
