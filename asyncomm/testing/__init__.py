"""Multi-rank tests: run an ``async def check(comm, ...)`` on every rank of a real world.

Starting ranks is the slow part, so a ``World`` is started once and serves
many tests: each rank process connects back to the test process, imports the
check function by file and name, runs it on a communicator of its own (made
for the check over every rank, closed after it, so that no check sees what
another left) and reports the result or its traceback (see :meth:`World.run`
for failures and hangs, after which the world is restarted).

The pytest plugin (``asyncomm.testing.plugin``, registered for pytest when
asyncomm is installed) runs ``async def test_x(comm)`` tests so: see its note.

For tests that start ranks by hand: ``find_mpiexec`` (and ``mpiexec_flavour``),
``host_store`` (a rendezvous store on a port it holds), and ``network`` (emulated
hosts: network namespaces on one machine, docs/several-hosts.md).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any, cast
from unittest import mock

import asyncomm
from asyncomm._core.env import MPI_RANK_VARS
from asyncomm._tools import network
from asyncomm._tools.launch import host_store, local_world
from asyncomm._tools.mpiexec import find as find_mpiexec
from asyncomm._tools.mpiexec import flavour as mpiexec_flavour
from asyncomm._tools.mpiexec import local_options

_ADDRESS = "ASYNCOMM_TEST_ADDRESS"  # where a rank connects back to (read by ``_rank``)
_KEY = "ASYNCOMM_TEST_KEY"
# How long a check's ranks have by default: room for a machine loaded by other processes,
# where a rank's first import of a large module (torch's pipelining) can take a minute while
# the other ranks wait for it in a collective.
CHECK_TIMEOUT_S = 150.0
START_TIMEOUT_S = 150.0  # how long ``World.start`` waits for the ranks (loaded machine: as above)


class WorldFailure(AssertionError):
    """Raised when a check failed, or hung, on one or more ranks."""


class World:
    """``size`` rank processes on ``backend``, serving checks until stopped.

    Args:
        size: how many ranks.
        backend: ``"gloo"``, ``"nccl"`` or ``"mpi"``.

    Raises:
        ValueError: ``size`` is below 1.
    """

    def __init__(self, size: int, backend: str = "gloo") -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one rank, not {size}")
        self.size = size
        self.backend = backend
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._pids: list[int] = []  # each rank's process, for its stack on a hang
        self._requests = 0  # numbers each check: a late reply to an earlier one is dropped
        self._store: object = None
        self._logs: list[Path] = []
        self._logdir = tempfile.TemporaryDirectory(prefix=f"asyncomm-{backend}{size}-")

    def __repr__(self) -> str:
        return f"<World {self.backend} x{self.size}{'' if self._conns else ' stopped'}>"

    @property
    def running(self) -> bool:
        """Whether the rank processes are up and connected."""
        return bool(self._conns) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        """Start the ranks and wait until each has connected.

        Raises:
            RuntimeError: a rank exited or did not connect in time (their output
                is in the message), or the MPI world finds no ``mpiexec``.
        """
        key = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            host, port = listener.address
            env = {**os.environ, _ADDRESS: f"{host}:{port}", _KEY: key.hex(),
                   "PYTHONUNBUFFERED": "1", "ASYNCOMM_BACKEND": self.backend}
            # A world idles between checks, and an idle MPI rank polls every 1 ms: a
            # few pooled worlds would take most of a small machine's cores from the
            # tests. A longer cap only delays the first poll after a long idle spell.
            env.setdefault("ASYNCOMM_MAX_BACKOFF_US", "20000")
            for name in (*MPI_RANK_VARS, "RANK", "WORLD_SIZE"):
                env.pop(name, None)
            command = [sys.executable, "-m", "asyncomm.testing"]  # see ``_rank``
            self._logs = [Path(self._logdir.name) / f"rank{r}.log" for r in range(self.size)]
            if self.backend == "mpi":
                mpiexec = find_mpiexec()
                if mpiexec is None:
                    raise RuntimeError("mpiexec not found: pip install 'asyncomm[mpi]'")
                self._logs = [Path(self._logdir.name) / "mpiexec.log"]
                self._spawn([mpiexec, "-n", str(self.size), *local_options(mpiexec),
                             *command], env, self._logs[0])
            else:
                self._store, store_port = host_store()
                for rank, mine in enumerate(local_world(self.size, store_port)):
                    self._spawn(command, {**env, **mine}, self._logs[rank])
            conns: dict[int, Connection] = {}
            pids: dict[int, int] = {}
            deadline = time.monotonic() + START_TIMEOUT_S
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            while len(conns) < self.size:
                if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                    self.stop()
                    raise RuntimeError(f"{self!r} did not start:\n{self._log_tail()}")
                try:
                    conn: Any = listener.accept()
                except (TimeoutError, OSError):
                    continue
                rank, pid = conn.recv()
                conns[rank], pids[rank] = conn, pid
        self._conns = [conns[r] for r in range(self.size)]
        self._pids = [pids[r] for r in range(self.size)]

    def _spawn(self, command: list[str], env: dict[str, str], log: Path) -> None:
        with open(log, "wb") as out:
            self._procs.append(subprocess.Popen(command, env=env, stdout=out,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL))

    def run(self, check: Callable[..., Any], *args: Any,
            timeout: float = CHECK_TIMEOUT_S) -> list[Any]:
        """Run ``await check(comm, *args)`` on every rank; return their results in rank order.

        Args:
            check: an ``async def`` that each rank imports by its file and name.
            args: its arguments after ``comm`` (picklable).
            timeout: seconds the ranks have (keep it below pytest's own, so
                this report comes; see ``CHECK_TIMEOUT_S``).

        Raises:
            WorldFailure: ranks raised (their tracebacks), or were still busy
                after ``timeout`` (every rank's stack); the world is stopped.
            RuntimeError: as :meth:`start` (a world not running is started first).
        """
        if not self.running:
            self.stop()
            self.start()
        self._requests += 1
        request = self._requests
        path = Path(sys.modules[check.__module__].__file__ or "").resolve()
        folders = [f for f in sys.path if f and path.is_relative_to(Path(f).resolve())]
        for conn in self._conns:
            conn.send(("run", request, str(path), folders, check.__qualname__, args))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        while pending:
            # Once a rank failed, the others get a short grace: they may be waiting on it.
            limit = deadline if not failures else min(deadline, time.monotonic() + 5.0)
            ready = wait(list(pending), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for item in ready:
                conn = cast(Connection, item)
                rank = pending[conn]
                try:
                    status, answered, value = conn.recv()
                except (EOFError, OSError):
                    status, answered, value = "error", request, f"rank {rank} died"
                if answered != request:
                    continue  # the late answer of a check that timed out before
                del pending[conn]
                if status == "ok":
                    results[rank] = value
                else:
                    failures[rank] = value
        if pending or failures:
            hung = sorted(pending.values())
            if hung:
                self._dump_stacks()
            logs = self._log_tail() if hung or any("died" in f for f in failures.values()) else ""
            self.stop()  # its state is unknown now: the next check gets a fresh world
            report = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
            if hung:
                report.append(f"ranks {hung} still busy after {timeout:g} s"
                              if not failures else f"ranks {hung} did not finish after the failure")
            if logs:
                report.append(f"--- the ranks' output (stacks of the busy ones last) ---\n{logs}")
            raise WorldFailure(f"{check.__qualname__} failed on {self!r}:\n" + "\n".join(report))
        return [results[r] for r in range(self.size)]

    def _dump_stacks(self) -> None:
        """Have every rank write its threads' stacks to its output (``faulthandler``)."""
        for pid in self._pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)  # they write from a signal handler: a moment is enough

    def _log_tail(self, lines: int = 60) -> str:
        text = []
        for log in self._logs:
            with contextlib.suppress(OSError):
                text.append(f"{log.name}:\n" + "\n".join(
                    log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(text)

    def stop(self) -> None:
        """Stop the ranks (politely, then not)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", 0, "", [], "", ()))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self._pids:  # a launcher killed may leave its ranks running (Open MPI's)
            if _is_rank(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._pids, self._store = [], [], [], None


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is still a world's rank process (not one that reused its number)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"asyncomm.testing" in cmdline.read()
    except OSError:
        return False


class WorldPool:
    """Worlds by (backend, size), started on first use and kept for later tests."""

    def __init__(self) -> None:
        self._worlds: dict[tuple[str, int], World] = {}

    def get(self, backend: str, size: int) -> World:
        """Return the running world of ``size`` ranks on ``backend``, started if need be.

        Raises:
            ValueError, RuntimeError: as :class:`World` and :meth:`World.start`.
        """
        world = self._worlds.get((backend, size))
        if world is None:
            world = self._worlds[(backend, size)] = World(size, backend)
        if not world.running:
            world.stop()
            world.start()
        return world

    def close(self) -> None:
        """Stop every world (all at once: each waits seconds for its ranks to close)."""
        threads = [threading.Thread(target=world.stop) for world in self._worlds.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._worlds.clear()


@contextlib.asynccontextmanager
async def fresh(comm: asyncomm.Comm,
                env: Mapping[str, str] | None = None) -> AsyncIterator[asyncomm.Comm]:
    """Yield a new communicator over every rank of ``comm`` (a clean slate), closed on leaving.

    Args:
        comm: whose ranks (every one enters, as for ``comm.group``).
        env: environment variables set while it is made, for settings read then
            (``ASYNCOMM_DEBUG``, ``ASYNCOMM_MAX_MESSAGE_BYTES``), and restored after.
    """
    with mock.patch.dict(os.environ, env or {}):
        sub = await comm.group(range(comm.size))
    assert sub is not None
    try:
        yield sub
    except BaseException:
        await sub._close(linger=0.0)  # failing: the other ranks may never close theirs
        raise
    await sub.close()


def run_script(source: str, directory: Path, n: int, backend: str = "gloo",
               timeout: float = 90.0, env: Mapping[str, str] | None = None,
               options: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """Write ``source`` as a script in ``directory`` and run it with ``asyncomm run -n n``.

    ``env`` is added to the ranks' environment, ``options`` to ``asyncomm run``'s
    (``--keep-going``). Skips the calling test (pytest) when
    ``backend`` is ``"mpi"`` and no mpiexec exists.

    Returns:
        The finished run, its output captured as text.

    Raises:
        subprocess.TimeoutExpired: it took longer than ``timeout`` seconds.
    """
    if backend == "mpi" and find_mpiexec() is None:
        import pytest

        pytest.skip("mpiexec not installed")
    script = directory / f"script_{secrets.token_hex(4)}.py"
    script.write_text(source)
    root = str(Path(asyncomm.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "asyncomm", "run", "-n", str(n), "--backend", backend,
            *options, str(script)]
    return run_command(argv, timeout, env={**os.environ, **(env or {}), "PYTHONPATH": path})


def run_command(argv: Sequence[str], timeout: float, *, cwd: Path | str | None = None,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a launcher: ``asyncomm run``, ``asyncomm bench``) to its end.

    Past ``timeout`` seconds it is sent SIGTERM, on which a launcher stops its ranks (they
    live in sessions of their own: killing the launcher alone would leave them running,
    slowing every later test), and SIGKILL 15 s later.

    Returns:
        The finished run, its output captured as text.

    Raises:
        subprocess.TimeoutExpired: it took longer than ``timeout`` seconds (with the output
            it gave).
    """
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=cwd, env=env) as launcher:
        try:
            out, err = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            launcher.terminate()
            try:
                out, err = launcher.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                launcher.kill()
                out, err = launcher.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, launcher.returncode, out, err)


__all__ = ["CHECK_TIMEOUT_S", "START_TIMEOUT_S", "World", "WorldFailure", "WorldPool",
           "find_mpiexec", "fresh", "host_store", "mpiexec_flavour", "network", "run_command",
           "run_script"]
