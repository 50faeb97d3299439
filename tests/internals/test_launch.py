"""The launcher's parts (internals, on purpose): ``launch`` called in this process, its
supervision of rank processes, its reading of Open MPI's reports and labels, and what the
launching commands import."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from test_launcher import summary, write

from asyncomm._tools import launch as _launch
from asyncomm._tools.launch import launch

ROOT = Path(__file__).resolve().parents[2]


def test_launch_returns_the_failed_rank_exit_code(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        """
        import os, pathlib, sys, time
        print("extra", os.environ["EXTRA"])
        if os.environ["RANK"] == "1":
            pathlib.Path(os.environ["FLAG"]).touch()
            sys.exit(0)
        # Rank 0's exit stops rank 1, so let rank 1 print first.
        while not pathlib.Path(os.environ["FLAG"]).exists():
            time.sleep(0.05)
        sys.exit(7)
        """,
    )
    flag = str(tmp_path / "printed")
    kept = tempfile.TemporaryDirectory()  # the caller's: its ranks must not remove it
    assert launch([str(script)], 2, env={"EXTRA": "yes", "FLAG": flag}) == 7
    out, err = capfd.readouterr()
    assert "[0] extra yes\n" in out and "[1] extra yes\n" in out
    assert os.path.isdir(kept.name), "a rank did the caller's exit work"
    kept.cleanup()
    assert summary(err).startswith("asyncomm run: rank 0 failed first (exited with code 7)")


OPEN_MPI_EXITED = b"""\
--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-8570@1,1]
   Exit code:    5
--------------------------------------------------------------------------"""


OPEN_MPI_SIGNALLED = b"""\
--------------------------------------------------------------------------
prterun noticed that process rank 2 with PID 8765 on node vm exited on
signal 11 (Segmentation fault).
--------------------------------------------------------------------------"""


@pytest.mark.parametrize(("report", "said"), [(OPEN_MPI_EXITED, "rank 1 exited with code 5"),
                                              (OPEN_MPI_SIGNALLED, "rank 2 killed by SIGSEGV")])
def test_open_mpi_names_the_rank_that_failed(report: bytes, said: str) -> None:
    # Open MPI's report, as its mpiexec (5.0) wrote it when a rank exited with a code of its
    # own or died of a signal (the real run: tests above, where Open MPI is installed)
    world = _launch._World(codes=[])
    for line in report.splitlines():
        _launch._open_mpi_report(world, line)
    assert _launch._dead_ranks(world.statuses, None) == said


def test_the_launching_commands_do_not_load_torch() -> None:
    probe = textwrap.dedent("""
        import sys
        import asyncomm
        from asyncomm._tools import cli as _cli
        argv = ["run", "-n", "2", "script.py"]
        assert _cli._parser(argv).parse_args(argv).nproc == 2
        assert "torch" not in sys.modules, "run loaded torch"
        _cli._parser(["bench", "channels"])  # the bench's parent only launches and reports
        assert "torch" not in sys.modules, "bench loaded torch"
        assert asyncomm.Comm.__module__ == "asyncomm._comm.comm" and asyncomm.pipeline.Pipeline
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


def test_a_store_that_cannot_start_stops_the_ranks() -> None:
    def broken() -> object:
        raise OSError("no store today")

    async def supervise() -> object:
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        return await _launch._supervise([_launch._spawn(sleeper, dict(os.environ))] * 2, 0.0,
                                        labeled=False, serve=broken)

    start = time.monotonic()
    with pytest.raises(OSError, match="no store today"):
        asyncio.run(supervise())
    assert time.monotonic() - start < 30  # not the ranks' 60 s


def test_open_mpi_labels_read_as_mpichs(capfd: pytest.CaptureFixture[str]) -> None:
    # Open MPI's mpiexec labels each line "[job,rank]<stream>: "; asyncomm run shows the
    # rank as MPICH's does, "[rank] ", and reads it (a rank's stderr tail is its own).
    said = ("import sys; print('[1,0]<stdout>: hello'); print('[1,1]<stdout>: world'); "
            "print('[1,1]<stderr>: oops', file=sys.stderr)")
    world = asyncio.run(_launch._supervise([_launch._spawn([sys.executable, "-c", said],
                                                           dict(os.environ))], 0.0,
                                           labeled=True))
    out, err = capfd.readouterr()
    assert out.splitlines() == ["[0] hello", "[1] world"], out
    assert err.splitlines() == ["[1] oops"], err
    assert list(world.tails[1]) == ["oops"], world.tails
