"""What every section of ``asyncomm bench`` shares: records, timing by alternation, output.

Variants of one measurement alternate round by round (each round: a barrier,
a warm-up, then timed iterations), so that the machine's noise hits them
alike; tables give the median over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncomm._comm import Comm

# torch is imported by the functions that measure, which run in the ranks: the parent
# process of ``asyncomm bench`` only launches them and prints their tables.

KIB, MIB = 1 << 10, 1 << 20

Record = dict[str, Any]


@dataclass(frozen=True)
class Timed:
    """One variant of a measurement on this rank: ``step`` runs one timed iteration."""

    step: Callable[[], Any] | None  # None: this rank sits the variant out
    blocking: bool  # True: ``step()`` returns when done; False: it returns an awaitable
    # awaited right after ``step``'s in each iteration (a ping-pong's other half), as a
    # program's loop of two awaits runs: no coroutine made per iteration to hold both
    then: Callable[[], Any] | None = None


async def seconds_per_call(step: Callable[[], Any], blocking: bool, warmup: int,
                            iters: int, then: Callable[[], Any] | None = None) -> float:
    """Run ``step`` (then ``then``) ``warmup`` times, then time ``iters``; return seconds
    per iteration."""
    if blocking:
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(iters):
            step()
    elif then is None:
        for _ in range(warmup):
            await step()
        start = time.perf_counter()
        for _ in range(iters):
            await step()
    else:
        for _ in range(warmup):
            await step()
            await then()
        start = time.perf_counter()
        for _ in range(iters):
            await step()
            await then()
    return (time.perf_counter() - start) / iters


async def alternate(comm: Comm, variants: dict[str, Timed], rounds: int, warmup: int,
                     iters: int, prime: int = 0) -> dict[str, list[float]]:
    """Time every variant ``rounds`` times, alternating them; seconds per call, per round.

    Each round runs every variant once, in an order that rotates from round to round, each
    after a barrier and a warm-up (plus ``prime`` more calls in the first round). Ranks
    that sit a variant out only join the barriers, so their lists stay empty.
    """
    names = list(variants)
    samples: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:  # rotate: no fixed order
            await comm.barrier()
            timed = variants[name]
            if timed.step is not None:
                samples[name].append(await seconds_per_call(
                    timed.step, timed.blocking, warmup + (prime if r == 0 else 0), iters,
                    timed.then))
    return samples


def iterations(size: int, quick: bool = False) -> tuple[int, int]:
    """Warm-up and timed iterations for a message of ``size`` bytes (fewer as it grows)."""
    iters = max(4, min(1000, (64 * MIB) // size))
    if quick:
        iters = max(2, iters // 10)
    return max(1, iters // 10), iters


def meta(comm: Comm, rounds: int, quick: bool) -> Record:
    import torch

    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    meta: Record = {
        "backend": comm.backend, "ranks": comm.size,
        "loop": "uvloop" if loop == "uvloop" else "asyncio",
        "torch": torch.__version__, "mpi4py": None, "mpi_library": None,
        "python": platform.python_version(), "rounds": rounds, "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(metadata.PackageNotFoundError):
        meta["mpi4py"] = metadata.version("mpi4py")
    if comm.backend == "mpi":
        from mpi4py import MPI

        meta["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    return meta


def size_text(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def us_text(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def value_text(x: float) -> str:
    return us_text(x) if x < 10_000 else f"{x:,.0f}"
