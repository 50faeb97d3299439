"""Timeline tracing: record every operation and compute span, then merge, measure, draw.

Turn it on with ``ASYNCOMM_TRACE=DIR`` (``asyncomm run --trace DIR`` sets it
for every rank) or ``asyncomm.trace.start(DIR)``; each rank writes
``DIR/rank{R}.json`` when its communicators close. ``merge(DIR)`` makes one
Chrome/Perfetto trace of them, ``overlap(trace)`` the per-rank metrics
(communication, hidden under compute, exposed), ``draw(trace, path)`` a PNG.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from asyncomm._core import instrument
from asyncomm._observe import recorder as _recorder
from asyncomm._observe.timeline import (
    Overlap,
    draw,
    intersect,
    length,
    load,
    measure,
    merge,
    overlap,
    report,
    summarise,
    union,
)

__all__ = ["Overlap", "directory", "draw", "enabled", "intersect", "length", "load", "measure",
           "merge", "overlap", "report", "span", "start", "stop", "summarise", "union"]


def start(directory: str | os.PathLike[str]) -> None:
    """Trace this process's communicators (open and future) and computes into ``directory``.

    Under ``asyncomm run --trace DIR`` (``ASYNCOMM_TRACE``) tracing is on
    already, into DIR, and stays there: a warning says so, and
    ``directory()`` tells where the files go.

    Raises:
        ValueError: this program started tracing into another directory already.
    """
    _recorder.start(directory)


def directory() -> Path | None:
    """Return the directory this process traces into (None while tracing is off)."""
    recording = _recorder.recorder()
    return None if recording is None else recording.directory


class span:  # a context manager named like the function it reads as
    """Record the code it wraps as a compute span of this rank's trace.

    ``with asyncomm.trace.span("forward"): ...`` (or ``async with``): for
    compute that runs on the event loop itself, which ``asyncomm.compute``
    spans cannot show. Nothing is recorded while tracing is off.

    Raises:
        TypeError: ``name`` is not a str.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"a span's name must be a str, not {type(name).__name__}")
        self.name = name
        self._start = 0.0

    def __enter__(self) -> span:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        instrument.span(self.name, self._start, time.perf_counter())

    async def __aenter__(self) -> span:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)


def stop() -> Path | None:
    """Stop tracing; write this rank's file now and return its path (None if it was off)."""
    return _recorder.stop()


def enabled() -> bool:
    """Return whether this process is tracing."""
    return _recorder.recorder() is not None
