"""Teardown: ending a program or closing with operations in flight never aborts or hangs.

gloo used to kill a process that had succeeded: a waiter thread left inside ``wait()``
on a pending receive, or gloo's own thread running the Python callback of a pending
collective, woke while the interpreter finalized and ended in ``std::terminate``
(SIGABRT). The scenarios below leave every kind of operation in flight -- a timed-out
receive and send, a posted any-source receive, a collective one peer never joins while
another has already left -- and are repeated, because the abort came only sometimes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncomm.testing import run_script

CYCLES = """
import asyncio, faulthandler, sys, threading, time, torch, asyncomm
from asyncomm import CommTimeoutError, PeerFailedError

class Leave(Exception):
    '''Rank 1 leaves its world at once, without waiting for the others.'''

def threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncomm"))

async def cycle(number):
    parked = []  # threads that may stay parked (see the README's failure handling)
    try:
        async with asyncomm.init(timeout=60) as comm:
            # Rank 1 leaves: with no other rank, no live peer can end rank 0's any-source
            # recv; with rank 2, rank 0 may ask rank 1 to end it, not knowing yet that rank 1
            # leaves at once (a loaded machine): that thread too stays parked (docs/failures).
            if comm.size == 2 or comm.rank == 0:
                parked.append("asyncomm-waiter-endless")
            nxt = (comm.rank + 1) % comm.size
            for handle in (comm.recv(torch.zeros(4), nxt, tag=5, timeout=0.1),
                           comm.send(torch.zeros(1 << 20), nxt, tag=7, timeout=0.1)):
                try:
                    await handle
                except CommTimeoutError:
                    pass
                else:
                    raise AssertionError("no timeout")
            posted = comm.recv(torch.zeros(4), None, tag=9)  # posted, never matched
            await comm.barrier()
            if comm.rank == 1:
                raise Leave
            if comm.rank == 0:  # rank 1 has left (or is leaving), rank 2 (if any) never joins
                try:
                    await comm.all_reduce(torch.ones(1), timeout=0.2)
                except (CommTimeoutError, PeerFailedError):
                    pass
                else:
                    raise AssertionError("an all_reduce of one rank completed")
    except Leave:
        # A rank that leaves at once is drained by nobody: its link's listener stays
        # parked in a receive that nothing can reach any more. So may the thread of its
        # any-source receive: it asked a live peer to end it, but does not wait for that.
        parked = ["asyncomm-listener", "asyncomm-waiter-endless"]
    # a thread told to end at close may take a moment to do so: what is left is what does
    # not end within a generous while
    deadline = time.monotonic() + 60
    # (a send gloo lost, its peer leaving mid-write, parks its thread for good: named so)
    while ((left := [t for t in threads() if t not in parked and t != "asyncomm-lost"])
           and time.monotonic() < deadline):
        await asyncio.sleep(0.01)
    if left:  # where each is stuck, for whoever reads the failure
        faulthandler.dump_traceback(all_threads=True)
    assert left == [], (number, left)
    try:  # closing failed what was still in flight (or rank 1 said it failed, first)
        posted.result()
    except (asyncomm.CommClosedError, PeerFailedError):
        pass
    else:
        raise AssertionError("a receive in flight at close did not fail")

async def main():
    for number in range(int(sys.argv[1])):
        await cycle(number)
    print("cycles ok", flush=True)

import uvloop  # the loop asyncomm.run runs its ranks on

uvloop.run(main())
"""


def test_ending_with_operations_in_flight_never_aborts_gloo(tmp_path: Path) -> None:
    # Two ranks (rank 1 leaves while rank 0's collective waits on it) keep the exits short;
    # the three-rank cycles below add a peer that stays but never joins. ``asyncomm run``
    # forks its gloo ranks from a launcher that loaded torch, and each ends as Python ends
    # (finalization, atexit). Four runs: the abort this guards against came in 4 of 4
    # before the fix.
    for _ in range(4):
        proc = run_script(CYCLES.replace("int(sys.argv[1])", "1"), tmp_path, 2, "gloo")
        said = proc.stdout + proc.stderr
        assert proc.returncode == 0, said
        assert said.count("cycles ok") == 2, said
        assert "terminate" not in said and "Traceback" not in said, said


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_closing_with_operations_in_flight_leaves_nothing_behind(tmp_path: Path,
                                                               backend: str) -> None:
    proc = run_script(CYCLES.replace("int(sys.argv[1])", "6"), tmp_path, 3, backend,
                      timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("cycles ok") == 3, proc.stdout + proc.stderr
    assert "terminate" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


NEVER_CLOSED = """
import atexit, time

ended = []

def exited():  # registered before asyncomm is imported, so called after its exit work
    if ended:
        print("exit work took", time.monotonic() - ended[0], flush=True)

atexit.register(exited)

import asyncio, torch, asyncomm

async def main():
    comm = await asyncomm.init()  # closing is left to the program, which never does
    ch = comm.channel(1)
    groups = [await comm.group(range(comm.size)) for _ in range(6)]
    if comm.rank == 0:
        await ch.send(torch.ones(2), 1)
        for group in groups:
            await group.channel(2).send("hello", 1)
    elif comm.rank == 1:
        assert (await ch.recv(0)).data.sum().item() == 2.0
        for group in groups:
            assert (await group.channel(2).recv(0)).data == "hello"
    await comm.barrier()
    print("ended", flush=True)
    ended.append(time.monotonic())

asyncio.run(main())
"""


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_communicator_never_closed_ends_quietly(tmp_path: Path, backend: str) -> None:
    # MPI: each communicator's link keeps a receive posted (MPICH); those of communicators
    # never closed are cancelled at exit, before MPI finalizes (UCX warned of each left).
    proc = run_script(NEVER_CLOSED, tmp_path, 2, backend, timeout=100)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert proc.stdout.count("ended") == 2, said
    # Nothing in flight, nothing waited for at exit. A communicator whose exit waits for
    # something that never ends waits out its settling deadline (5 s, see
    # ``TorchBackend._settle``), one communicator after another: gloo's reaper of eager
    # sends, counted as busy while its thread lived, did so. Seven communicators would take
    # over twice the bound, which is far above what the exit work itself takes, even on a
    # loaded machine. (Timed in the ranks, from the end of main to the last exit handler:
    # asyncomm's exit work alone, not the processes' start or teardown.)
    took = [float(line.split()[-1]) for line in proc.stdout.splitlines()
            if "exit work took" in line]
    assert len(took) == 2 and max(took) < 15.0, said
    assert "WARN" not in said and "Traceback" not in said and "warning" not in said, said
