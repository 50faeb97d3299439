"""Slurm for real: a private one-node cluster (munged, slurmctld, slurmd), then ``srun -n 4``.

The cluster is this test's own: its own munge socket and key, its own
configuration (``SLURM_CONF``), ports and state directories, so it neither
needs nor disturbs a Slurm already on the machine. Needs root and Debian's
``slurm-wlm``: skipped where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo")
SCRIPT = str(Path(__file__).parent / "multihost_scenarios.py")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(d) is None for d in DAEMONS),
    reason="needs root and slurm-wlm (munge, slurmctld, slurmd, srun)")


def _tasks_running(script: str) -> list[int]:
    """The Python processes running ``script`` (``python script ...``)."""
    tasks = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if proc.name.isdigit() and script.encode() in argv[1:2]:
                tasks.append(int(proc.name))
    return tasks


TICK = os.sysconf("SC_CLK_TCK")  # /proc's clock ticks per second


def _stat(proc: Path) -> list[str]:
    """The fields of ``proc``'s stat after its name: state first (fields 3 on of proc(5))."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()


def _threads(task: int) -> str:
    """Each thread of ``task``, its name and state (R: running): which one spins, where a
    task found still running cannot say (its stack dump is gone once Python finalized)."""
    found = []
    for thread in Path(f"/proc/{task}/task").iterdir():
        with contextlib.suppress(OSError):
            state = _stat(thread)[0]
            found.append(f"{(thread / 'comm').read_text().strip()}:{state}")
    return ", ".join(found)


def _cpu(task: int, stat: list[str]) -> str:
    """What ``task`` had of the CPU: slow on it, or waiting for it (a task found still running
    may be either: its schedstat tells which)."""
    ran, waited, _ = (int(n) / 1e9 for n in Path(f"/proc/{task}/schedstat").read_text().split())
    return (f"{(int(stat[11]) + int(stat[12])) / TICK:.1f} s CPU, {ran:.1f} s on a core, "
            f"{waited:.1f} s waiting for one, {stat[7]} minor / {stat[9]} major faults")


def _busiest() -> str:
    """The processes that used the most CPU in the last second (a starved task's rivals)."""
    def times() -> dict[str, int]:
        found = {}
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if not proc.name.isdigit():
                    continue
                stat = _stat(proc)
                found[f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}"] = (
                    int(stat[11]) + int(stat[12]))
        return found

    before = times()
    time.sleep(1)
    used = sorted(((t - before.get(k, t), k) for k, t in times().items()), reverse=True)
    return "; ".join(f"{k}: {t * 100 // TICK}%" for t, k in used[:8] if t) + (
        f" (load {Path('/proc/loadavg').read_text().strip()})")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, outside the kernel's ephemeral range.

    A port found by binding to 0 is an ephemeral one: any process binding to 0 (a gloo pair,
    a store, in a test running beside this one) may take it before the daemons bind it, and
    slurmctld then exits ("Address already in use"). A port outside that range is taken
    only by a process that names it.
    """
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    outside = [port for port in range(10_000, 65_536) if not low <= port <= high]
    ports: list[int] = []
    for port in random.Random().sample(outside, min(500, len(outside))):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports outside {low}-{high}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Start the cluster; yield the environment that reaches it."""
    home = tmp_path_factory.mktemp("slurm")
    for folder in ("state", "spool", "log"):
        (home / folder).mkdir()
    key, sock = home / "munge.key", home / "munge.sock"
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True)
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={home / 'munged.pid'}", f"--seed-file={home / 'munged.seed'}",
                    f"--log-file={home / 'log' / 'munged.log'}"], check=True, capture_output=True)
    node = socket.gethostname()
    conf = home / "slurm.conf"
    controller_port, node_port = _free_ports(2)
    conf.write_text(f"""\
ClusterName=asyncommtest
SlurmctldHost={node}
SlurmctldPort={controller_port}
SlurmdPort={node_port}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmctldPidFile={home / 'slurmctld.pid'}
SlurmdPidFile={home / 'slurmd.pid'}
SlurmdSpoolDir={home / 'spool'}
StateSaveLocation={home / 'state'}
SlurmctldLogFile={home / 'log' / 'slurmctld.log'}
SlurmdLogFile={home / 'log' / 'slurmd.log'}
ReturnToService=2
SelectType=select/cons_tres
NodeName={node} CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "PMI_", "GLOO_", "ASYNCOMM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["SLURM_CONF"] = str(conf)
    daemons = [subprocess.Popen([daemon, "-D"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for daemon in ("slurmctld", "slurmd")]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the node registers, idle
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                   text=True).stdout.strip()
            if state.startswith("idle"):
                break
            time.sleep(0.3)
        else:
            logs = "".join(p.read_text()[-1500:] for p in (home / "log").glob("slurm*.log"))
            pytest.fail(f"the test cluster did not come up (node: {state!r}): {logs}")
        yield env
    finally:
        for daemon in daemons:
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        subprocess.run(["munged", f"--socket={sock}", "--stop"], capture_output=True)


@pytest.mark.timeout(420)  # four tasks start torch each: slow beside CPU-bound processes
def test_srun_runs_the_scenarios_on_four_tasks(slurm: dict[str, str]) -> None:
    # one node: the scenarios' check for two hosts is for the several-hosts tests
    # a task that fails ends the step (the others would wait for it); the step's own
    # limit comes before the test's, so that a hang shows what the tasks said
    srun = subprocess.Popen(["srun", "-n", "4", "--overcommit", "--kill-on-bad-exit=1",
                             sys.executable, SCRIPT, "gloo", "--one-host"], env=slurm,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = srun.communicate(timeout=360)
    except subprocess.TimeoutExpired:  # each task says where it is stuck, then the step ends
        states, busy = [], _busiest()
        for task in _tasks_running(SCRIPT):
            with contextlib.suppress(OSError):
                stat = _stat(Path(f"/proc/{task}"))
                age = (float(Path("/proc/uptime").read_text().split()[0])
                       - int(stat[19]) / TICK)  # (started late?)
                states.append(f"{task}: {stat[0]} in {Path(f'/proc/{task}/wchan').read_text()}, "
                              f"started {age:.0f} s ago (threads {_threads(task)}; "
                              f"{_cpu(task, stat)})")
            os.kill(task, signal.SIGUSR1)
        time.sleep(5)
        srun.terminate()
        try:
            out, err = srun.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            srun.kill()
            out, err = srun.communicate()
        pytest.fail(f"srun did not end within 360 s (tasks {states}; busiest: {busy}): "
                    f"{out[-3000:]} {err[-12000:]}")
    done = subprocess.CompletedProcess(srun.args, srun.returncode, out, err)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in range(4):
        assert f"scenarios ok {rank} " in done.stdout, done.stdout + done.stderr[-2000:]


NO_KILL = """
import os, signal, torch, asyncomm

async def main(comm):
    await comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await comm.all_reduce(torch.ones(1), timeout=120)
    except asyncomm.PeerFailedError as exc:
        print(f"told: {exc}", flush=True)
    small = await comm.shrink(timeout=60)
    t = torch.ones(1)
    await small.all_reduce(t)
    print(f"went on: {comm.rank} as {small.rank} of {small.size}, sum {t.item()}", flush=True)
    await small.close()

asyncomm.run(main)
"""


@pytest.mark.timeout(420)
def test_a_step_that_keeps_its_tasks_survives_a_killed_one(slurm: dict[str, str],
                                                          tmp_path: Path) -> None:
    # srun ends a step's other tasks when one fails only with --kill-on-bad-exit (or the
    # cluster's KillOnBadExit); without it the survivors are told (their probes: no
    # launcher of asyncomm's here), shrink and go on. The step still says a task failed.
    script = tmp_path / "no_kill.py"
    script.write_text(NO_KILL)
    done = subprocess.run(["srun", "-n", "3", "--overcommit", "--kill-on-bad-exit=0",
                           "--no-kill", sys.executable, str(script)], env=slurm,
                          capture_output=True, text=True, timeout=360)
    said = done.stdout + done.stderr[-3000:]
    assert done.returncode != 0, said
    for rank, small in ((0, 0), (2, 1)):
        assert f"told: rank {rank}: all_reduce #2: rank 1 failed (" in done.stdout, said
        assert f"went on: {rank} as {small} of 2, sum 2.0" in done.stdout, said
