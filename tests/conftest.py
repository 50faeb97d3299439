"""Fixtures: real multi-rank worlds on gloo and MPI, from the plugin's pool (one per session).

The asyncomm pytest plugin (``asyncomm.testing.plugin``, loaded through its entry point)
gives ``asyncomm_worlds``; these fixtures pick worlds from it.
"""

from __future__ import annotations

import compileall
from collections.abc import Iterator
from pathlib import Path

import pytest

import asyncomm
from asyncomm._tools import launch as _launch
from asyncomm.testing import World, WorldPool

BACKENDS = [
    "gloo",
    pytest.param("mpi", marks=pytest.mark.skipif(_launch.find_mpiexec() is None,
                                                 reason="mpiexec not installed")),
]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package once, then say the random order's seed even under ``-q`` (re-run
    an order with ``-p randomly --randomly-seed=N``; ``-p no:randomly`` runs in file order).

    The tests start hundreds of rank processes; where ``PYTHONDONTWRITEBYTECODE`` is set
    (a fresh CI environment), each would compile every module it imports again.
    """
    compileall.compile_dir(Path(asyncomm.__file__).parent, quiet=1)
    seed = getattr(session.config.option, "randomly_seed", None)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None:
        reporter.write_line(f"tests in random order: --randomly-seed={seed}")


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
