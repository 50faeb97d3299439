"""Fixtures: real multi-rank worlds on gloo and MPI, from the plugin's pool (one per session).

The asyncomm pytest plugin (``asyncomm.testing.plugin``, loaded through its entry point)
gives ``asyncomm_worlds``; these fixtures pick worlds from it.
"""

from __future__ import annotations

import compileall
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncomm
from asyncomm.testing import World, WorldPool, find_mpiexec

BACKENDS = [
    "gloo",
    pytest.param("mpi", marks=pytest.mark.skipif(find_mpiexec() is None,
                                                 reason="mpiexec not installed")),
]
_started = [0.0]  # the session's start (time.time()): older files are not the session's


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package once, then say the random order's seed even under ``-q`` (re-run
    an order with ``-p randomly --randomly-seed=N``; ``-p no:randomly`` runs in file order).

    The tests start hundreds of rank processes; where ``PYTHONDONTWRITEBYTECODE`` is set
    (a fresh CI environment), each would compile every module it imports again.
    """
    _started[0] = time.time()
    compileall.compile_dir(Path(asyncomm.__file__).parent, quiet=1)
    seed = getattr(session.config.option, "randomly_seed", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:
        reporter.write_line(f"tests in random order: --randomly-seed={seed}")


def _mapped() -> set[str]:
    """The files some live process maps (as /proc/PID/maps names them)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):  # (a process that ended meanwhile)
            for line in maps.read_text().splitlines():
                fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
                if len(fields) == 6:
                    names.add(fields[5].strip())
    return names


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove MPICH's shared-memory files that the session's killed MPI jobs left behind.

    MPICH removes a job's ``/dev/shm/mpich_shm_*`` files only when its ranks end
    normally, and the suite kills ranks on purpose: each run left their memory behind.
    Only the controlling process does this, at the very end, and only for
    files no live process maps (another job's, in use, stay).
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller does it
        return
    left = []
    for f in Path("/dev/shm").glob("mpich_shm_*"):
        with contextlib.suppress(OSError):  # (removed meanwhile)
            if f.stat().st_mtime >= _started[0]:
                left.append(f)
    in_use = _mapped() if left else set()
    for f in left:
        if str(f) not in in_use:
            with contextlib.suppress(OSError):  # (another user's, say)
                f.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def worlds(asyncomm_worlds: WorldPool) -> Iterator[WorldPool]:
    yield asyncomm_worlds


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest, worlds: WorldPool) -> World:
    """A world of 3 ranks (odd on purpose: no power-of-two shortcuts)."""
    return worlds.get(request.param, 3)


@pytest.fixture(params=BACKENDS)
def world2(request: pytest.FixtureRequest, worlds: WorldPool) -> World:
    """A world of 2 ranks."""
    return worlds.get(request.param, 2)


@pytest.fixture(params=BACKENDS)
def world4(request: pytest.FixtureRequest, worlds: WorldPool) -> World:
    """A world of 4 ranks."""
    return worlds.get(request.param, 4)
