"""The per-process trace recorder: every operation, channel message, actor call and compute.

Note on cost
------------
Off, a communicator pays one attribute check per operation (``Comm._trace is None``). On,
an operation costs two ``perf_counter`` reads, one small list and one completion callback;
nothing is formatted or written until the file is written, when the last traced
communicator closes (and again at exit if more was recorded since). Compute spans arrive
through ``_core.instrument`` on the thread that ran them, which appends without a lock
(``list.append`` is atomic under the GIL). Records are tuples of scalars, which the garbage
collector stops tracking, so a trace of millions of operations does not make every full
collection walk them; an operation's completion is a tuple of its own, joined on writing.

Note on clocks
--------------
Times are ``time.perf_counter()`` seconds, as compute spans' (CLOCK_MONOTONIC on Linux,
shared by every process of a host); the file's anchor, a ``(perf_counter, time.time_ns())``
pair read back to back at start, puts ranks of different hosts on one wall-clock timeline.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import warnings
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncomm._core import instrument, settings
from asyncomm._core.handle import _DONE

if TYPE_CHECKING:
    from asyncomm._core.handle import Handle

ENV = "ASYNCOMM_TRACE"
FORMAT = "asyncomm-trace"
VERSION = 1

# The fields of a recorded communication, in the order of its tuple (see the note on cost).
FIELDS = ("cat", "kind", "bytes", "peer", "tag", "seq", "comm", "start", "end", "error",
          "name")
# The fields of the other records' tuples, after their kind (thread: its ident).
_OTHER_FIELDS = {"step": ("start",), "stall": ("start", "end", "thread"),
                 "wait": ("name", "start", "end"), "compute": ("name", "start", "end", "thread")}

_perf = time.perf_counter
_recorder: Recorder | None = None
_lock = threading.Lock()  # starting and stopping only: recording takes no lock


def _nbytes(keep: object) -> int:
    """Return this rank's payload of an operation from the buffers it keeps alive."""
    if isinstance(keep, tuple):  # (tensor, outputs) or (outputs, inputs)
        keep = keep[0]
    if isinstance(keep, torch.Tensor):
        return keep.nbytes
    if isinstance(keep, list):
        return sum(t.nbytes for t in keep)
    return 0


class Recorder:
    """Everything one process records while tracing is on, and the file it goes to."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.anchor = (_perf(), time.time_ns())
        self.events: list[tuple[Any, ...]] = []  # op tuples (see FIELDS), compute tuples
        self.ends: list[tuple[int, float, str | None, int | None]] = []  # index, end, error, peer
        # id(handle) -> when its backend completed it (0.0: not yet), for recorded handles
        # in flight only (``issued`` adds, ``_ended`` takes out)
        self.completions: dict[int, float] = {}
        self.comms: list[dict[str, Any]] = []  # id -> rank, size, backend
        self.rank: int | None = None  # the widest communicator's rank names the file
        self.size = 1
        self.written = 0  # how many events the last write saw
        self.from_env = False  # started by ASYNCOMM_TRACE (see the note on who owns it)
        self._open = 0

    def attach(self, rank: int, size: int, backend: str) -> int:
        """Start recording a communicator; return its id in this process's trace."""
        if self.rank is None or size > self.size:  # the widest names the file: the world
            self.rank, self.size = rank, size
        self.comms.append({"rank": rank, "size": size, "backend": backend})
        self._open += 1
        return len(self.comms) - 1

    def detached(self) -> None:
        """Note that a traced communicator closed; write the file once none is open."""
        self._open -= 1
        if self._open <= 0:
            try:
                self.write()
            except OSError as exc:  # a trace that cannot be written must not fail the close
                warnings.warn(f"asyncomm: rank {self.rank}: cannot write the trace: {exc}",
                              RuntimeWarning, stacklevel=2)

    # -- recording (on the loop thread, except ``span``) -------------------------------

    def issued(self, handle: Handle[Any], comm: int, keep: object) -> None:
        """Record an operation just issued; its completion fills in the end."""
        _, kind, seq, peer, tag = handle._what
        self.completions[id(handle)] = 0.0
        events = self.events
        index = len(events)
        events.append(("op", kind, _nbytes(keep), peer, tag, seq, comm, _perf(), None, None,
                       None))
        handle.add_done_callback(partial(self._ended, index))

    def completed(self, handle: Handle[Any], at: float) -> None:
        """Note when the backend completed ``handle``'s operation (on its thread): its span
        ends there, not when the loop learns of it (a loop held by a computation learns
        late, and the operation would seem to run under the computation). Only a recorded
        handle's: nothing is kept of the others."""
        key = id(handle)
        if key in self.completions:
            self.completions[key] = at

    def _ended(self, index: int, handle: Handle[Any]) -> None:
        end, error, peer = self.completions.pop(id(handle), 0.0) or _perf(), handle._error, None
        if error is not None:
            failed: str | None = type(error).__name__
        elif handle._state != _DONE:  # a bad argument: raised before anything was sent
            failed = "not started"
        else:
            failed = None
            if handle.peer is None and handle.op == "recv":  # any source: which
                peer = handle._value
        self.ends.append((index, end, failed, peer))

    def message(self, kind: str, nbytes: int, peer: int | None, tag: int | None, comm: int,
                start: float, error: BaseException | None, name: str | None = None) -> None:
        """Record a channel message or actor call that ran from ``start`` until now."""
        self.events.append(("channel" if kind.startswith("channel") else "actor", kind, nbytes,
                            peer, tag, None, comm, start, _perf(),
                            None if error is None else type(error).__name__, name))

    def torch_op(self, kind: str, nbytes: int, start: float, end: float, name: str) -> None:
        """Record a collective torch ran for someone else (DDP's reducer, a raw call), or
        GradSync's sum through shared memory, from ``start`` until ``end`` (any thread: it
        is appended whole)."""
        self.events.append(("torch", kind, nbytes, None, None, None, None, start, end, None,
                            name))

    def step(self) -> None:
        """Mark that a step of the program begins now."""
        self.events.append(("step", _perf()))

    def span(self, name: str, start: float, end: float) -> None:
        """Record a finished compute span (called on the thread that ran it)."""
        self.events.append(("compute", name, start, end, threading.get_ident()))

    def waited(self, name: str, start: float, end: float) -> None:
        """Record that a computation waited for data from ``start`` to ``end`` (any thread:
        it is appended whole): time inside a compute span that is not compute."""
        self.events.append(("wait", name, start, end))

    def stalled(self, start: float, end: float) -> None:
        """Record that requests in flight were not progressing from ``start`` to ``end``
        (nothing tested them: see ``_core.polling``'s note on stalls); called on the thread
        that tests them, whose own computations then hide none of them."""
        self.events.append(("stall", start, end, threading.get_ident()))

    def path(self) -> Path:
        """Return the file this process writes: ``DIR/rank{R}.json``."""
        rank = self.rank if self.rank is not None else f"-pid{os.getpid()}"
        return self.directory / f"rank{rank}.json"

    def document(self) -> dict[str, Any]:
        """Return what was recorded so far as the file's JSON object."""
        events: list[dict[str, Any]] = []
        threads: dict[int, int] = {}
        ends = {index: rest for index, *rest in self.ends}
        for index, event in enumerate(list(self.events)):  # a copy: the worker may append
            record: dict[str, Any]
            fields = _OTHER_FIELDS.get(event[0])
            if fields is not None:
                record = {"cat": event[0], "kind": event[0],
                          **dict(zip(fields, event[1:], strict=True))}
                record.setdefault("end", record["start"])  # a step mark: a moment
                if "thread" in record:  # threads numbered 0, 1, ... as first seen
                    record["thread"] = threads.setdefault(record["thread"], len(threads))
            else:
                record = dict(zip(FIELDS, event, strict=True))
                ended = ends.get(index)
                if ended is not None:
                    record["end"], record["error"] = ended[0], ended[1]
                    if ended[2] is not None:
                        record["peer"] = ended[2]
            events.append(record)
        return {"format": FORMAT, "version": VERSION, "rank": self.rank, "size": self.size,
                "host": socket.gethostname(), "pid": os.getpid(),
                "anchor": {"perf_counter": self.anchor[0], "wall_ns": self.anchor[1]},
                "comms": self.comms, "events": events}

    def write(self) -> Path:
        """Write the file (replacing an earlier write of this process); return its path."""
        self.written = len(self.events)
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.part")
        partial.write_text(json.dumps(self.document(), separators=(",", ":")))
        partial.replace(path)  # a reader never sees half a file
        return path

    def flush_at_exit(self) -> None:
        """Write at exit what was recorded since the last write, if anything."""
        if len(self.events) > self.written or not self.path().exists():
            try:
                self.write()
            except OSError:  # exiting: nobody left to tell
                pass


def start_from_env() -> None:
    """Start tracing if ``ASYNCOMM_TRACE`` asks for it and nothing traces yet (called as a
    communicator is made, so that it is traced from its first operation)."""
    if _recorder is None:
        directory = settings.read().trace
        if directory:
            start(directory).from_env = True


def start(directory: str | os.PathLike[str]) -> Recorder:
    """Trace every open and future communicator of this process into ``directory``.

    Note on who owns tracing: ``ASYNCOMM_TRACE`` (``asyncomm run --trace DIR``) does, for
    the whole run, so that the launcher finds every rank's file where it merges them: a
    program that starts tracing into another directory goes on into the run's (one warning
    says so). One that asks for two directories itself gets a ``ValueError``.
    """
    global _recorder
    with _lock:
        if _recorder is not None:
            wanted = Path(directory).resolve()
            if _recorder.directory != wanted and not _recorder.from_env:
                raise ValueError(f"tracing is already on, into {_recorder.directory}")
            if _recorder.directory != wanted:
                warnings.warn(f"asyncomm: tracing into {_recorder.directory} ({ENV}, as "
                              f"asyncomm run --trace sets it), not {wanted}", RuntimeWarning,
                              stacklevel=3)
            return _recorder
        recorder = _recorder = Recorder(Path(directory).resolve())
        atexit.register(recorder.flush_at_exit)
    instrument.install(recorder)
    return recorder


def stop() -> Path | None:
    """Stop tracing; write this process's file and return its path (None if it was off)."""
    global _recorder
    with _lock:
        recorder, _recorder = _recorder, None
        if recorder is None:
            return None
        atexit.unregister(recorder.flush_at_exit)
    instrument.uninstall(recorder)
    return recorder.write()


def recorder() -> Recorder | None:
    """Return the recorder when tracing is on."""
    return _recorder
