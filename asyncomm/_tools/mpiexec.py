"""Which ``mpiexec`` runs the ranks, the options it needs, and the words it says.

``asyncomm run --backend mpi`` and the test worlds start MPI ranks through whatever
``mpiexec`` is found: MPICH's (Hydra), Open MPI's or Intel's, each with its own options and
its own way of saying that a rank failed, which the launcher reads (``launch._pump``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# MPICH's word when a rank calls MPI_Abort: the summary says it instead.
MPI_ABORT = re.compile(rb"^Abort\((\d+)\) on node \d+ \(rank (\d+) in comm \d+\): "
                       rb"application called MPI_Abort")
# "[3] text" from MPICH's -prepend-rank, "[1,3]<stderr>: text" from Open MPI's --tag-output.
OPEN_MPI_LABEL = re.compile(rb"^\[\d+,(\d+)\]<std\w+>: ?")  # rewritten as MPICH's first
# Hydra's -print-all-exitcodes: "[mpiexec@host] Exit codes: [host] 0,1280,0", wait statuses
# in rank order (host after host).
EXIT_CODES = re.compile(rb"^\[mpiexec@[^\]]*\] Exit codes: (.*)$")
MORE_EXIT_CODES = re.compile(rb"^(\[[^\]]+\] [\d,]+)\s*$")
# Open MPI's report of the first rank that failed: "Process name: [prterun-host-123@1,2]"
# then "Exit code: 5"; or "... process rank 2 with PID 77 on node host exited on" then
# "signal 11 (Segmentation fault)." (its lines wrap there).
OPEN_MPI_NAME = re.compile(rb"^\s*Process name: \[[^\]]*,(\d+)\]\s*$")
OPEN_MPI_CODE = re.compile(rb"^\s*Exit code:\s*(\d+)\s*$")
OPEN_MPI_SIGNALLED = re.compile(rb"process rank (\d+) with PID \d+ on node \S+ exited on")
OPEN_MPI_SIGNAL = re.compile(rb"(?:^|exited on )\s*signal (\d+)")
# MPICH's banner when a rank ends badly, and its words on Ctrl-C: the summary says how the
# job ended (a rank's own lines, blank ones too, come labelled).
MPICH_PID = re.compile(rb"^=   PID (\d+) RUNNING AT ")  # (the first rank to end badly)
MPICH_SAID = re.compile(rb"^(?:=+|=   .*|YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*"
                        rb"|This typically refers to a problem with your application\."
                        rb"|Please see the FAQ page for debugging suggestions"
                        rb"|\[mpiexec@[^\]]*\] (?:Sending Ctrl-C|Press Ctrl-C again).*|)$")

# Per flavour: the options to start any number of ranks here (Open MPI refuses more than the
# cores without one, and as root needs OMPI_ALLOW_RUN_AS_ROOT=1 and
# OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1: see launching.md), and those that label each output line
# with its rank (Hydra's also print each rank's exit status at the end).
_OPTIONS = {"open mpi": (["--oversubscribe"], ["--tag-output"]),
            "hydra": ([], ["-prepend-rank", "-print-all-exitcodes"]),
            "intel": ([], ["-prepend-rank"]), "": ([], [])}


def find() -> str | None:
    """Return the path of ``mpiexec``: on PATH, else beside this Python (the mpich wheel)."""
    beside = Path(sys.executable).parent / "mpiexec"
    return shutil.which("mpiexec") or (str(beside) if os.access(beside, os.X_OK) else None)


@functools.lru_cache(maxsize=8)
def flavour(program: str) -> str:
    """Return whose ``mpiexec`` ``program`` is: "open mpi", "intel", "hydra" (MPICH's) or ""."""
    try:
        probe = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    version = (probe.stdout + probe.stderr).lower()
    if "open mpi" in version or "openrte" in version or "prte" in version:
        return "open mpi"
    if "intel" in version:
        return "intel"
    return "hydra" if "hydra" in version else ""


def local_options(program: str) -> list[str]:
    """Return the options that let ``program`` start any number of ranks on this machine."""
    return list(_OPTIONS[flavour(program)][0])


def label_options(program: str) -> list[str]:
    """Return the options that make ``program`` prefix each output line with its rank."""
    return list(_OPTIONS[flavour(program)][1])
