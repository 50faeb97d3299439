"""Environment detection (internals, on purpose): who launched this process, and the
launchers asyncomm does not own (torchrun, mpiexec); and how `ASYNCOMM_DEBUG` is read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncomm._core import settings
from asyncomm._core.env import detect
from asyncomm._tools import mpiexec as _mpiexec

ROOT = Path(__file__).resolve().parents[2]


def test_bare_process_is_a_world_of_one() -> None:
    env = detect({})
    assert (env.launcher, env.rank, env.size, env.backend) == ("none", 0, 1, "gloo")
    assert env.hosts_store


def test_torchrun_variables() -> None:
    env = detect({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
                  "MASTER_PORT": "1234", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (env.launcher, env.rank, env.size, env.backend) == ("torchrun", 2, 4, "gloo")
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)
    assert env.store_is_hosted and not env.hosts_store


def test_asyncomm_launcher_variables() -> None:
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "ASYNCOMM_STORE": "client"})
    assert env.launcher == "asyncomm" and not env.hosts_store


@pytest.mark.parametrize("var", ["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"])
def test_mpi_launchers_choose_mpi(var: str) -> None:
    assert detect({var: "0"}).backend == "mpi"


def test_slurm_variables_and_nodelist() -> None:
    env = detect({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77",
                  "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1"})
    assert (env.launcher, env.rank, env.size) == ("slurm", 3, 8)
    assert env.master_addr == "gpu07"
    assert 20000 <= env.master_port < 32000  # below the ephemeral ports
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                   "SLURM_JOB_NODELIST": "node5"}).master_addr == "node5"


def test_backend_override_and_bad_values() -> None:
    assert detect({"PMI_RANK": "0", "ASYNCOMM_BACKEND": "gloo"}).backend == "gloo"
    with pytest.raises(ValueError, match="ASYNCOMM_BACKEND"):
        detect({"ASYNCOMM_BACKEND": "carrier-pigeon"})
    with pytest.raises(ValueError, match="RANK"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        detect({"RANK": "5", "WORLD_SIZE": "2"})


SCRIPT = """
import torch, asyncomm

async def main(comm):
    t = torch.tensor([float(comm.rank + 1)])
    await comm.all_reduce(t)
    print(f"rank {comm.rank}/{comm.size} {comm.backend} {t.item():g}", flush=True)

asyncomm.run(main)
"""


def _run(command: list[str], tmp_path: Path) -> str:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([*command, str(script)], capture_output=True, text=True,
                          timeout=240, env={**env, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_unchanged_under_torchrun(tmp_path: Path) -> None:
    # --standalone: torchrun chooses the port of its own rendezvous, as on one machine
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"], tmp_path)
    assert "rank 0/2 gloo 3" in out and "rank 1/2 gloo 3" in out


def test_unchanged_under_mpiexec(tmp_path: Path) -> None:
    mpiexec = _mpiexec.find()
    if mpiexec is None:
        pytest.skip("mpiexec not installed")
    out = _run([mpiexec, "-n", "2", sys.executable], tmp_path)
    assert "rank 0/2 mpi 3" in out and "rank 1/2 mpi 3" in out


def test_debug_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCOMM_DEBUG", raising=False)
    assert not settings.read().debug
    monkeypatch.setenv("ASYNCOMM_DEBUG", "0")
    assert not settings.read().debug
    monkeypatch.setenv("ASYNCOMM_DEBUG", "1")
    assert settings.read().debug
