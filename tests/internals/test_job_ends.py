"""Ranks that end, driven through the calls asyncomm makes itself (internals, on purpose):
``Comm._abort_job``, which a failing MPI rank calls to end the job, and the backend's
``release`` of a rank that left, which the router calls for a peer gone meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncomm.testing import run_script

ABORTING = """
import asyncio, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        comm._abort_job(3)
        print("still running after the abort", flush=True)
    await asyncio.sleep(10)

asyncomm.run(main)
"""


@pytest.mark.timeout(600)  # three MPI jobs, each starting torch: slow on a loaded machine
def test_an_aborting_rank_goes_at_once(tmp_path: Path) -> None:
    # MPICH's MPI_Abort returns once it told the process manager, which kills the ranks a
    # moment later: the rank's error went on meanwhile, and under load Python printed a
    # second traceback before the kill (a failure seen in CI). The rank now ends itself.
    proc = run_script(ABORTING, tmp_path, 2, "mpi", timeout=180)
    assert proc.returncode != 0, proc.stderr
    assert "still running" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


RELEASE_AFTER_LEAVING = """
import asyncio, os, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        os._exit(0)  # leaves at once, as a rank that fails does (its connections close)
    await asyncio.sleep(1.0)
    # What a rank does when a rank that left asked it to end its any-source receive:
    comm._backend.release(1, 9)  # private: the router's call, for a peer gone meanwhile
    print("released quietly", flush=True)
    os._exit(0)

asyncomm.run(main)
"""


def test_a_release_for_a_rank_that_left_is_quiet(tmp_path: Path) -> None:
    # A rank leaving on an error asks a live peer to end its stuck receive and goes at
    # once: by the time the peer acts, the connection may be closed. The peer goes on
    # quietly (it logged a traceback from gloo's send, in 1 of 8 runs of the cycles above).
    proc = run_script(RELEASE_AFTER_LEAVING, tmp_path, 2, "gloo", timeout=60)
    assert "released quietly" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
