"""Lifecycle: ``init`` joins the world, ``run`` drives ``main(comm)`` on an event loop."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import CodeType, FrameType, TracebackType
from typing import Any, TypeVar

from asyncomm._backends import open_backend
from asyncomm._comm import Comm
from asyncomm._core import settings
from asyncomm._core.env import detect
from asyncomm._core.errors import PeerFailedError
from asyncomm._core.settings import BACKENDS
from asyncomm._observe import status as _status
from asyncomm._overlap import compute as _compute

T = TypeVar("T")


def _settings(backend: str | None, timeout: float | None) -> tuple[str | None, float]:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, not {backend!r}")
    if timeout is None:
        timeout = settings.read().timeout
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return backend, float(timeout)


_worlds = 0  # worlds joined by this process: every rank joins as many, so labels agree


async def _open(backend: str | None, timeout: float) -> Comm:
    global _worlds
    env = detect()
    name = backend or env.backend
    loop = asyncio.get_running_loop()
    user, own = await open_backend(name, env, timeout, loop)
    _worlds += 1
    comm = Comm(user, own, loop, timeout, label=f"w{_worlds}")
    if comm.size > 1:  # where each rank answers questions about its state (see _status)
        address = await _status.serve()
        comm._addresses = [a.decode() for a in await comm._exchange(address.encode(), "init")]
        _status.to_launcher(f"{_status.SERVES_AT}{comm._label} {address} {os.getpid()}")
    return comm


class init:
    """Join this rank's world from its environment; closing leaves it.

    ``async with asyncomm.init() as comm: ...`` closes ``comm`` on exit;
    ``comm = await asyncomm.init()`` leaves closing to you.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``None`` (MPI under an MPI
            launcher, else gloo; ``ASYNCOMM_BACKEND`` overrides).
        timeout: every operation's default deadline in seconds (300;
            ``ASYNCOMM_TIMEOUT``).

    Raises:
        ValueError: a bad ``backend`` or ``timeout`` (at once), or a launcher
            environment that does not parse.
        CommError: joining failed (``CommTimeoutError``: a peer never came;
            ``PeerFailedError``: one failed to join).
    """

    def __init__(self, *, backend: str | None = None, timeout: float | None = None) -> None:
        self._backend, self._timeout = _settings(backend, timeout)
        self._comm: Comm | None = None

    def __await__(self) -> Generator[Any, None, Comm]:
        """``comm = await asyncomm.init()``: the communicator, open (see the class)."""
        return _open(self._backend, self._timeout).__await__()

    async def __aenter__(self) -> Comm:
        self._comm = await _open(self._backend, self._timeout)
        return self._comm

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._comm is not None:
            if (self._comm.size > 1 and isinstance(error, Exception)
                    and not isinstance(error, PeerFailedError)):
                await self._comm._tell(_deed(error))  # (where ``run`` did not already)
            # Leaving on an error: the other ranks may never close, so do not wait for them.
            await self._comm._close(linger=30.0 if error is None else 0.0)
        await _compute.shutdown(asyncio.get_running_loop())


def run(main: Callable[[Comm], Awaitable[T]], *, backend: str | None = None,
        timeout: float | None = None) -> T:
    """Run ``await main(comm)`` on this rank's event loop and return its result.

    The loop is uvloop's when it is installed (``ASYNCOMM_LOOP=asyncio``
    chooses asyncio's own). The communicator is closed afterwards, also on
    error. Under MPI an uncaught error aborts the whole job instead of
    leaving the other ranks to hang.

    Note on the garbage collector: what exists when ``run`` starts (the
    imports, torch's above all) is frozen (``gc.freeze``) until it returns, so
    that no full collection traverses it and stalls the loop; module-level
    objects live that long anyway. Where something is frozen already, ``run``
    freezes nothing: Python can thaw everything or nothing, not what it froze.

    Args:
        main: the program, called with this rank's ``Comm``.
        backend, timeout: as for :class:`init`.

    Returns:
        What ``main`` returned.

    Raises:
        ValueError, CommError: as :class:`init`; and whatever ``main`` raised.
    """
    backend, deadline = _settings(backend, timeout)

    async def body() -> T:
        async with init(backend=backend, timeout=deadline) as comm:
            fatal = _fatal_errors(asyncio.current_task())
            try:
                try:
                    return await main(comm)
                except asyncio.CancelledError:
                    if not fatal:
                        raise
                    raise fatal[0] from None  # as if ``main`` had raised it
            except BaseException as exc:
                if comm.size > 1 and not isinstance(
                        exc, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                    await _failed(comm, exc)
                raise

    # See the note on the garbage collector.
    frozen_before = gc.get_freeze_count()
    if not frozen_before:
        gc.freeze()
    try:
        return run_loop(body())
    except BaseException as exc:  # shown from main down: the event loop's frames say nothing
        exc.with_traceback(_from_main(exc.__traceback__, body.__code__))
        raise
    finally:
        if not frozen_before:
            gc.unfreeze()


def _fatal_errors(task: asyncio.Task[Any] | None) -> list[BaseException]:
    """Route errors reported to the loop as fatal (``"asyncomm_fatal"`` in the context: a
    mesh's failure handler that raised) to ``task``, ``main``'s: it is cancelled, and the
    list returned holds the error to raise in its place. Other reports go on as before."""
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    before = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if context.get("asyncomm_fatal") and isinstance(error, BaseException) and task:
            if not errors:
                errors.append(error)
                task.cancel()
        elif before is not None:
            before(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return errors


def _from_main(tb: TracebackType | None, body: CodeType) -> TracebackType | None:
    """Return ``tb`` from the frame below ``body`` (the call of ``main``) on, if it has one."""
    entry = tb
    while entry is not None:
        if entry.tb_frame.f_code is body:
            return entry.tb_next or tb
        entry = entry.tb_next
    return tb


async def _failed(comm: Comm, exc: BaseException) -> None:
    """Report ``main``'s failure once (see the note), tell the other ranks, and end the job
    where the backend must.

    Note on failure reports
    -----------------------
    One failure, one traceback. The failing rank tells every other rank first (``Comm._tell``:
    their operations that need it fail with ``PeerFailedError``, naming it and what it
    raised), and ``asyncomm run`` when it failed. Its error then propagates and Python prints
    it, once -- except where the backend ends the whole job (MPI's abort): there it is printed
    here, and the job is ended once every other rank has ended its program, or after
    ``ASYNCOMM_GRACE_S``. A rank that fails only because a peer did (``PeerFailedError``)
    says so in one line instead of a traceback of its own; under MPI it then waits for the
    failing rank to end the job. The launcher names the rank that failed first.
    """
    grace, ends_job = settings.read().grace_s, comm._backend.ends_job_on_error
    if isinstance(exc, PeerFailedError):
        prefix = f"asyncomm: rank {comm.rank} stopped: "
        if not ends_job:
            _quietly(exc, prefix)
            return
        print(prefix + _said(exc), file=sys.stderr, flush=True)
        _status.ending = True
        await asyncio.sleep(grace + 2 * _status.ANSWER_S)  # (ended meanwhile by the failing rank)
        comm._abort_job(1)
        return
    await comm._tell(_deed(exc))
    if ends_job:
        tb = exc.__traceback__  # from the frame that called main: show main's on
        traceback.print_exception(type(exc), exc, _as_uncaught(tb))
        sys.stderr.flush()
        _status.ending = True
        others = [a for r, a in enumerate(comm._addresses) if r != comm.rank]  # (the world)
        await _status.ended(others, comm._label, grace)
        comm._abort_job(1)


def _as_uncaught(tb: TracebackType | None) -> TracebackType | None:
    """Return ``tb`` (from the frame that called main) as Python shows it uncaught: from
    main's frame on, under the frames that called ``run`` up to the script's ``<module>``
    (not a runner's above it: ``runpy``'s and the launcher's)."""
    tb = tb.tb_next if tb is not None else None
    frame: FrameType | None = sys._getframe()
    while frame is not None and frame.f_code is not run.__code__:
        frame = frame.f_back
    frame = frame.f_back if frame is not None else None
    while frame is not None and frame.f_globals.get("__name__") != "runpy":
        tb = TracebackType(tb, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return tb


def _deed(exc: BaseException) -> str:
    """What a rank that failed with ``exc`` did, as its peers are told."""
    return f"it raised {_said(exc)}"


def _said(exc: BaseException) -> str:
    """``exc`` in one line, as Python words it."""
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


_previous_hook: Callable[..., Any] | None = None


def _quietly(exc: BaseException, prefix: str) -> None:
    """Have ``exc``, if uncaught, printed at exit as one line starting with ``prefix``."""
    global _previous_hook
    exc._asyncomm_said = prefix  # type: ignore[attr-defined]
    if _previous_hook is None:
        _previous_hook, sys.excepthook = sys.excepthook, _one_line


def _one_line(kind: type[BaseException], value: BaseException, tb: TracebackType | None
              ) -> None:
    prefix = getattr(value, "_asyncomm_said", None)
    if prefix is None:
        assert _previous_hook is not None
        _previous_hook(kind, value, tb)
        return
    print(f"{prefix}{_said(value)}", file=sys.stderr, flush=True)


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop (uvloop when available).

    A signal that lands before the loop begins ``coro`` (Ctrl-C as a rank starts) leaves it
    closed, never begun: not said at exit to be "never awaited"."""
    try:
        factory: Callable[[], asyncio.AbstractEventLoop] | None = None
        if settings.read().loop != "asyncio":
            try:
                import uvloop
            except ImportError:
                pass
            else:
                factory = uvloop.new_event_loop
        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=factory) as runner:
                return runner.run(coro)
        loop = factory() if factory is not None else asyncio.new_event_loop()  # pragma: no cover
        try:  # pragma: no cover
            return loop.run_until_complete(coro)
        finally:  # pragma: no cover
            loop.close()
    finally:
        if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()
