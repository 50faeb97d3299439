"""Timeline tracing: record every operation and compute span, then merge, measure, draw.

Turn it on with ``ASYNCOMM_TRACE=DIR`` (``asyncomm run --trace DIR`` sets it
for every rank) or ``asyncomm.trace.start(DIR)``; each rank writes
``DIR/rank{R}.json`` when its communicators close. ``merge(DIR)`` makes one
Chrome/Perfetto trace of them, ``overlap(trace)`` the per-rank metrics
(communication, hidden under compute, exposed), ``draw(trace, path)`` a PNG.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncomm import _trace
from asyncomm._timeline import (
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

__all__ = [
    "Overlap",
    "draw",
    "enabled",
    "intersect",
    "length",
    "load",
    "measure",
    "merge",
    "overlap",
    "report",
    "start",
    "stop",
    "summarise",
    "union",
]


def start(directory: str | os.PathLike[str]) -> None:
    """Trace this process's communicators (open and future) and computes into ``directory``.

    Raises:
        ValueError: tracing is already on into another directory.
    """
    _trace.start(directory)


def stop() -> Path | None:
    """Stop tracing; write this rank's file now and return its path (None if it was off)."""
    return _trace.stop()


def enabled() -> bool:
    """Return whether this process is tracing."""
    return _trace.recorder() is not None
