"""``asyncomm run`` end to end: real launcher, real ranks, no mocks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncomm.testing import find_mpiexec, run_command

ROOT = Path(__file__).resolve().parents[1]

needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py",
)


def write(tmp_path: Path, source: str) -> Path:
    """Write a rank script into tmp_path and return its path."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(source))
    return script


def asyncomm_run(
    tmp_path: Path, *args: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python -m asyncomm run ARGS`` in tmp_path; return the result and its duration."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    done = run_command([sys.executable, "-m", "asyncomm", "run", *args], timeout, cwd=tmp_path,
                       env=env)
    return done, time.monotonic() - start


def summary(stderr: str) -> str:
    """Return the launcher's own failure summary at the end of stderr."""
    assert "asyncomm run: " in stderr, stderr
    return stderr[stderr.rindex("asyncomm run: ") :]


def test_output_is_labelled_and_env_and_args_pass_through(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        """
        import os, sys
        env = os.environ
        print(f"rank={env['RANK']} size={env['WORLD_SIZE']} local={env['LOCAL_RANK']}"
              f" store={env['ASYNCOMM_STORE']} addr={env['MASTER_ADDR']}"
              f" backend={env.get('ASYNCOMM_BACKEND')} timeout={env.get('ASYNCOMM_TIMEOUT')}"
              f" args={sys.argv[1:]}")
        print(f"to stderr from {env['RANK']}", file=sys.stderr)
        """,
    )
    done, _ = asyncomm_run(tmp_path, "-n", "3", "--timeout", "12", script.name, "-n", "7", "--x")
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert (
            f"[{rank}] rank={rank} size=3 local={rank} store=client addr=127.0.0.1"
            f" backend=None timeout=12 args=['-n', '7', '--x']\n"
        ) in done.stdout
        assert f"[{rank}] to stderr from {rank}\n" in done.stderr
    assert len(done.stdout.splitlines()) == 3


def test_a_rank_starts_and_ends_as_its_own_python_process(tmp_path: Path) -> None:
    # Ranks are forked from the launcher (torch loads once): each must still be what
    # ``python rank.py`` would be. Its folder leads sys.path, its threads are joined and its
    # atexit work done as it ends, and its exit status is its own.
    (tmp_path / "helper.py").write_text("WHERE = 'beside the script'\n")
    script = write(
        tmp_path,
        """
        import atexit, os, sys, threading, time, helper
        rank = int(os.environ["RANK"])
        atexit.register(print, f"atexit {rank}")
        def late():
            time.sleep(0.5)
            print(f"thread {rank} {helper.WHERE} {__name__}")
        threading.Thread(target=late).start()
        if rank == 1:
            sys.exit(3)
        """,
    )
    done, _ = asyncomm_run(tmp_path, "-n", "2", script.name)
    for rank in (0, 1):
        assert f"[{rank}] thread {rank} beside the script __main__\n" in done.stdout, done.stdout
        assert f"[{rank}] atexit {rank}\n" in done.stdout, done.stdout
    assert done.returncode == 3, done.stderr
    assert "rank 1 failed first (exited with code 3)" in done.stderr, done.stderr


def test_a_raising_rank_stops_the_world_and_is_named(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        """
        import os, time
        if os.environ["RANK"] == "1":
            time.sleep(0.2)
            raise ValueError("boom from rank one")
        time.sleep(600)
        """,
    )
    done, took = asyncomm_run(tmp_path, "-n", "3", "--grace", "1", script.name, timeout=280)
    assert done.returncode == 1
    assert took < 250  # the others were stopped: they would sleep 600 s
    assert summary(done.stderr) == ("asyncomm run: rank 1 failed first: ValueError: boom from "
                                    "rank one (exited with code 1); stopped the other ranks\n")
    # the traceback went by with rank 1's output; the summary does not repeat it
    assert done.stderr.count("Traceback (most recent call last):") == 1, done.stderr
    assert done.stderr.count("[1] ValueError: boom from rank one") == 1, done.stderr


def test_a_killed_rank_is_named(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        """
        import os, signal, time
        if os.environ["RANK"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
        """,
    )
    done, took = asyncomm_run(tmp_path, "-n", "3", "--grace", "1", script.name, timeout=280)
    assert done.returncode != 0
    assert took < 250  # the others were stopped: they would sleep 600 s
    assert summary(done.stderr).startswith("asyncomm run: rank 2 failed first (killed by SIGKILL)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_store_listens_on_loopback_only_and_serves_ranks(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        """
        import datetime, os
        from torch.distributed import TCPStore

        port = int(os.environ["MASTER_PORT"])
        # Only the launcher's own sockets count: another process may listen on the same
        # port number at another address (gloo binds the host's address).
        fds = "/proc/%d/fd" % os.getppid()
        launchers = set()
        for fd in os.listdir(fds):
            try:
                launchers.add(os.readlink(os.path.join(fds, fd)))
            except FileNotFoundError:  # closed since listed
                pass
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if os.path.exists(table):
                for row in open(table).readlines()[1:]:
                    local, state, inode = row.split()[1], row.split()[3], row.split()[9]
                    addr, hexport = local.rsplit(":", 1)
                    if (state == "0A" and int(hexport, 16) == port  # 0A: LISTEN
                            and "socket:[%s]" % inode in launchers):
                        listening.add(addr)
        print("listening", sorted(listening))

        store = TCPStore(os.environ["MASTER_ADDR"], port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))
        store.set("rank" + os.environ["RANK"], "here")
        store.wait(["rank0", "rank1"])
        print("store ok")
        """,
    )
    done, _ = asyncomm_run(tmp_path, "-n", "2", script.name)
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"[{rank}] listening ['0100007F']\n" in done.stdout  # 127.0.0.1, little-endian
        assert f"[{rank}] store ok\n" in done.stdout


# A plain mpi4py program, not asyncomm's: the launcher runs any MPI program. (asyncomm.run's
# own failure path under MPI is test_failures' test_a_failing_rank_is_reported_once...)
MPI_SCRIPT = """
import fcntl, os, struct, sys, termios, time
from mpi4py import MPI


def forwarded(fd):
    # Wait until the process manager has read what this rank wrote to ``fd`` (a pipe: the
    # bytes its reader has not taken yet are counted there), a minute at most; where the
    # count cannot be had, a moment.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, bytes(4)))[0]
        except OSError:
            time.sleep(0.5)
            return
        if not unread:
            return
        time.sleep(0.01)


comm = MPI.COMM_WORLD
rank = comm.Get_rank()
print(f"hello from {rank} of {comm.Get_size()} args={sys.argv[1:]}")
comm.Barrier()
if "fail" in sys.argv:
    if rank == 1:
        try:
            raise RuntimeError("mpi rank one broke")
        except RuntimeError:
            import traceback
            traceback.print_exc()
        sys.stderr.flush()  # a careful program lets Hydra forward the traceback's last line
        forwarded(2)        # before it ends the job
        comm.Abort(3)
    time.sleep(600)
if "die" in sys.argv:
    if rank == 1:
        os._exit(5)  # dies without a word: no traceback, no Abort
    comm.Barrier()  # waits for rank 1 forever, unless the job ends
"""


@needs_mpi
def test_mpi_output_is_labelled(tmp_path: Path) -> None:
    script = write(tmp_path, MPI_SCRIPT)
    done, _ = asyncomm_run(tmp_path, "-n", "3", "--backend", "mpi", script.name, "-v", "x")
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"[{rank}] hello from {rank} of 3 args=['-v', 'x']\n" in done.stdout


@needs_mpi
def test_mpi_failure_names_the_rank(tmp_path: Path) -> None:
    script = write(tmp_path, MPI_SCRIPT)
    done, took = asyncomm_run(tmp_path, "-n", "3", "--backend", "mpi", script.name, "fail",
                              timeout=280)
    assert done.returncode == 3
    assert took < 250  # the others were stopped: they would sleep 600 s
    said = summary(done.stderr)  # MPICH's own abort line, when it comes, is folded in
    assert said.startswith("asyncomm run: rank 1 failed first: RuntimeError: mpi rank one "
                           "broke ("), said
    assert said.endswith("mpiexec exited with code 3)\n"), said
    assert done.stderr.count("Traceback (most recent call last):") == 1, done.stderr
    assert "application called MPI_Abort" not in done.stderr  # said once, by the summary


@needs_mpi
def test_a_dead_mpi_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    script = write(tmp_path, MPI_SCRIPT)
    done, _ = asyncomm_run(tmp_path, "-n", "3", "--backend", "mpi", script.name, "die")
    assert done.returncode != 0  # a hang fails in asyncomm_run
    assert "rank 1 exited with code 5" in summary(done.stderr), done.stderr
    assert "Exit codes" not in done.stdout  # mpiexec's report is read, not shown
