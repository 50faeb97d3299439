"""Compute off the event loop: ``await asyncomm.compute(fn, *args)``.

Note on why
-----------
A pass run *on* the event loop stops everything that completes there for its whole
duration; on a worker thread (torch releases the GIL inside its kernels) the loop keeps
turning (docs/overlap.md). Each loop gets ``ASYNCOMM_COMPUTE_THREADS`` workers (one by
default: computes in call order, not oversubscribing the cores), made on first use and
stopped by ``shutdown`` (``init`` calls it on leaving): no thread is left behind. On CUDA
a worker computes on a side stream of its own, synchronised before the await resumes.

Results come back through an ``Inbox``: see its note on waking the loop (``_core.progress``).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from asyncomm._core import instrument, settings
from asyncomm._core.errors import CommError
from asyncomm._core.handle import reraise
from asyncomm._core.polling import computing
from asyncomm._core.progress import Inbox

T = TypeVar("T")

class _Settle:
    """The inbox's sink of one compute: its future on the loop, and the loop's count."""

    __slots__ = ("future", "running")

    def __init__(self, future: asyncio.Future[Any], running: list[int]) -> None:
        self.future = future
        self.running = running  # computes in flight on the loop (see ``polling.computing``)
        running[0] += 1

    def _succeed(self, value: object) -> None:
        self.running[0] -= 1
        if not self.future.done():  # not if the await was cancelled
            self.future.set_result(value)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        self.running[0] -= 1
        if not self.future.done():
            self.future.set_exception(cause)

    _abandon = _fail


def _value(value: T) -> T:
    return value


_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str, _Settle]


class _Worker:
    """The compute threads of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int) -> None:
        self.inbox = Inbox(loop, lambda _: CommError)  # (unused: ``_Settle`` raises fn's own)
        self.running = computing(loop)  # computes in flight: pollers poll less busily meanwhile
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.stream: Any = None  # a CUDA side stream, made on the first CUDA compute
        self.cuda = torch.cuda.is_available()  # asked once: it does not change in a process
        self.threads = [threading.Thread(target=self._serve, name=f"asyncomm-compute_{i}",
                                         daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, kwargs, name, sink = job
            try:
                value = self.run(fn, args, kwargs, name)
            except BaseException as exc:
                self.inbox.put(sink, functools.partial(reraise, exc), None)
            else:
                self.inbox.put(sink, _value, value)

    def stop(self) -> None:
        """On a thread: let the queued computes finish, then end the threads."""
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join()

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str) -> T:
        # Initialised: the program uses CUDA (it may start to after the worker was made).
        if self.cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return run_here(functools.partial(self._run_cuda, fn, args, kwargs), name)
        return run_here(functools.partial(fn, *args, **kwargs), name)

    def _run_cuda(self, fn: Callable[..., T], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> T:  # pragma: no cover - needs a GPU
        if self.stream is None:
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            result = fn(*args, **kwargs)
        self.stream.synchronize()
        return result


def run_here(fn: Callable[[], T], name: str) -> T:
    """Run ``fn()`` on this thread, its span reported as a compute's (for traces)."""
    start = time.perf_counter()
    try:
        return fn()
    finally:
        instrument.span(name, start, time.perf_counter())


_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Worker] = (
    weakref.WeakKeyDictionary())


def _name_of(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


async def compute(fn: Callable[..., T], *args: Any, name: str | None = None,
                  **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` on this loop's compute thread; return its result.

    The loop keeps running (and communication keeps progressing) meanwhile.
    Computes of one loop run one at a time in call order (or
    ``ASYNCOMM_COMPUTE_THREADS`` at a time). Cancelling the await does not
    stop a compute that has started.

    Args:
        fn: what to run, called with ``args`` and ``kwargs``.
        name: the span's label in traces (default: the function's name).

    Returns:
        What ``fn`` returned.

    Raises:
        TypeError: ``fn`` is not callable, or ``name`` is not a str.
        Exception: whatever ``fn`` raised.
    """
    if not callable(fn):
        raise TypeError(f"compute: fn must be callable, not {type(fn).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"compute: name must be a str, not {type(name).__name__}")
    loop = asyncio.get_running_loop()
    worker = _workers.get(loop)
    if worker is None:
        worker = _workers[loop] = _Worker(loop, settings.read().compute_threads)
    label = name if name is not None else _name_of(fn)
    future: asyncio.Future[T] = loop.create_future()
    worker.jobs.put((fn, args, kwargs, label, _Settle(future, worker.running)))
    return await future


async def shutdown(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop``'s compute threads once their queued computes are done.

    The loop keeps turning while they finish (a compute may be waiting on it).
    """
    worker = _workers.pop(loop, None)
    if worker is not None:
        await asyncio.to_thread(worker.stop)
        worker.inbox.close()  # hands over what the last computes returned
