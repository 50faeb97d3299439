"""Run a rank script many times, each time on fresh processes that end as real ones do.

``python exit_loop.py SCRIPT RANKS TIMES``: torch and asyncomm are imported once, here;
each time, RANKS processes are forked, each runs SCRIPT as ``__main__`` (as rank 0..RANKS-1
of a gloo world whose store this process hosts) and then leaves the interpreter the usual
way, through ``sys.exit``: finalization, atexit handlers and all. Forking spares each
time the seconds of loading torch, so a failure that happens only sometimes at exit can
be repeated until it would show. Prints one line per time: each rank's exit status.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch  # noqa: F401  # loaded once, before forking

import asyncomm  # noqa: F401
from asyncomm._tools import launch as _launch


def rank(script: str, number: int, size: int, port: int) -> int:
    """Run ``script`` as rank ``number`` (in a forked child); return its exit code."""
    os.environ.update(RANK=str(number), LOCAL_RANK=str(number), WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ASYNCOMM_STORE="client",
                      GLOO_SOCKET_IFNAME=_launch.loopback_interface())
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def main() -> int:
    script, size, times = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    failed = 0
    for time_ in range(times):
        listening = _launch._listen_on_loopback()
        port = listening.getsockname()[1]
        children = []
        for number in range(size):
            pid = os.fork()
            if pid == 0:
                listening.close()
                sys.exit(rank(script, number, size, port))  # ends this child, not the loop
            children.append(pid)
        store = _launch._serve_store(listening)
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        del store
        codes = [os.waitstatus_to_exitcode(status) for status in statuses]
        print(f"time {time_}: exit codes {codes}", flush=True)
        failed += any(code < 0 for code in codes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
