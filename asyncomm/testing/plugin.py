"""The asyncomm pytest plugin: ``async def test_x(comm)`` runs on every rank of a real world.

Registered for pytest (entry point ``pytest11``) when asyncomm is installed; docs/testing.md
("Testing your own code") shows it at work. A coroutine test function whose only parameter
is ``comm`` is collected as one test per backend of its ``asyncomm`` marker (``test_x[gloo]``;
defaults ``ranks=2``, ``backends=("gloo",)``, ``timeout=150``), run on every rank of a pooled
world (``WorldPool``, started once per session); it fails with every failing rank's
traceback, or every rank's stack on a hang. MPI tests are skipped where no ``mpiexec``
exists. The session fixture ``asyncomm_worlds`` gives the pool itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

from asyncomm.testing import CHECK_TIMEOUT_S, WorldFailure, WorldPool

_POOL = pytest.StashKey[WorldPool]()
_DEFAULTS: dict[str, Any] = {"ranks": 2, "backends": ("gloo",), "timeout": CHECK_TIMEOUT_S}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "asyncomm(ranks=2, backends=('gloo',), timeout=150): run this "
        "`async def test_x(comm)` on every rank of a world of `ranks` processes, per backend")


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None:
        pool.close()


def _pool(config: pytest.Config) -> WorldPool:
    return config.stash.setdefault(_POOL, WorldPool())


@pytest.fixture(scope="session")
def asyncomm_worlds(request: pytest.FixtureRequest) -> Iterator[WorldPool]:
    """The session's pool of rank worlds, by (backend, size)."""
    yield _pool(request.config)


def _options(collector: pytest.Collector, function: Any) -> dict[str, Any]:
    """The ``asyncomm`` marker's arguments: the function's, else its module's, else defaults."""
    options = dict(_DEFAULTS)
    module = getattr(collector, "module", None)
    for owner in (module, function):
        marks = getattr(owner, "pytestmark", [])
        for mark in marks if isinstance(marks, list) else [marks]:
            if mark.name == "asyncomm":
                options.update(mark.kwargs)
    return options


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str,
                              obj: object) -> list[RankTest] | None:
    if not (isinstance(collector, pytest.Module) and collector.funcnamefilter(name)
            and inspect.iscoroutinefunction(obj)):
        return None
    if list(inspect.signature(obj).parameters) != ["comm"]:
        return None  # not a rank test (pytest-asyncio, say, may run it)
    options = _options(collector, obj)
    backends = options["backends"]
    backends = (backends,) if isinstance(backends, str) else tuple(backends)
    return [RankTest.from_parent(collector, name=f"{name}[{backend}]", function=obj,
                                 backend=backend, ranks=int(options["ranks"]),
                                 timeout=float(options["timeout"]))
            for backend in backends]


class RankTest(pytest.Item):
    """One rank test on one backend: the function runs on every rank of a pooled world."""

    def __init__(self, *, function: Any, backend: str, ranks: int, timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.function, self.backend, self.ranks, self.timeout = function, backend, ranks, timeout
        self.own_markers.extend(getattr(function, "pytestmark", []))

    def setup(self) -> None:
        if self.backend == "mpi":
            from asyncomm._tools import mpiexec

            if mpiexec.find() is None:
                pytest.skip("mpiexec not installed")

    def runtest(self) -> None:
        world = _pool(self.config).get(self.backend, self.ranks)
        world.run(self.function, timeout=self.timeout)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, WorldFailure):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, self.name
