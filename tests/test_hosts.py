"""Several hosts: two network-namespace hosts on one switch, real launchers on each.

torchrun on each host (no environment variables beyond torchrun's own), mpiexec
across both through Hydra's ssh launcher, a host that dies mid-run and one
that cannot connect at start-up, and ``asyncomm run --hosts`` with a shaped
link. Needs root, iproute2 and torchrun: skipped where they are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncomm.testing import find_mpiexec, mpiexec_flavour, network, run_command

HERE = Path(__file__).parent
SCENARIOS = str(HERE / "multihost_scenarios.py")
DYING = str(HERE / "multihost_dying.py")
# A run that takes longer has hung: four ranks start torch each, beside the other test
# worker's ranks and, in a loaded run, CPU-bound processes.
LIMIT_S = 240

pytestmark = [pytest.mark.skipif(
    network.missing() is not None or shutil.which("torchrun") is None,
    reason=network.missing() or "torchrun not on PATH"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def net() -> Iterator[network.Network]:
    with network.Network(2) as made:
        yield made


_ports = iter(range(29400, 29500))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GLOO_", "MASTER_", "ASYNCOMM_", "PMI_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**env, **extra}


def _bytes_sent(net: network.Network, host: int) -> int:
    """The bytes host ``host`` has sent on its link (to check traffic crossed it)."""
    path = f"/sys/class/net/{network.INTERFACE}/statistics/tx_bytes"
    done = subprocess.run(["ip", "netns", "exec", net.namespaces[host], "cat", path],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _torchrun(net: network.Network, script: str, port: int, host: int,
              env: dict[str, str], per_host: int = 2) -> subprocess.Popen[str]:
    cmd = ["torchrun", "--nnodes", "2", "--nproc-per-node", str(per_host), "--node-rank", str(host),
           "--master-addr", net.addresses[0], "--master-port", str(port), script]
    return net.run(host, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    return [(p.wait(LIMIT_S), p.stdout.read() if p.stdout else "") for p in procs]


def test_torchrun_on_two_hosts_runs_every_scenario(net: network.Network) -> None:
    sent = [_bytes_sent(net, h) for h in range(2)]
    port = next(_ports)
    procs = [_torchrun(net, SCENARIOS, port, h, _env()) for h in range(2)]
    results = _finish(procs)
    for code, out in results:
        assert code == 0, out[-3000:]
    said = "".join(out for _, out in results)
    for rank in range(4):
        assert f"scenarios ok {rank} host{rank // 2 + 1}" in said, said[-3000:]
    for host in range(2):  # the 4 MiB each way went over the link, not loopback
        assert _bytes_sent(net, host) - sent[host] > 4 << 20


def test_mpiexec_with_a_host_list_runs_every_scenario(net: network.Network,
                                                      tmp_path: Path) -> None:
    program = find_mpiexec()
    if program is None:
        pytest.skip("mpiexec not installed")
    if mpiexec_flavour(program) != "hydra":
        pytest.skip("the host list and ssh stand-in are given in Hydra's (MPICH's) options")
    sent = [_bytes_sent(net, h) for h in range(2)]
    ssh = net.ssh_stand_in(tmp_path)
    cmd = [program, "-launcher", "ssh", "-launcher-exec", str(ssh),
           "-hosts", ",".join(net.addresses), "-ppn", "2", "-n", "4", "-iface", network.INTERFACE,
           sys.executable, SCENARIOS]
    done = subprocess.run(net.command(0, cmd), env=_env(**network.MPI_OVER_THE_LINK),
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in range(4):
        assert f"scenarios ok {rank} host{rank // 2 + 1}" in done.stdout, done.stdout
    for host in range(2):  # over the link, not shared memory (see network's note on MPI)
        assert _bytes_sent(net, host) - sent[host] > 4 << 20


def test_a_dead_host_ends_the_other_hosts_ranks_within_seconds(net: network.Network,
                                                                tmp_path: Path) -> None:
    port = next(_ports)
    env = _env(READY_DIR=str(tmp_path))
    procs = [_torchrun(net, DYING, port, h, env) for h in range(2)]
    deadline = time.monotonic() + LIMIT_S / 2
    # host 2's ranks are past the all-reduce, host 1's about to wait for them
    while len(list(tmp_path.glob("ready-*")) + list(tmp_path.glob("waiting-*"))) < 4:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for proc in procs:
                proc.kill()
            said = [proc.communicate()[0][-2000:] for proc in procs]
            pytest.fail(f"the ranks never got ready: host 1 said {said[0]!r}; "
                        f"host 2 said {said[1]!r}")
        time.sleep(0.1)
    for pid in subprocess.run(["ip", "netns", "pids", net.namespaces[1]], capture_output=True,
                              text=True, check=True).stdout.split():
        os.kill(int(pid), 9)  # the host goes down: every process on it
    code = procs[0].wait(LIMIT_S)
    out = procs[0].stdout.read() if procs[0].stdout else ""
    procs[1].wait(LIMIT_S)
    assert code != 0, out[-3000:]
    stops = re.findall(r"rank (\d) stopped after [\d.]+ s: (.*)", out)
    assert sorted(rank for rank, _ in stops) == ["0", "1"], out[-3000:]
    for _, why in stops:  # the failed ranks are named: found gone, not waited for to a deadline
        assert re.search(r"rank 2\b|ranks 2, 3", why) and "timed out after" not in why, why


def test_a_host_that_cannot_connect_ends_both_hosts_fast(net: network.Network) -> None:
    port = next(_ports)
    # Both hosts keep torch's default interface: every rank advertises a loopback address
    # (one host alone doing so is not enough to fail: gloo connects pairs either way).
    # A rank a host is enough (starting ranks is most of the time).
    procs = [_torchrun(net, SCENARIOS, port, h, _env(ASYNCOMM_GLOO_IFNAME="0"), per_host=1)
             for h in range(2)]
    results = _finish(procs)
    assert all(code != 0 for code, _ in results), [out[-2000:] for _, out in results]
    said = "".join(out for _, out in results)
    assert "a loopback address" in said and "GLOO_SOCKET_IFNAME" in said, said[-3000:]
    # The waiting ranks were told, not left to the init timeout (whose error says "did not
    # join within"), however long a loaded machine takes to start them.
    assert "failed to join" in said and "did not join within" not in said, said[-3000:]


def test_asyncomm_run_on_emulated_hosts_with_a_shaped_link(tmp_path: Path) -> None:
    script = tmp_path / "shaped.py"
    script.write_text(
        "import asyncomm, socket, subprocess, torch\n"
        "async def main(comm):\n"
        "    t = torch.ones(1 << 16)\n"
        "    await comm.all_reduce(t)\n"
        "    assert t[0].item() == comm.size\n"
        "    qdisc = subprocess.run(['tc', 'qdisc', 'show', 'dev', 'eth0'],\n"
        "                           capture_output=True, text=True).stdout\n"
        "    print('shaped', comm.rank, socket.gethostname(), qdisc.split()[1], flush=True)\n"
        "asyncomm.run(main)\n")
    done = run_command([sys.executable, "-m", "asyncomm", "run", "--hosts", "2", "-n", "2",
                        "--rate", "200mbit", str(script)], LIMIT_S, env=_env())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "shaped 0 host1 tbf" in done.stdout and "shaped 1 host2 tbf" in done.stdout, \
        done.stdout
