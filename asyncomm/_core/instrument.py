"""The hook an observer attaches to: what communicators and computes report, when asked.

Note on cost
------------
Each communicator owns an ``Instrument``; its operations, channel messages and actor calls
read ``instrument.recording`` and report only when it is set: one attribute check each while
nobody records. An observer (the trace recorder) ``install``s itself: every open instrument,
and every one made later, then reports to it, under the id its ``attach`` gave. Compute spans
report through ``span``. Nothing here knows what a recorder does with the reports.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Recording(Protocol):
    """What an observer takes reports through (``asyncomm._observe.recorder.Recorder``)."""

    def attach(self, rank: int, size: int, backend: str) -> int:
        """Start recording a communicator; return its id in the recording."""

    def detached(self) -> None:
        """A recorded communicator closed."""

    def issued(self, handle: Any, comm: int, keep: object) -> None:
        """An operation was issued (its completion is recorded through ``handle``)."""

    def message(self, kind: str, nbytes: int, peer: int | None, tag: int | None, comm: int,
                start: float, error: BaseException | None, name: str | None = None) -> None:
        """A channel message or actor call ran from ``start`` until now."""

    def span(self, name: str, start: float, end: float) -> None:
        """A compute ran from ``start`` to ``end`` (``time.perf_counter`` s), on this thread."""

    def completed(self, handle: Any, at: float) -> None:
        """The backend completed ``handle``'s operation at ``at`` (on its own thread: the
        loop learns of it later)."""

    def stalled(self, start: float, end: float) -> None:
        """Requests that progress only while tested were in flight, untested, from ``start``
        to ``end`` (``time.perf_counter`` s)."""


class Instrument:
    """Where one communicator reports: ``recording`` is None while nobody records."""

    __slots__ = ("__weakref__", "backend", "id", "rank", "recording", "size")

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        self.recording: Recording | None = None
        self.id = 0
        if _current is not None:
            self._attach(_current)
        _instruments.add(self)

    def _attach(self, recording: Recording) -> None:
        self.recording = recording
        self.id = recording.attach(self.rank, self.size, self.backend)

    async def traced(self, work: Awaitable[T], kind: str, nbytes: int, peer: int | None,
                     tag: int | None, name: str | None = None) -> T:
        """Await ``work`` (a send, an actor call); report it as a message (while recording)."""
        recording = self.recording
        assert recording is not None
        start, error = time.perf_counter(), None
        try:
            return await work
        except BaseException as exc:
            error = exc
            raise
        finally:
            recording.message(kind, nbytes, peer, tag, self.id, start, error, name)

    def close(self) -> None:
        """The communicator closed: report no more."""
        _instruments.discard(self)
        recording, self.recording = self.recording, None
        if recording is not None:
            recording.detached()


_instruments: weakref.WeakSet[Instrument] = weakref.WeakSet()
_current: Recording | None = None


def install(recording: Recording) -> None:
    """Have every open and future instrument, and every compute, report to ``recording``."""
    global _current
    _current = recording
    for instrument in list(_instruments):
        if instrument.recording is None:
            instrument._attach(recording)


def uninstall(recording: Recording) -> None:
    """Stop reporting to ``recording``."""
    global _current
    if _current is recording:
        _current = None
    for instrument in list(_instruments):
        if instrument.recording is recording:
            instrument.recording = None


def span(name: str, start: float, end: float) -> None:
    """Report a compute span, if anyone records."""
    recording = _current
    if recording is not None:
        recording.span(name, start, end)


def recording() -> Recording | None:
    """Return the observer reports go to (None while nobody records)."""
    return _current
