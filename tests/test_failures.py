"""What a user meets when something goes wrong: timeouts that say what the peers were
doing, warnings of stalled operations, and one report per failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import asyncomm
from asyncomm import Comm, CommTimeoutError
from asyncomm.testing import World, fresh, run_script

HINT = "rerun with ASYNCOMM_DEBUG=1"


async def check_a_mismatch_names_what_the_others_do(comm: Comm) -> str:
    async with fresh(comm) as sub:
        t = torch.ones(4)
        if sub.rank == 0:  # the others broadcast: a mismatch that would hang
            with pytest.raises(CommTimeoutError) as info:
                await sub.all_reduce(t, timeout=1.0)
        else:
            with pytest.raises(CommTimeoutError) as info:
                await sub.broadcast(t, 0, timeout=3.0)
    return str(info.value)


def test_a_collective_timeout_says_what_every_other_rank_does(world: World) -> None:
    said = world.run(check_a_mismatch_names_what_the_others_do)
    # the others issued their broadcast a little after rank 0's all_reduce: 0.9 s, or 1.0-1.1 s
    assert re.match(r"rank 0: all_reduce #1 timed out after 1 s \(this rank's tensor: "
                    r"float32\[4\]\)\. Meanwhile ranks 1, 2: broadcast #1 of float32\[4\] "
                    r"pending for \d\.\d(-\d\.\d)? s\.", said[0]), said[0]
    assert HINT in said[0] and said[0].endswith("(fingerprints)."), said[0]
    for rank in (1, 2):  # rank 0 gave up first, and closed the communicator
        assert said[rank].startswith(f"rank {rank}: broadcast #1 timed out after 3 s "
                                     "(this rank's tensor: float32[4]). "), said
        assert re.search(rf"Meanwhile ranks? 0(, {3 - rank})?: finished \(closed this "
                         r"communicator\)", said[rank]), said[rank]


def hold_the_loop_until(flag: str) -> None:
    """Hold the event loop (block its thread) until the file ``flag`` exists (a minute
    at most, so that a failing peer cannot hang the world)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)


async def until_exists(flag: str) -> None:
    """Wait, yielding the loop, until the file ``flag`` exists (30 s at most)."""
    deadline = time.monotonic() + 30
    while not os.path.exists(flag) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def check_finished_and_silent_peers_are_named(comm: Comm, flag: str) -> str:
    async with fresh(comm) as sub:
        # Together first: a rank that started late would still answer.
        await sub.barrier()
        if sub.rank == 2:
            return ""  # closes the communicator at once (and waits there for the others)
        if sub.rank == 1:
            hold_the_loop_until(flag)  # it cannot answer until rank 0 has its error
            return ""
        try:  # (rank 2's close begins within milliseconds: the deadline leaves it seconds)
            with pytest.raises(CommTimeoutError) as info:
                await sub.all_reduce(torch.ones(1), timeout=2.0)
        finally:
            Path(flag).touch()
        return str(info.value)


def test_finished_and_unresponsive_peers_are_said_so(world: World, tmp_path: Path) -> None:
    said = world.run(check_finished_and_silent_peers_are_named, str(tmp_path / "said"))[0]
    assert "rank 1: no answer within 1 s (exited, or its event loop is blocked)" in said, said
    assert "rank 2: finished (closed this communicator)" in said, said


@contextlib.contextmanager
def warnings_kept(flag: str, about: str) -> Iterator[list[str]]:
    """Keep asyncomm's log messages in the list given, touching ``flag`` at each ``about``
    something (another stall, a barrier's on a loaded machine, says nothing of it)."""
    warned: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())
            if about in record.getMessage():
                Path(flag).touch()

    keep = Keep()
    logging.getLogger("asyncomm").addHandler(keep)
    try:
        yield warned
    finally:
        logging.getLogger("asyncomm").removeHandler(keep)


async def check_a_stalled_operation_is_reported_once(comm: Comm, flag: str) -> list[str]:
    with warnings_kept(flag, "recv #") as warned:
        async with fresh(comm, env={"ASYNCOMM_STALL_S": "0.3"}) as sub:
            if sub.rank == 0:
                await sub.recv(torch.zeros(1), 1, tag=3)
            else:  # once rank 0 warned, several stall periods more: a second warning of
                await until_exists(flag)  # the same operation would come meanwhile
                await asyncio.sleep(1.0)
                await sub.send(torch.ones(1), 0, tag=3)
            await sub.barrier()
    return warned


def test_a_stalled_operation_is_reported_once(world2: World, tmp_path: Path) -> None:
    warned = world2.run(check_a_stalled_operation_is_reported_once, str(tmp_path / "warned"))
    # (a loaded machine may stall the closing barrier too, on either rank: not this test's)
    recvs = [[words for words in said if "recv #" in words] for said in warned]
    assert recvs[1] == [], warned
    assert len(recvs[0]) == 1, warned
    # (pending for 0.3 s or more: how much more, a loaded machine decides)
    assert re.match(r"asyncomm: rank 0: recv #1 peer 1 tag 3 has been pending for "
                    r"\d+\.\d s ", recvs[0][0]), warned
    assert ("(ASYNCOMM_STALL_S=0.3); it goes on waiting. Meanwhile rank 1: nothing issued on "
            "this communicator yet.") in warned[0][0], warned


STALLED = """
import asyncio, os, sys, time, torch, asyncomm

WARNED = __file__ + ".warned"  # (both ranks run this file)


class Watch:
    # stderr, telling rank 1 (by the file WARNED) once a stall warning was written

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if "has been pending" in text:
            open(WARNED, "w").close()
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


async def main(comm):
    if comm.rank == 0:
        sys.stderr = Watch(sys.stderr)
    if comm.rank == 1:  # until rank 0 warned (a minute at most), then several stall
        deadline = time.monotonic() + 60  # periods more: a second warning would show
        while not os.path.exists(WARNED) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.5)
    await comm.all_reduce(torch.ones(1))

asyncomm.run(main)
"""


def test_stall_warnings_show_under_the_launcher(tmp_path: Path) -> None:
    # No logging configured: Python's last-resort handler prints warnings (both backends
    # log alike: the pooled-world test above covers MPI).
    proc = run_script(STALLED, tmp_path, 2, env={"ASYNCOMM_STALL_S": "0.5"})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "has been pending" in line]
    assert len(warnings) == 1, proc.stderr
    # (pending for 0.5 s or more: how much more, a loaded machine decides)
    assert re.match(r"\[0\] asyncomm: rank 0: all_reduce #1 has been pending for \d+\.\d s ",
                    warnings[0]), warnings


FAILING = """
import asyncio, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        raise RuntimeError("boom on purpose")
    await comm.all_reduce(torch.ones(1))  # would wait for rank 1 forever

asyncomm.run(main)
"""


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_failing_rank_is_reported_once_and_ends_the_job(tmp_path: Path, backend: str) -> None:
    # The others' all_reduce would wait out its deadline, made an hour: the job ends long
    # before (run_script fails a run that takes longer than its 240 s), told by rank 1.
    proc = run_script(FAILING, tmp_path, 3, backend, timeout=240,
                      env={"ASYNCOMM_TIMEOUT": "3600"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("Traceback (most recent call last):") == 1, proc.stderr
    assert proc.stderr.count("[1] RuntimeError: boom on purpose") == 1, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    assert summary.startswith("asyncomm run: rank 1 failed first: RuntimeError: boom on "
                              "purpose ("), proc.stderr
    for line in proc.stderr.splitlines():  # a rank that stops because of it says one line
        if "stopped:" in line:  # naming the rank that failed, and what it raised
            assert re.match(r"\[([02])\] asyncomm: rank \1 stopped: asyncomm.PeerFailedError: "
                            r"rank \1: (barrier #1|all_reduce #2): rank 1 failed \(it raised "
                            r"RuntimeError: boom on purpose\)$", line), line


def test_errors_read_as_asyncomm_errors() -> None:
    assert asyncomm.CommTimeoutError.__module__ == "asyncomm"
    error = asyncomm.PeerFailedError("x")
    assert f"{type(error).__module__}.{type(error).__qualname__}" == "asyncomm.PeerFailedError"


SURVIVORS = """
import asyncio, os, sys, time, torch, asyncomm

class Slow(asyncomm.Actor):
    @asyncomm.endpoint
    async def wait(self):
        await asyncio.sleep(60)

async def call(comm):  # in flight to rank 1 as it fails: it will never answer
    try:
        await comm.actor(1, "slow").wait()
    except asyncomm.PeerFailedError as exc:
        print(f"call caught: {exc}", flush=True)

async def listen(comm):  # waiting on rank 1 as it fails: it will never send
    try:
        await comm.channel(5).recv(1)
    except asyncomm.PeerFailedError as exc:
        print(f"channel caught: {exc}", flush=True)

async def main(comm):
    ch, ready = comm.channel(3), comm.channel(4)
    if comm.rank == 1:
        comm.serve(Slow(), "slow")
    await comm.barrier()
    if comm.rank == 1:  # once the others are past the barrier
        for _ in range(comm.size - 1):
            await ready.recv()
        raise ValueError("boom on purpose")
    await ready.send("past the barrier", 1)
    try:
        if comm.rank == 0:
            await comm.all_reduce(torch.ones(1))  # would wait for rank 1 forever
        else:
            # all three told (the save below holds the loop), then the receive's error
            got = await asyncio.gather(comm.recv(torch.ones(1), 1), call(comm), listen(comm),
                                       return_exceptions=True)
            raise got[0] if isinstance(got[0], BaseException) else RuntimeError("no error")
    except asyncomm.PeerFailedError as exc:
        print(f"caught: {exc}", flush=True)
        try:
            time.sleep(float(sys.argv[1]))  # saving a checkpoint (as torch.save: blocking)
        finally:
            print("cleaned up", flush=True)
        raise

asyncomm.run(main)
"""


@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_survivors_are_told_who_failed_and_have_time_to_end(tmp_path: Path,
                                                            backend: str) -> None:
    # Survivors learn which rank failed and what it raised (through the side channel, not
    # the broken connection), and get time to clean up before the job is ended, a blocking
    # save too (its loop held, it cannot answer: under MPI the failing rank waits for it).
    # A survivor that takes longer than the grace period is stopped.
    proc = run_script(SURVIVORS.replace("sys.argv[1]", "3.0"), tmp_path, 3, backend,
                      timeout=180)
    for rank, op in ((0, "all_reduce #2"), (2, "recv #2 peer 1 tag 0")):
        assert (f"[{rank}] caught: rank {rank}: {op}: rank 1 failed (it raised ValueError: "
                "boom on purpose)") in proc.stdout, proc.stdout + proc.stderr
        assert f"[{rank}] cleaned up" in proc.stdout, proc.stdout + proc.stderr
    assert ("[2] call caught: rank 2: call slow.wait on rank 1: rank 1 failed (it raised "
            "ValueError: boom on purpose)") in proc.stdout, proc.stdout + proc.stderr
    assert ("[2] channel caught: rank 2: channel 5 recv from peer 1: rank 1 failed (it raised "
            "ValueError: boom on purpose)") in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "asyncomm run: rank 1 failed first: ValueError: boom on purpose ("), proc.stderr
    proc = run_script(SURVIVORS.replace("sys.argv[1]", "120.0"), tmp_path, 3, backend,
                      timeout=180, env={"ASYNCOMM_GRACE_S": "1"})
    assert proc.returncode != 0 and "cleaned up" not in proc.stdout, proc.stdout


BLAMED = """
import asyncio, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:  # times out: rank 0 never joins
        await comm.all_reduce(torch.ones(1), timeout=1.0)
    try:
        await comm.recv(torch.ones(1), 1, timeout=60.0)
    except asyncomm.PeerFailedError:
        pass  # the consequence, caught; then rank 0 fails on its own, at once
    raise RuntimeError("rank 0 gives up")

asyncomm.run(main)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_launcher_blames_the_rank_that_failed_first(tmp_path: Path, backend: str) -> None:
    # Rank 0 exits first, but rank 1 failed first: the summary says so (by when each
    # failed, not when it exited), in every run.
    for _ in range(2 if backend == "gloo" else 1):
        proc = run_script(BLAMED, tmp_path, 2, backend, timeout=180)
        assert proc.stderr.strip().splitlines()[-1].startswith(
            "asyncomm run: rank 1 failed first: asyncomm.CommTimeoutError"), proc.stderr


KILLED = """
import asyncio, os, signal, asyncomm

async def main(comm):
    ch, ready = comm.channel(3), comm.channel(4)
    if comm.rank == 1:  # killed once the others wait on it in recv only (a barrier it had
        for _ in range(2):  # passed might still be completing on them, and fail there)
            await ready.recv()
        os.kill(os.getpid(), signal.SIGKILL)
    await ready.send("in", 1)
    try:
        await ch.recv(1)
    except asyncomm.PeerFailedError as exc:
        print(f"caught: {exc}", flush=True)
    await asyncio.sleep(2)  # (leaving, rank 0 would tell rank 2 less: "found rank 1 gone")

asyncomm.run(main)
"""


def test_survivors_are_told_of_a_killed_rank(tmp_path: Path) -> None:
    # No probe comes in time (ASYNCOMM_PROBE_S): the launcher tells the survivors how the
    # rank's process ended.
    proc = run_script(KILLED, tmp_path, 3, "gloo", timeout=180,
                      env={"ASYNCOMM_PROBE_S": "100"})
    for rank in (0, 2):
        assert (f"[{rank}] caught: rank {rank}: channel 3 recv from peer 1: rank 1 failed "
                "(its process was killed by SIGKILL)") in proc.stdout, proc.stdout + proc.stderr


KILLED_WHILE_REDUCING = """
import asyncio, os, signal, time, torch, asyncomm

def gone(pid):  # (a process of this host, ended: a zombie until the launcher reaps it)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):  # (reaped before, or as, it is read)
        return True

async def main(comm):
    ch = comm.channel(3)
    await comm.barrier()
    if comm.rank == 1:
        await ch.send(os.getpid(), 0)
        await ch.recv(0)  # rank 0's all-reduce is issued: die before joining it
        os.kill(os.getpid(), signal.SIGKILL)
    peer = (await ch.recv(1)).data
    x = torch.ones(1)
    handle = comm.all_reduce(x)
    await ch.send("issued", 1)
    await asyncio.sleep(0)  # the loop turns: torch's callback of the all-reduce is given
    # The loop is held until rank 1 is dead and gloo's thread has had time to fail the
    # all-reduce: the loop hears of it only once the handle is awaited
    deadline = time.monotonic() + 60
    while not gone(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)
    try:
        await handle
        print(f"all_reduce returned {x.item():g}", flush=True)
    except asyncomm.PeerFailedError as exc:
        print(f"caught: {exc}", flush=True)

asyncomm.run(main)
"""


def test_a_collective_whose_peer_died_fails_when_its_task_sees_it_first(tmp_path: Path) -> None:
    # The awaiting task finds the failed all-reduce before torch's callback is delivered;
    # the failure is held while the communicator learns who died. The callback found the
    # handle taken and succeeded it: the all-reduce returned, unreduced (the five-kill job
    # of test_meshes did so now and then under load; this order does it every time). gloo
    # only: on MPI a killed rank ends the job (test_meshes), and MPI requests have no
    # callback.
    proc = run_script(KILLED_WHILE_REDUCING, tmp_path, 2, "gloo", timeout=180,
                      options=["--keep-going"])
    assert "[0] caught: rank 0: all_reduce #2: rank 1 failed (" in proc.stdout, (
        proc.stdout + proc.stderr)


MISMATCHED = """
import asyncio, torch, asyncomm

async def main(comm):
    t = torch.ones(1000 if comm.rank == 0 else 10)
    try:
        await comm.all_reduce(t, timeout=1.5)
        print("finished", flush=True)
    except asyncomm.CommTimeoutError as exc:
        print(f"timed out: {exc}", flush=True)
    await asyncio.sleep(3)  # (still answering when rank 0 asks)

asyncomm.run(main)
"""


def test_a_timeout_names_the_sizes_the_other_ranks_reduced(tmp_path: Path) -> None:
    # MPI does not check that the ranks' counts agree: rank 1's all_reduce of 10 floats
    # returns, rank 0's of 1000 waits for the rest. Its timeout says what each did.
    proc = run_script(MISMATCHED, tmp_path, 2, "mpi", timeout=180)
    assert ("[0] timed out: rank 0: all_reduce #1 timed out after 1.5 s (this rank's tensor: "
            "float32[1000]). Meanwhile rank 1: nothing in flight (last issued: all_reduce #1 "
            "of float32[10])") in proc.stdout, proc.stdout + proc.stderr


HALTING = """
import contextlib, os, torch, asyncomm

async def main(comm):
    if os.environ["CASE"] == "raw" and comm.rank == 0:  # gloo's own send, beyond 64 KiB
        comm.raw.send([torch.ones(100_000)], 1, 5).wait()
        await comm.barrier(timeout=60)  # (fails once rank 1 has)
    try:
        if os.environ["CASE"] == "raw":
            await comm.recv(torch.empty(100_000), 0, tag=5, timeout=60)
        else:
            await comm.all_reduce(torch.ones(1000 if comm.rank == 0 else 10), timeout=60)
    except asyncomm.MismatchError as exc:
        print(f"mismatch: {exc}", flush=True)
        with contextlib.suppress(asyncomm.MismatchError):  # later ones fail at once
            await comm.barrier(timeout=60)
            print("a later barrier completed", flush=True)
        raise

asyncomm.run(main)
"""


@pytest.mark.parametrize("case", ["all_reduce", "raw"])
def test_sizes_gloo_refuses_on_its_own_thread_fail_the_operation_not_the_process(
        tmp_path: Path, case: str) -> None:
    # gloo checks sizes on its own I/O thread, where its exception has no catcher: C++
    # ended the process (std::terminate, SIGABRT). Now gloo halts there, and the rank's
    # operations fail with MismatchError, saying what the others were doing. Repeated: a
    # thread race at exit (gloo's parked thread) would show as a hang or a signal.
    for _ in range(2):
        start = time.monotonic()
        proc = run_script(HALTING, tmp_path, 3 if case == "all_reduce" else 2, "gloo",
                          timeout=180, env={"CASE": case})
        said = proc.stdout + proc.stderr
        assert time.monotonic() - start < 50, said  # not the 60 s deadline
        assert proc.returncode == 1 and "SIG" not in said, said
        assert "a later barrier completed" not in said, said
        halted = re.findall(r"\[(\d)\] mismatch: rank \1: (all_reduce #1|recv #1 peer 0 tag 5): "
                            r"gloo halted: its I/O thread raised gloo::EnforceNotMet \(.*\): "
                            r"gloo can move nothing more in this process, which will exit with "
                            r"status 1 \(this rank's tensor: float32\[(\d+)\]\)\. Meanwhile ",
                            said)
        assert halted, said
        summary = proc.stderr.strip().splitlines()[-1]
        assert re.match(r"asyncomm run: rank \d failed first: asyncomm.MismatchError: ",
                        summary), said


class Slow(asyncomm.Actor):
    @asyncomm.endpoint
    async def wait(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "late"


async def check_channel_and_actor_waits_say_stalls(comm: Comm, flag: str) -> list[str]:
    # A channel receive and an actor call that wait past ASYNCOMM_STALL_S warn once, with
    # the peer's state; their timeouts say it too.
    said = []
    with warnings_kept(flag, "channel 7 recv") as warned:
        async with fresh(comm, env={"ASYNCOMM_STALL_S": "0.3"}) as sub:
            ch = sub.channel(7)
            if sub.rank == 1:
                sub.serve(Slow(), "slow")
            await sub.barrier()
            if sub.rank == 0:
                assert (await ch.recv(1)).data == "at last"
                Path(flag).unlink()
                assert await sub.actor(1, "slow").wait(1.5) == "late"
                with pytest.raises(CommTimeoutError) as info:
                    await ch.recv(1, timeout=0.5)
                said.append(str(info.value))
                with pytest.raises(CommTimeoutError) as info:
                    await sub.actor(1, "slow").wait(5.0, timeout=1.0)
                said.append(str(info.value))
            elif sub.rank == 1:
                await until_exists(flag)
                await ch.send("at last", 0)
            await sub.barrier()
    return warned + said


def test_channel_and_actor_waits_say_stalls_and_their_peers(world2: World,
                                                          tmp_path: Path) -> None:
    said = world2.run(check_channel_and_actor_waits_say_stalls, str(tmp_path / "warned"),
                      timeout=120)[0]
    warned, errors = said[:-2], said[-2:]  # (in the order each warning was said)
    channel = [w for w in warned if "channel 7 recv" in w]
    assert 1 <= len(channel) <= 2, said  # (the receive that times out may warn before)
    assert re.match(r"asyncomm: rank 0: channel 7 recv from peer 1 has been pending for "
                    r"\d+\.\d s \(ASYNCOMM_STALL_S=0\.3\); it goes on waiting\. Meanwhile "
                    r"rank 1: ", channel[0]), said
    # the call that returns late warns once; the one that times out may warn before
    calls = [w for w in warned if "call slow.wait" in w]  # (a barrier's may come too)
    assert 1 <= len(calls) <= 2, said
    for call in calls:
        assert re.match(r"asyncomm: rank 0: call slow\.wait on rank 1 has been pending for "
                        r"\d+\.\d s .* Meanwhile rank 1: ", call), said
    assert errors[0].startswith("rank 0: channel 7 recv from peer 1 timed out after 0.5 s. "
                                "Meanwhile rank 1: "), said
    assert re.match(r"rank 0: call slow\.wait on rank 1 timed out after 1 s\. Meanwhile rank 1: "
                    r".*; running slow\.wait for rank 0 for \d+\.\d s\.$", errors[1]), said
