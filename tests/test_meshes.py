"""Actor meshes and surviving a dead rank, on real gloo and MPI worlds."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World, fresh, run_script

HOLDS: dict[int, asyncio.Event] = {}  # this rank's member's held calls, by caller


class Gate(asyncomm.Actor):
    """Beside a member, sees and ends its held calls: a member runs one call at a time."""

    @asyncomm.endpoint
    def holding(self, caller: int) -> bool:
        return caller in HOLDS

    @asyncomm.endpoint
    def release(self, caller: int) -> None:
        HOLDS.setdefault(caller, asyncio.Event()).set()


class Worker(asyncomm.Actor):
    """Built with its rank's own arguments; remembers what it was told."""

    def __init__(self, rank: int, scale: int = 10) -> None:
        self.rank, self.scale, self.told = rank, scale, []

    @asyncomm.endpoint
    async def hold(self, caller: int) -> None:
        await HOLDS.setdefault(caller, asyncio.Event()).wait()

    @asyncomm.endpoint
    def step(self, x: int) -> int:
        return x * self.scale + self.rank

    @asyncomm.endpoint
    def remember(self, x: int) -> None:
        self.told.append(x)

    @asyncomm.endpoint
    def recall(self) -> list[int]:
        return self.told

    @asyncomm.endpoint
    def fail(self) -> None:
        raise ValueError(f"member {self.rank} fails")


async def check_a_mesh_is_called_as_a_whole(comm: Comm) -> dict[str, object]:
    seen: dict[str, object] = {}
    async with fresh(comm) as sub:
        mesh = await sub.spawn(Worker, sub.rank, name="workers", scale=100)
        seen["ranks"] = mesh.ranks
        seen["call"] = await mesh.step.call(1)
        seen["one"] = await mesh.slice([2]).step.call_one(2)
        with pytest.raises(ValueError, match="has 3 members, not 1"):
            await mesh.step.call_one(2)
        seen["stream"] = sorted([pair async for pair in mesh.step.stream(3)])
        seen["item"] = await mesh[1].step(4)
        with pytest.raises(ValueError, match="no member on rank 7"):
            mesh[7]
        with pytest.raises(ValueError, match=r"ranks \[5\] are not members"):
            mesh.slice([0, 5])
        mesh.remember.broadcast(sub.rank)  # in each member, before this rank's next call
        seen["told"] = all(sub.rank in told for told in await mesh.recall.call())
        with pytest.raises(asyncomm.RemoteError, match=r"rank \d: workers.fail raised "
                                                       r"ValueError: member \d fails"):
            await mesh.fail.call()
        # choose: the member with the fewest of this rank's calls in flight. ``call`` raised at
        # the first error: the other members' errors may still be on their way, calls in flight
        # (seen under load: a tie that chose the member held below). A call to every member
        # comes after them on each member's channel.
        await mesh.recall.call()
        HOLDS.clear()  # (a world's ranks run many checks)
        gates = await sub.spawn(Gate, name="gates")
        held = asyncio.ensure_future(mesh[0].hold(sub.rank))  # in flight until released
        while not await gates[0].holding(sub.rank):
            await asyncio.sleep(0.01)
        seen["chose"] = (await mesh.slice([0, 1]).step.choose(6)) % 100
        await gates[0].release(sub.rank)
        await held
        part = await sub.spawn(Worker, sub.rank, name="some", ranks=[0, 2])
        seen["part"] = (part.ranks, await part.step.call(7))
        seen["alive"] = part.alive().ranks
        await sub.barrier()
    return seen


def test_a_mesh_is_called_as_a_whole(world: World) -> None:
    for seen in world.run(check_a_mesh_is_called_as_a_whole):
        assert seen == {"ranks": [0, 1, 2], "call": [100, 101, 102], "one": 202,
                        "stream": [(0, 300), (1, 301), (2, 302)], "item": 401,
                        "told": True, "chose": 1, "part": ([0, 2], [70, 72]),
                        "alive": [0, 2]}, seen


async def check_spawn_refuses_bad_arguments(comm: Comm) -> list[str]:
    said = []
    for kwargs in ({"name": ""}, {"name": "x", "ranks": [0, 0]}, {"name": "x", "ranks": [9]}):
        try:
            await comm.spawn(Worker, comm.rank, **kwargs)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            said.append(str(exc))
    return said


def test_spawn_refuses_bad_arguments_before_anything_is_sent(world2: World) -> None:
    for rank, said in enumerate(world2.run(check_spawn_refuses_bad_arguments)):
        assert len(said) == 3 and all(s.startswith(f"rank {rank}: spawn: ") for s in said), said


async def check_shrink_on_mpi(comm: Comm) -> str:
    try:
        await comm.shrink()
    except NotImplementedError as exc:
        return str(exc)
    return "shrank"


def test_mpi_says_it_cannot_shrink(world2: World) -> None:
    if world2.backend != "mpi":
        pytest.skip("gloo shrinks (see the survival test)")
    for rank, said in enumerate(world2.run(check_shrink_on_mpi)):
        assert said.startswith(f"rank {rank}: shrink: this MPI (MPICH") and "ULFM" in said, said


async def check_shrink_names_who_never_came(comm: Comm) -> str:
    async with fresh(comm) as sub:
        if sub.rank == 2:
            await asyncio.sleep(1.5)
            return "stayed out"
        try:
            await sub.shrink(timeout=1.0)
        except asyncomm.CommTimeoutError as exc:
            return str(exc)
        return "shrank"


def test_a_shrink_that_a_live_rank_misses_times_out_naming_it(world: World) -> None:
    if world.backend == "mpi":
        pytest.skip("MPI cannot shrink")
    said = world.run(check_shrink_names_who_never_came)
    for rank in (0, 1):
        assert said[rank] == (f"rank {rank}: shrink timed out after 1 s: ranks [2] neither "
                              "joined it nor are known to have failed"), said


SURVIVE = """
import asyncio, os, signal, torch, asyncomm
from asyncomm import pipeline

class Buffer(asyncomm.Actor):
    def __init__(self, rank):
        self.rank = rank
    @asyncomm.endpoint
    async def sample(self, pause):
        await asyncio.sleep(pause)
        return self.rank

async def main(comm):
    mesh = await comm.spawn(Buffer, comm.rank, name="buffers")
    handled = []
    mesh.on_failure(lambda rank, cause: handled.append((rank, str(cause))))
    await comm.barrier()
    if comm.rank == 1:
        await asyncio.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await mesh.sample.call(30.0, timeout=120)  # rank 1 dies with this in flight
    except asyncomm.PeerFailedError as exc:
        print(f"in flight: {exc}", flush=True)  # (not at its 120 s deadline)
    try:
        await mesh.sample.call(0.0)
    except asyncomm.PeerFailedError as exc:
        print(f"later: {exc}", flush=True)
    print(f"failed {sorted(comm.failed)} alive {mesh.alive().ranks} handled {handled}",
          flush=True)
    small = await comm.shrink()
    t = torch.full((4,), float(comm.rank))
    await small.all_reduce(t)
    ch = small.channel(5)
    await ch.send(f"hello from {small.rank}", 1 - small.rank)
    got = (await ch.recv(1 - small.rank)).data
    again = await small.spawn(Buffer, comm.rank, name="buffers")
    print(f"small {small.rank}/{small.size} sum {t[0].item()} {got} "
          f"{await again.sample.call(0.0)}", flush=True)
    model = torch.nn.Linear(4, 2)  # GradSync over the survivors: each its own data
    sync = asyncomm.GradSync(model, small)
    model(torch.full((3, 4), float(small.rank + 1))).sum().backward()
    await sync.wait()
    torch.manual_seed(0)  # a pipeline over them: its loss is one process's
    whole = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x, y = torch.linspace(-1, 1, 32).reshape(8, 4), torch.zeros(8, 1)
    alone = torch.nn.functional.mse_loss(whole(x), y).item()
    schedule = pipeline.get("1f1b", small.size, 4)
    pipe = pipeline.Pipeline(small, schedule, pipeline.split(whole, schedule.n_stages),
                             torch.nn.functional.mse_loss)
    loss = await pipe.step(x if pipe.first else None, y if pipe.last_stage else None)
    await pipe.close()
    print(f"small {small.rank}: grad {model.weight.grad[0, 0].item()} pipeline "
          f"{'same' if loss is None or abs(float(loss) - alone) < 1e-6 else (loss, alone)}",
          flush=True)
    await small.barrier()
    await small.close()

asyncomm.run(main)
"""


def test_survivors_of_a_killed_member_shrink_and_go_on(tmp_path: Path) -> None:
    # Rank 1 is killed with a call to it in flight: the survivors are told (by the launcher,
    # or their probes find its connections closed, whichever comes first), fail what needs
    # it, agree on who is left and go on over the two of them.
    proc = run_script(SURVIVE, tmp_path, 3, "gloo", timeout=180, options=["--keep-going"])
    out = proc.stdout
    assert proc.returncode != 0, out + proc.stderr  # the job still says a rank failed
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "asyncomm run: rank 1 failed first (killed by SIGKILL); the others went on"), proc.stderr
    for rank in (0, 2):
        assert (f"[{rank}] in flight: rank {rank}: call buffers.sample on rank 1: rank 1 "
                "failed (") in out, out + proc.stderr
        assert f"[{rank}] later: rank {rank}: call buffers.sample on rank 1: rank 1" in out, out
        assert f"[{rank}] failed [1] alive [0, 2] handled [(1, " in out, out
    assert "[0] small 0/2 sum 2.0 hello from 1 [0, 2]" in out, out + proc.stderr
    assert "[2] small 1/2 sum 2.0 hello from 0 [0, 2]" in out, out + proc.stderr
    for rank, small in ((0, 0), (2, 1)):  # (3 x 1 and 3 x 2, averaged)
        assert f"[{rank}] small {small}: grad 4.5 pipeline same" in out, out + proc.stderr


def test_keep_going_is_refused_on_mpi(tmp_path: Path) -> None:
    proc = run_script("print('ran')", tmp_path, 2, "mpi", options=["--keep-going"])
    assert proc.returncode == 2 and "ran" not in proc.stdout, proc.stdout + proc.stderr
    assert "--keep-going needs the gloo backend" in proc.stderr, proc.stderr


HANDLER_RAISES = """
import asyncio, os, signal, asyncomm

class Buffer(asyncomm.Actor):
    pass

def give_up(rank, cause):
    raise RuntimeError(f"lost rank {rank}, giving up")

async def main(comm):
    mesh = await comm.spawn(Buffer, name="buffers")
    mesh.on_failure(give_up)
    try:  # (the handler's error may reach a survivor still in the barrier, on a slow machine)
        await comm.barrier()
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(60)
    finally:
        print("cleaned up", flush=True)

asyncomm.run(main)
"""


def test_a_failure_handler_that_raises_ends_the_program_with_its_error(tmp_path: Path) -> None:
    proc = run_script(HANDLER_RAISES, tmp_path, 3, "gloo", timeout=180, options=["--keep-going"])
    for rank in (0, 2):  # each survivor's main ends there, with the handler's error: for
        # rank 1, or for the other survivor, which gave up first, where that was heard first
        assert f"[{rank}] cleaned up" in proc.stdout, proc.stdout + proc.stderr
        assert re.search(rf"^\[{rank}\] RuntimeError: lost rank (1|{2 - rank}), giving up$",
                         proc.stderr, re.M), proc.stderr
    assert proc.returncode != 0, proc.stderr


KILLED_IN_TURN = """
import asyncio, os, signal, torch, asyncomm

class Member(asyncomm.Actor):
    def __init__(self, rank):
        self.rank = rank
    @asyncomm.endpoint
    def who(self):
        return self.rank

async def main(comm):
    world = comm.rank  # this rank's number in the first world, kept across shrinks
    for kill in range(5):  # each turn the last rank is killed, the rest shrink and go on
        mesh = await comm.spawn(Member, world, name=f"members{kill}")
        try:
            await comm.barrier()
            if comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            await comm.all_reduce(torch.ones(1), timeout=120)  # the killed rank never joins
        except asyncomm.PeerFailedError as exc:  # (or the barrier, where the killed rank's
            print(f"turn {kill}: told {exc}", flush=True)  # part came late on a loaded machine)
        try:
            await mesh.who.call(timeout=120)
        except asyncomm.PeerFailedError:
            pass
        comm = await comm.shrink()
        t = torch.ones(1)
        await comm.all_reduce(t)
        print(f"turn {kill}: rank {world} of {comm.size} left, sum {t.item():g}, "
              f"members {await mesh.alive().who.call()}", flush=True)
    await comm.close()

asyncomm.run(main)
"""


def test_ranks_killed_in_turn_leave_the_others_going(tmp_path: Path) -> None:
    # Five kills in one job: each turn the survivors are told, fail what needed the dead
    # rank, shrink, and reduce over the ranks left.
    proc = run_script(KILLED_IN_TURN, tmp_path, 6, "gloo", timeout=120,
                      options=["--keep-going"])
    for kill in range(5):
        left = 5 - kill
        for rank in range(left):
            assert (f"[{rank}] turn {kill}: rank {rank} of {left} left, sum {left}, members "
                    f"{list(range(left))}") in proc.stdout, proc.stdout + proc.stderr
            # told who failed: how, from the launcher's notice, or (where gloo's own error
            # came first and the notice did not follow within 2 s: a loaded machine) that
            # its connection closed
            told = re.search(rf"^\[{rank}\] turn {kill}: told rank {rank}: .*: rank {left} "
                             r"failed \((its process was killed by SIGKILL|Connection closed "
                             r"by peer .*)\)$", proc.stdout, re.M)
            assert told is not None, proc.stdout + proc.stderr
    assert proc.returncode != 0, proc.stderr


FAILS_DURING_SHRINK = """
import asyncio, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        await asyncio.sleep(1.0)  # the others are waiting in the shrink by then
        raise RuntimeError("rank 1 gives up")
    small = await comm.shrink(timeout=60)
    t = torch.ones(1)
    await small.all_reduce(t)
    print(f"shrunk to {small.size}: sum {t.item():g}", flush=True)
    await small.close()

asyncomm.run(main)
"""


def test_a_rank_that_fails_while_the_others_shrink_is_left_out(tmp_path: Path) -> None:
    # The survivors learn of rank 1's failure after they wrote what they knew: they write
    # again, and agree without it (they waited for it to their deadline before).
    proc = run_script(FAILS_DURING_SHRINK, tmp_path, 3, "gloo", timeout=120,
                      options=["--keep-going"])
    for rank in (0, 2):
        assert f"[{rank}] shrunk to 2: sum 2" in proc.stdout, proc.stdout + proc.stderr
    assert "[1] RuntimeError: rank 1 gives up" in proc.stderr, proc.stderr


DIES_STREAMING = """
import asyncio, os, signal, asyncomm

async def main(comm):
    ch = comm.channel(7)
    await comm.barrier()
    if comm.rank >= 2:  # each streams to ranks 0 and 1, and is killed mid-stream
        asyncio.get_running_loop().call_later(0.1 * comm.rank, os.kill, os.getpid(),
                                              signal.SIGKILL)
        while True:
            await asyncio.gather(ch.send(b"x" * 64, 0), ch.send(b"x" * 64, 1))
    for src in range(2, comm.size):
        try:
            while True:
                await ch.recv(src, timeout=60)
        except asyncomm.PeerFailedError:
            pass
    other = 1 - comm.rank
    await ch.send(f"still here, {comm.rank}", other)
    print(f"heard {(await ch.recv(other, timeout=20)).data}", flush=True)
    # A process that exits resets its connections, and what its peer had not yet read goes
    # with them: neither leaves before the other has said it heard.
    try:
        await ch.send("heard", other)
        await ch.recv(other, timeout=20)
    except asyncomm.PeerFailedError:
        pass  # (the other heard, then left)
    os._exit(0)  # (closing waits out its linger for a deaf peer's drain: a known gap)

asyncomm.run(main)
"""


def test_peers_dying_mid_stream_leave_a_rank_hearing_or_told_why_not(tmp_path: Path) -> None:
    # Three ranks die while streaming to ranks 0 and 1. A receive a dying peer's message was
    # read into fails: the rank goes on hearing the others. A message it had announced
    # leaves gloo refusing the rank's receives: the rank is told so, at once. Before, the
    # rank heard no one again, silently, and its receives timed out.
    proc = run_script(DIES_STREAMING, tmp_path, 5, "gloo", timeout=180, options=["--keep-going"])
    def deaf(rank: int) -> bool:
        return (f"[{rank}] asyncomm: rank {rank} stopped: asyncomm.PeerFailedError: rank {rank}: "
                f"channel 7: stream from rank {1 - rank} broken: rank {rank} can hear no one on "
                "this communicator any more") in proc.stderr

    for rank in (0, 1):
        heard = f"[{rank}] heard still here, {1 - rank}" in proc.stdout
        # (or its partner went deaf and ended: then it is told so, naming the partner)
        told = re.search(rf"^\[{rank}\] asyncomm: rank {rank} stopped: asyncomm.PeerFailedError: "
                         rf"rank {rank}: channel 7 .*: rank {1 - rank} failed", proc.stderr, re.M)
        assert heard or deaf(rank) or (deaf(1 - rank) and told), proc.stdout + proc.stderr
    assert "CommTimeoutError" not in proc.stderr, proc.stderr


DIES_WHILE_OTHERS_CLOSE = """
import asyncio, os, signal, time, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 2:  # killed while ranks 0 and 1 wait for its goodbye
        await asyncio.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    await comm.close()
    print(f"rank {comm.rank} closed in {time.monotonic() - start:.0f} s", flush=True)

asyncomm.run(main)
"""


def test_a_rank_killed_while_the_others_close_lets_them_go(tmp_path: Path) -> None:
    # Closing waits for every peer's goodbye and for the rank above to drain this one
    # (docs: closing). Rank 2 dies without its goodbye: rank 0 learns it will not come
    # (rank 1 says it for the dead rank), and rank 1, which rank 2 was to drain, leaves
    # its listener parked. Before, both waited out the close's 30 s linger.
    proc = run_script(DIES_WHILE_OTHERS_CLOSE, tmp_path, 3, "gloo", timeout=180,
                      options=["--keep-going"])
    for rank in (0, 1):
        closed = re.search(rf"^\[{rank}\] rank {rank} closed in (\d+) s$", proc.stdout, re.M)
        assert closed is not None and int(closed[1]) < 20, proc.stdout + proc.stderr


KILLED_ON_MPI = """
import asyncio, os, signal, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    await comm.all_reduce(torch.ones(1), timeout=120)

asyncomm.run(main)
"""


@pytest.mark.timeout(900)  # five MPI jobs, each starting torch: slow on a loaded machine
def test_a_killed_mpi_rank_ends_the_job_and_is_named_every_time(tmp_path: Path) -> None:
    # MPI cannot go on without a rank (docs/failures.md): the job ends at once, never hangs,
    # and the launcher names the rank, each of five times (issue: five kills per backend),
    # and it alone (mpiexec kills the others with the same signal).
    for _ in range(5):
        proc = run_script(KILLED_ON_MPI, tmp_path, 2, "mpi", timeout=120)
        assert proc.returncode != 0, proc.stdout + proc.stderr
        assert re.fullmatch(r"asyncomm run: rank 1 killed by SIGKILL \(mpiexec [^;]*\)",
                            proc.stderr.strip().splitlines()[-1]), proc.stderr
