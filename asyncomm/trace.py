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
from typing import TYPE_CHECKING, Any

import torch

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
    steps,
    subtract,
    summarise,
    union,
    window,
)

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

__all__ = ["Overlap", "ddp", "directory", "draw", "enabled", "intersect", "length", "load",
           "measure", "merge", "overlap", "report", "span", "start", "step", "steps", "stop",
           "subtract", "summarise", "union", "window", "work"]


def start(directory: str | os.PathLike[str]) -> None:
    """Trace this process's communicators (open and future) and computes into ``directory``.

    Under ``asyncomm run --trace DIR`` (``ASYNCOMM_TRACE``) tracing is on
    already, into DIR, and stays there: a warning says so, and
    ``directory()`` tells where the files go.

    Args:
        directory: where each rank writes its file, ``rank{R}.json``.

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

    Args:
        name: the span's name on the timeline.

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


def ddp(model: DistributedDataParallel) -> DistributedDataParallel:
    """Put ``model``'s gradient all-reduces on this rank's timeline; return ``model``.

    DDP's reducer runs its collectives inside torch, where asyncomm cannot see
    them: this registers a communication hook that does what DDP does by
    default (torch's ``allreduce_hook``: the bucket averaged over the group)
    and records each bucket's all-reduce, from its issue until its result is
    ready, as ``ddp:all_reduce`` with its bytes; and, as ``ddp:wait``, the
    time DDP's backward waits for them: from the step's last bucket (backward
    has every gradient then) until all are ready, which is not compute. Call
    it once, before training; while tracing is off nothing is recorded.

    Args:
        model: a ``DistributedDataParallel`` model with no communication hook yet.

    Returns:
        ``model``, its hook registered.

    Raises:
        RuntimeError: ``model`` has a communication hook already (DDP takes one).
    """
    from asyncomm._backends import ddp_hook  # (torch's DDP hooks load only for DDP's users)

    issued: list[torch.futures.Future[Any]] = []  # this step's buckets

    def watch(done: torch.futures.Future[Any], nbytes: int, start: float,
              last: bool) -> torch.futures.Future[Any]:
        recording = _recorder.recorder()
        if recording is None:
            return done
        timed = _timed(recording, done, "all_reduce", nbytes, start, "ddp:all_reduce")
        issued.append(timed)
        if last:
            waiting = time.perf_counter()
            torch.futures.collect_all(issued[:]).then(
                lambda _: recording.waited("ddp:wait", waiting, time.perf_counter()))
            issued.clear()
        return timed

    ddp_hook.register(model, watch)
    return model


def work(handle: Any, kind: str, tensor: torch.Tensor | None = None) -> Any:
    """Put a collective issued on ``comm.raw`` (or any torch ``Work``) on this rank's
    timeline, from now until it completes, as ``torch:KIND``; return ``handle``.

    ``work(comm.raw.allreduce([t]), "all_reduce", t)``.

    Args:
        handle: the ``Work`` a torch collective returned.
        kind: what the collective is (``"all_reduce"``): its name is ``torch:KIND``.
        tensor: the tensor it moves, whose bytes are recorded (None: 0 bytes).

    Returns:
        ``handle``, as it was.
    """
    recording = _recorder.recorder()
    if recording is not None:
        nbytes = tensor.nbytes if tensor is not None else 0
        _timed(recording, handle.get_future(), kind, nbytes, time.perf_counter(),
               f"torch:{kind}")
    return handle


def _timed(recording: _recorder.Recorder, done: torch.futures.Future[Any], kind: str,
           nbytes: int, start: float, name: str) -> torch.futures.Future[Any]:
    """``done``, chained to record the span from ``start`` to its completion in ``recording``."""

    def record(future: torch.futures.Future[Any]) -> Any:
        recording.torch_op(kind, nbytes, start, time.perf_counter(), name)
        return future.value()

    return done.then(record)


def step() -> None:
    """Mark that this rank begins a step now (a training step, an iteration): ``asyncomm
    trace DIR --steps A:B`` gives steps A to B's figures and draws only them."""
    recording = _recorder.recorder()
    if recording is not None:
        recording.step()


def stop() -> Path | None:
    """Stop tracing; write this rank's file now and return its path (None if it was off)."""
    return _recorder.stop()


def enabled() -> bool:
    """Return whether this process is tracing."""
    return _recorder.recorder() is not None
