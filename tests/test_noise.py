"""What a user reads when a world is stopped or fails, on both backends: Ctrl-C ends it in a
line, a failing rank's traceback reads as Python's own, and neither mpiexec's banners nor
C++ source locations get through."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import asyncomm
from asyncomm.testing import find_mpiexec

ROOT = Path(asyncomm.__file__).resolve().parents[1]
BACKENDS = ["gloo", pytest.param("mpi", marks=pytest.mark.skipif(
    find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py"))]


def start(tmp_path: Path, source: str, n: int, backend: str) -> subprocess.Popen[str]:
    """Start ``asyncomm run`` on ``source`` in tmp_path, the script named as a user types it
    (relative to the current folder)."""
    (tmp_path / "rank.py").write_text(textwrap.dedent(source))
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "asyncomm", "run", "-n", str(n), "--backend", backend,
         "rank.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": path}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def run(tmp_path: Path, source: str, n: int, backend: str) -> tuple[int, str]:
    """Run ``source`` as ``start`` does; return the exit code and stderr."""
    proc = start(tmp_path, source, n, backend)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


# Ctrl-C while every rank loads torch, or once every rank is in main.
SLEEPER = """
print("starting", flush=True)
import asyncio, asyncomm, torch

async def main(comm):
    await comm.barrier()
    print("ready", flush=True)
    await asyncio.sleep(300)

asyncomm.run(main)
"""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", ["starting", "ready"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_stops_the_world_in_a_line(tmp_path: Path, backend: str, phase: str,
                                          request: pytest.FixtureRequest) -> None:
    n = 3
    # (where it lands varies from run to run: see also the callback test below)
    proc = start(tmp_path, SLEEPER, n, backend)
    assert proc.stdout is not None
    seen = 0
    while seen < n and (line := proc.stdout.readline()):
        seen += line.endswith(f"] {phase}\n")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    said = [line for line in (out + err).splitlines()
            if not line.endswith(("] starting", "] ready"))]
    assert proc.returncode == 130, out + err
    assert said[-1].startswith("asyncomm run: interrupted"), out + err
    assert len(said) <= n + 1 and all(len(line) < 160 for line in said), out + err


FAILING = """
import asyncomm

async def main(comm):
    if comm.rank == 1:
        raise ValueError("boom")
    await comm.barrier()

asyncomm.run(main)
"""
PLAIN = """
def fail():
    raise ValueError("plain")

fail()
"""


def traceback_of(rank: int, err: str) -> list[str]:
    """The lines of ``rank``'s traceback in the launcher's stderr, its label dropped."""
    lines = [line[len(f"[{rank}] "):] for line in err.splitlines()
             if line.startswith(f"[{rank}] ")]
    return lines[lines.index("Traceback (most recent call last):"):]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_traceback_is_pythons_own(tmp_path: Path, backend: str) -> None:
    code, err = run(tmp_path, PLAIN, 1, backend)
    assert code == 1, err
    python = subprocess.run([sys.executable, "rank.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)  # the path absolute, the frames its own
    assert traceback_of(0, err) == python.stderr.splitlines(), err


@pytest.mark.timeout(600)
def test_a_failing_rank_traceback_reads_the_same_on_both_backends(tmp_path: Path) -> None:
    # main's frames under the script's own (as Python shows an uncaught error), word for
    # word the same whichever backend ends the job
    code, err = run(tmp_path, FAILING, 2, "gloo")
    assert code == 1, err
    gloo = traceback_of(1, err)
    frames = [line for line in gloo if line.startswith("  File ")]
    assert frames[0] == f'  File "{tmp_path / "rank.py"}", line 9, in <module>', err
    assert frames[-1] == f'  File "{tmp_path / "rank.py"}", line 6, in main', err
    if find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpiexec and mpi4py (gloo's checked)")
    code, err = run(tmp_path, FAILING, 2, "mpi")
    assert code == 1, err
    mpi = traceback_of(1, err)
    assert mpi == gloo, "\n".join(["gloo:", *gloo, "mpi:", *mpi])


@pytest.mark.timeout(600)
@pytest.mark.skipif(find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpiexec and mpi4py")
def test_a_killed_mpi_rank_is_said_once(tmp_path: Path) -> None:
    proc = start(tmp_path, """
        import os, signal
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        MPI.COMM_WORLD.Barrier()
        """, 2, "mpi")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    said = (out + err).strip().splitlines()  # MPICH's banner, when it comes, is left out
    assert len(said) == 1 and re.match(r"asyncomm run: .*rank 1 killed by SIGKILL", said[0]), (
        out + err)


# A gloo error of the program's own (a raw receive that times out) while its peers wait in an
# all_reduce: they are told what it raised, or find its connection closed first.
RAW_FAILING = """
import datetime, asyncomm, torch

async def main(comm):
    if comm.rank == 1:
        comm.raw.recv([torch.ones(1)], 0, 99).wait(datetime.timedelta(milliseconds=100))
    await comm.all_reduce(torch.ones(4))

asyncomm.run(main)
"""


@pytest.mark.timeout(600)
def test_a_gloo_failure_is_said_without_cpp_source_locations(tmp_path: Path) -> None:
    code, err = run(tmp_path, RAW_FAILING, 3, "gloo")  # (the peers hear of rank 1 or find
    assert code == 1, err  # it gone first: either way no C++ location is said)
    said = [line for line in err.splitlines() if not line.startswith("[1] ")]
    assert said[-1].startswith("asyncomm run: rank 1 failed first: RuntimeError: Timed "
                               "out waiting 100ms for recv operation"), err
    assert not [line for line in said if ".cc:" in line], err


# Ctrl-C may land in a callback (an import lock's, as a rank loads torch): Python reports it
# there as "Exception ignored in ...", a traceback of its own. A rank started by the launcher
# leaves that to the launcher's one line.
UNRAISABLE = """
class Interrupted:
    def __del__(self):
        raise KeyboardInterrupt

Interrupted()

class Broken:
    def __del__(self):
        raise ValueError("still said")

Broken()
"""


def test_an_interrupt_in_a_callback_is_not_reported_by_the_rank(tmp_path: Path) -> None:
    _, err = run(tmp_path, UNRAISABLE, 1, "gloo")
    assert "KeyboardInterrupt" not in err and "ValueError: still said" in err, err


# Ctrl-C may land after ``asyncomm.run`` made main's coroutine but before the loop began it
# (as the loop is made): the coroutine never runs, and Python would say so at exit.
INTERRUPTED_EARLY = """
import asyncio, uvloop, asyncomm

def interrupted():
    raise KeyboardInterrupt  # where Ctrl-C lands: as the loop is made

uvloop.new_event_loop = asyncio.events.new_event_loop = interrupted

async def main(comm):
    pass

asyncomm.run(main)
"""


def test_an_interrupt_before_the_loop_begins_main_says_nothing_of_it(tmp_path: Path) -> None:
    code, err = run(tmp_path, INTERRUPTED_EARLY, 1, "gloo")
    assert code == 130 and "never awaited" not in err, err
