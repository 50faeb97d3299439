"""Compute off the event loop: ``await asyncomm.compute(fn, *args)``.

Note on why
-----------
Communication completes on the event loop (futures, pollers, routers). A
forward or backward pass run *on* the loop stops every one of those for its
whole duration, so nothing issued before it progresses under it. Run on a
worker thread instead (torch releases the GIL inside its kernels), the loop
keeps turning: completions are seen, receives posted, the next bucket sent.

Each event loop gets one worker thread by default (``ASYNCOMM_COMPUTE_THREADS``):
computes run one at a time, in call order, so a rank does not oversubscribe
the cores its peers and torch's own intra-op threads also use. The worker is
made on first use and stopped by ``shutdown`` (``init`` calls it on leaving, so
``asyncomm.run`` does too), leaving no thread behind.

On CUDA, each worker runs its computes on a side stream of its own and
synchronises that stream before the await resumes, so the result is ready
on every stream.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_ENV_THREADS = "ASYNCOMM_COMPUTE_THREADS"


class Span:
    """One compute that ran: its name and its start and end (``time.perf_counter`` s)."""

    __slots__ = ("end", "name", "start")

    def __init__(self, name: str, start: float, end: float) -> None:
        self.name = name
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"<Span {self.name} {1e3 * (self.end - self.start):.3f} ms>"


#: Called with each finished ``Span`` on the worker thread (tracing sets it).
on_span: Callable[[Span], None] | None = None


def _threads_from_env() -> int:
    text = os.environ.get(_ENV_THREADS, "1")
    try:
        threads = int(text)
    except ValueError:
        raise ValueError(f"{_ENV_THREADS} must be an int >= 1, not {text!r}") from None
    if threads < 1:
        raise ValueError(f"{_ENV_THREADS} must be >= 1, not {threads}")
    return threads


class _Worker:
    """The compute threads of one event loop."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="asyncomm-compute")
        self.stream: Any = None  # a CUDA side stream, made on the first CUDA compute
        self.cuda = torch.cuda.is_available()  # asked once: it does not change in a process

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str) -> T:
        start = time.perf_counter()
        try:
            # Initialised: the program uses CUDA (it may start to after the worker was made).
            if self.cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                return self._run_cuda(fn, args, kwargs)
            return fn(*args, **kwargs)
        finally:
            hook = on_span
            if hook is not None:
                hook(Span(name, start, time.perf_counter()))

    def _run_cuda(self, fn: Callable[..., T], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> T:  # pragma: no cover - needs a GPU
        if self.stream is None:
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            result = fn(*args, **kwargs)
        self.stream.synchronize()
        return result


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
    ``ASYNCOMM_COMPUTE_THREADS`` at a time). ``name`` labels the span in
    traces (default: the function's name). Cancelling the await does not
    stop a compute that has started.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"compute: fn must be callable, not {type(fn).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"compute: name must be a str, not {type(name).__name__}")
    loop = asyncio.get_running_loop()
    worker = _workers.get(loop)
    if worker is None:
        worker = _workers[loop] = _Worker(_threads_from_env())
    label = name if name is not None else _name_of(fn)
    return await loop.run_in_executor(worker.pool, worker.run, fn, args, kwargs, label)


async def shutdown(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop``'s compute threads once their queued computes are done.

    The loop keeps turning while they finish (a compute may be waiting on it).
    """
    worker = _workers.pop(loop, None)
    if worker is not None:
        await asyncio.to_thread(worker.pool.shutdown, wait=True)
