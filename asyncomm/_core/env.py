"""Find out who started this process: ``asyncomm run``, torchrun, an MPI launcher, Slurm, or nobody.

Note on environment variables
-----------------------------
``asyncomm run`` sets the same variables torchrun does (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus ``ASYNCOMM_STORE=client``, which says that the launcher
itself hosts the rendezvous store (bound to loopback), so rank 0 must not start a second one.
torchrun's agent store is announced by ``TORCHELASTIC_USE_AGENT_STORE=True`` and treated the same
way. MPI launchers are recognised by the rank variables of MPICH (Hydra/PMI), Open MPI and PMIx;
their processes default to the MPI backend.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from asyncomm._core import settings

MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MPI_LOCALRANKID")


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in its world, as the launcher described it."""

    launcher: str  # "asyncomm", "torchrun", "mpi", "slurm" or "none"
    rank: int
    size: int
    master_addr: str
    master_port: int
    store_is_hosted: bool  # a store server already exists: connect as a client
    backend: str  # the automatic choice, after ASYNCOMM_BACKEND

    @property
    def hosts_store(self) -> bool:
        """Return whether this process must start the rendezvous store server."""
        return self.rank == 0 and not self.store_is_hosted


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Describe this process's launch from its environment variables."""
    env = os.environ if environ is None else environ
    chosen = settings.read(env)
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "MASTER_PORT", 29500)
    hosted = chosen.store == "client" or (
        env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    )

    if any(name in env for name in MPI_RANK_VARS):
        launcher, rank, size = "mpi", -1, -1  # MPI itself knows; see the MPI backend
    elif "RANK" in env and "WORLD_SIZE" in env:
        launcher = "asyncomm" if chosen.store == "client" else "torchrun"
        rank, size = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher = "slurm"
        rank, size = _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1)
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env) or addr
        if "MASTER_PORT" not in env:  # one per job, below Linux's ephemeral ports (32768 on),
            # which srun, slurmd and every connection take: a rank's store cannot collide
            port = 20000 + zlib.crc32(env.get("SLURM_JOB_ID", "0").encode()) % 12000
    else:
        launcher, rank, size = "none", 0, 1

    if launcher != "mpi" and not 0 <= rank < size:
        raise ValueError(f"launcher {launcher!r} gave rank {rank} outside a world of {size}")
    auto = "mpi" if launcher == "mpi" else "gloo"
    return LaunchEnv(launcher, rank, size, addr, port, hosted, chosen.backend or auto)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first_slurm_host(env: Mapping[str, str]) -> str | None:
    """Return the first host of a Slurm node list such as ``node[03-05,7],gpu1``."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return None
    prefix, ranges = match.groups()
    return prefix if ranges is None else prefix + re.split("[,-]", ranges)[0]
