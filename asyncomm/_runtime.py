"""Lifecycle: ``init`` joins the world, ``run`` drives ``main(comm)`` on an event loop."""

from __future__ import annotations

import asyncio
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import TracebackType
from typing import Any, TypeVar

from asyncomm import _compute
from asyncomm._backends import open_backend
from asyncomm._comm import Comm
from asyncomm._env import BACKENDS, detect

T = TypeVar("T")

DEFAULT_TIMEOUT = 300.0


def _settings(backend: str | None, timeout: float | None) -> tuple[str | None, float]:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, not {backend!r}")
    if timeout is None:
        timeout = float(os.environ.get("ASYNCOMM_TIMEOUT", DEFAULT_TIMEOUT))
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return backend, float(timeout)


async def _open(backend: str | None, timeout: float) -> Comm:
    env = detect()
    name = backend or env.backend
    loop = asyncio.get_running_loop()
    user, own = await open_backend(name, env, timeout, loop)
    return Comm(user, own, loop, timeout)


class init:
    """Join this rank's world from its environment; closing leaves it.

    ``async with asyncomm.init() as comm: ...`` closes ``comm`` on exit;
    ``comm = await asyncomm.init()`` leaves closing to you. ``backend`` is
    ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``None`` (MPI under an MPI launcher,
    else gloo; ``ASYNCOMM_BACKEND`` overrides). ``timeout`` is every
    operation's default deadline in seconds (300; ``ASYNCOMM_TIMEOUT``).
    """

    def __init__(self, *, backend: str | None = None, timeout: float | None = None) -> None:
        self._backend, self._timeout = _settings(backend, timeout)
        self._comm: Comm | None = None

    def __await__(self) -> Generator[Any, None, Comm]:
        return _open(self._backend, self._timeout).__await__()

    async def __aenter__(self) -> Comm:
        self._comm = await _open(self._backend, self._timeout)
        return self._comm

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._comm is not None:
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
    """
    backend, deadline = _settings(backend, timeout)

    async def body() -> T:
        async with init(backend=backend, timeout=deadline) as comm:
            try:
                return await main(comm)
            except BaseException as exc:
                if comm.size > 1 and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    # Where the backend ends the job (MPI), say why first: aborting can
                    # cut off output the launcher has not forwarded yet.
                    print(f"asyncomm: rank {comm.rank} failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr, flush=True)
                    traceback.print_exc()
                    sys.stderr.flush()
                    comm._abort_job(1)
                raise

    return run_loop(body())


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop (uvloop when available)."""
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if os.environ.get("ASYNCOMM_LOOP", "uvloop") != "asyncio":
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
