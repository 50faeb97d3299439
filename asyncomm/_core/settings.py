"""Every ``ASYNCOMM_*`` environment variable, read in one place.

``read()`` returns a frozen ``Settings`` from the environment as it is now; each part of
asyncomm reads it when the value matters (most when a communicator is made), so a program
or a test may set a variable before that. A value that does not parse raises ``ValueError``
naming the variable. ``docs/configuration.md`` lists them all.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True)
class Settings:
    """The values of the ``ASYNCOMM_*`` variables (defaults where unset)."""

    backend: str | None = None  # ASYNCOMM_BACKEND: overrides the automatic choice
    timeout: float = 300.0  # ASYNCOMM_TIMEOUT: every operation's default deadline, s
    loop: str = "uvloop"  # ASYNCOMM_LOOP: "asyncio" for asyncio's own event loop
    trace: str | None = None  # ASYNCOMM_TRACE: trace into this directory
    debug: bool = False  # ASYNCOMM_DEBUG: check collectives across ranks first
    blocked_s: float = 0.25  # ASYNCOMM_BLOCKED_S: debug mode reports a loop held this long
    stall_s: float = 60.0  # ASYNCOMM_STALL_S: warn of an operation pending this long (0: off)
    probe_s: float = 0.5  # ASYNCOMM_PROBE_S: a waiter checks its peers after this long
    grace_s: float = 10.0  # ASYNCOMM_GRACE_S: after a rank fails, how long the others may end
    launched: bool = False  # ASYNCOMM_LAUNCHED: ``asyncomm run`` started this rank
    status_host: str | None = None  # ASYNCOMM_STATUS_HOST: where the status server listens
    max_message_bytes: int | None = None  # ASYNCOMM_MAX_MESSAGE_BYTES: the largest frame
    eager_bytes: int = 64 << 10  # ASYNCOMM_EAGER_BYTES: gloo sends a copy at most this big
    busy_s: float = 2e-3  # ASYNCOMM_BUSY_US: MPI polls every loop turn this long after receives
    active_busy_s: float = 0.1  # ASYNCOMM_ACTIVE_BUSY_US: ... after sends and collectives
    max_backoff_s: float = 1e-3  # ASYNCOMM_MAX_BACKOFF_US: the longest idle MPI poll interval
    tick_s: float = 200e-6  # ASYNCOMM_TICK_US: ... while waits are recent, a thread's (0: none)
    spin_tests: int = 32  # ASYNCOMM_SPIN_TESTS: an awaited MPI request is tested so often first
    spin_max_s: float = 50e-6  # ASYNCOMM_SPIN_MAX_US: ... then for at most this long
    gloo_spin_max_s: float = 1e-3  # ASYNCOMM_GLOO_SPIN_MAX_US: the same for gloo collectives
    lane_shm: bool = True  # ASYNCOMM_LANE_SHM: "0": gloo's data lane uses sockets on one host too
    lane_direct: bool = True  # ASYNCOMM_LANE_DIRECT: "0": ... rings, not direct reads
    compute_threads: int = 1  # ASYNCOMM_COMPUTE_THREADS: threads asyncomm.compute uses
    store: str | None = None  # ASYNCOMM_STORE: "client" when the launcher hosts the store
    test_address: str | None = None  # ASYNCOMM_TEST_ADDRESS: a test world's rank server
    test_key: str | None = None  # ASYNCOMM_TEST_KEY: its authentication key (hex)


def read(environ: Mapping[str, str] | None = None) -> Settings:
    """Return the settings of ``environ`` (the process's environment by default)."""
    env = os.environ if environ is None else environ

    def text(name: str) -> str | None:
        value = env.get(f"ASYNCOMM_{name}", "").strip()
        return value or None

    def number(name: str, default: float, scale: float = 1.0, minimum: float = 0.0) -> float:
        value = text(name)
        if value is None:
            return default
        try:
            parsed = float(value) * scale
        except ValueError:
            raise ValueError(f"ASYNCOMM_{name}={value!r} is not a number") from None
        if not parsed >= minimum:
            raise ValueError(f"ASYNCOMM_{name}={value!r} must be at least {minimum / scale:g}")
        return parsed

    def count(name: str, default: int | None, minimum: int) -> int | None:
        value = text(name)
        if value is None:
            return default
        try:
            parsed = int(value)
        except ValueError:
            raise ValueError(f"ASYNCOMM_{name}={value!r} is not a whole number") from None
        if parsed < minimum:
            raise ValueError(f"ASYNCOMM_{name}={value!r} must be at least {minimum}")
        return parsed

    backend = (text("BACKEND") or "").lower() or None
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"ASYNCOMM_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    return Settings(
        backend=backend,
        timeout=number("TIMEOUT", 300.0, minimum=1e-9),
        loop=text("LOOP") or "uvloop",
        trace=text("TRACE"),
        debug=text("DEBUG") not in (None, "0"),
        blocked_s=number("BLOCKED_S", 0.25, minimum=1e-3),
        stall_s=number("STALL_S", 60.0),
        probe_s=number("PROBE_S", 0.5, minimum=1e-3),
        grace_s=number("GRACE_S", 10.0),
        launched=text("LAUNCHED") == "1",
        status_host=text("STATUS_HOST"),
        max_message_bytes=count("MAX_MESSAGE_BYTES", None, 1),
        eager_bytes=count("EAGER_BYTES", 64 << 10, 0) or 0,
        busy_s=number("BUSY_US", 2e-3, scale=1e-6),
        active_busy_s=number("ACTIVE_BUSY_US", 0.1, scale=1e-6),
        max_backoff_s=number("MAX_BACKOFF_US", 1e-3, scale=1e-6),
        tick_s=number("TICK_US", 200e-6, scale=1e-6),
        spin_tests=count("SPIN_TESTS", 32, 0) or 0,
        spin_max_s=number("SPIN_MAX_US", 50e-6, scale=1e-6),
        gloo_spin_max_s=number("GLOO_SPIN_MAX_US", 1e-3, scale=1e-6),
        lane_shm=text("LANE_SHM") != "0",
        lane_direct=text("LANE_DIRECT") != "0",
        compute_threads=count("COMPUTE_THREADS", 1, 1) or 1,
        store=text("STORE"),
        test_address=text("TEST_ADDRESS"),
        test_key=text("TEST_KEY"),
    )
