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

On CUDA, each worker thread runs its computes on a side stream of its own and
synchronises that stream before the await resumes, so the result is ready
on every stream.

Note on the hand-over
---------------------
Results come back through an ``Inbox`` (see ``_progress``): a queue and an
eventfd that the worker writes without holding the GIL, so the woken loop
thread does not at once wait for the worker to let go of it, as after
``call_soon_threadsafe`` (what ``run_in_executor`` uses). A no-op compute's
round trip measured 15-30% shorter so.
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
from asyncomm._core.progress import Inbox

T = TypeVar("T")

class _Settle:
    """The inbox's sink of one compute: its future on the loop."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def _succeed(self, value: object) -> None:
        if not self.future.done():  # not if the await was cancelled
            self.future.set_result(value)

    def _fail(self, kind: type[CommError], cause: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(cause)

    _abandon = _fail


def _value(value: T) -> T:
    return value


def _raise(exc: BaseException) -> None:
    raise exc


def _any_error(exc: BaseException) -> type[CommError]:
    return CommError  # unused: ``_Settle`` raises the compute's own exception


_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str | None, _Settle]


class Worker:
    """Compute threads of one event loop: the loop's own (``compute``), or a caller's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int,
                 name: str = "asyncomm-compute") -> None:
        self.loop = loop
        self.inbox = Inbox(loop, _any_error)
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.cuda = torch.cuda.is_available()  # asked once: it does not change in a process
        self.threads = [threading.Thread(target=self._serve, name=f"{name}_{i}",
                                         daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, name: str | None = None,
               **kwargs: Any) -> asyncio.Future[T]:
        """On the loop: queue ``fn(*args, **kwargs)``; the future gets its result.

        ``name`` labels its span in traces; ``None``: no span (``fn`` records its own).
        """
        future: asyncio.Future[T] = self.loop.create_future()
        self.jobs.put((fn, args, kwargs, name, _Settle(future)))
        return future

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, kwargs, name, sink = job
            try:
                value = self.run(fn, args, kwargs, name)
            except BaseException as exc:
                self.inbox.put(sink, _raise, exc)
            else:
                self.inbox.put(sink, _value, value)

    def stop(self, timeout: float | None = None) -> None:
        """On a thread: let the queued jobs finish, then end the threads.

        ``timeout``: wait at most so long for them; a thread still busy then (a job
        blocked on what may never come) ends when its job returns.
        """
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join(timeout)

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str | None) -> T:
        if name is None:
            return fn(*args, **kwargs)
        return run_here(fn, args, kwargs, name, cuda=self.cuda)

    async def close(self, timeout: float | None = None) -> None:
        """On the loop: end the threads once their queued jobs are done (see ``stop``)."""
        await asyncio.to_thread(self.stop, timeout)
        self.inbox.close()  # hands over what the last jobs returned


_streams = threading.local()  # each thread's CUDA side stream, made on its first CUDA compute


def run_here(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
             cuda: bool = True) -> T:
    """Run a compute on the calling thread (never the loop's) as a compute thread does.

    Its span goes to the trace; on CUDA it runs on a side stream of the thread's own,
    synchronised before it returns, so its result is ready on every stream.
    """
    start = time.perf_counter()
    try:
        # Initialised: the program uses CUDA (it may start to after the thread was made).
        if cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return _run_cuda(fn, args, kwargs)
        return fn(*args, **kwargs)
    finally:
        instrument.span(name, start, time.perf_counter())


def _run_cuda(fn: Callable[..., T], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> T:  # pragma: no cover - needs a GPU
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        result = fn(*args, **kwargs)
    stream.synchronize()
    return result


_workers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Worker] = (
    weakref.WeakKeyDictionary())
_OWN_STOP_S = 5.0  # how long shutting down waits for a thread of a caller's own (see stop)
# the compute threads callers own (``own_worker``), per loop
_own: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakSet[Worker]] = (
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
        worker = _workers[loop] = Worker(loop, settings.read().compute_threads)
    label = name if name is not None else _name_of(fn)
    return await worker.submit(fn, *args, name=label, **kwargs)


def own_worker(name: str) -> Worker:
    """On a loop: a compute thread of the caller's own, called ``name``.

    For work that must not queue behind the loop's other computes (nor they behind
    it): a pipeline's steps. ``Worker.close`` ends it; ``shutdown`` ends it with the
    loop's own.
    """
    loop = asyncio.get_running_loop()
    worker = Worker(loop, 1, name)
    _own.setdefault(loop, weakref.WeakSet()).add(worker)  # its thread keeps it alive
    return worker


async def shutdown(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop``'s compute threads once their queued computes are done.

    The loop keeps turning while they finish (a compute may be waiting on it).
    """
    for own in list(_own.pop(loop, ())):
        if own.threads[0].is_alive():
            await own.close(_OWN_STOP_S)
    worker = _workers.pop(loop, None)
    if worker is not None:
        await worker.close()
