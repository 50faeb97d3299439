"""``asyncomm bench pingpong|allreduce|all|idle``: latency and idle CPU beside the raw backend.

Every rank runs three variants of each exchange on the same communicator, alternated round
by round (``harness.alternate``): ``raw`` (the backend's blocking call on ``comm.raw``: the
floor), ``asyncomm``, and ``naive`` (the bridge people write by hand: the blocking ``wait()``
in the loop's thread pool on gloo, ``Test()`` in a ``sleep(0)`` loop on MPI). Ping-pong
reports the one-way latency, allreduce the time per call, ``idle`` the CPU time of a rank
awaiting a late message; docs/benchmarks.md ("Core operations") reads the tables.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncomm._tools.bench.harness import (
    KIB,
    MIB,
    Record,
    Timed,
    alternate,
    iterations,
    size_text,
    us_text,
)

if TYPE_CHECKING:
    import torch

    from asyncomm._comm import Comm

DEFAULT_SIZES = (8, 64, KIB, 16 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)
QUICK_SIZES = (8, MIB)
OPS = ("pingpong", "allreduce")
VARIANTS = ("raw", "asyncomm", "naive")
TAG = 77  # every variant's point-to-point messages; variants never overlap in time
IDLE_WAIT_S = 2.0


@dataclass(frozen=True)
class Calls:
    """One variant's operations on one tensor: each returns when done, or an awaitable."""

    send: Callable[[], Any]  # to the peer
    recv: Callable[[], Any]  # from the peer
    allreduce: Callable[[], Any]
    blocking: bool  # True: a call returns once the operation is done


def variants(comm: Comm, t: torch.Tensor, peer: int) -> dict[str, Calls]:
    """The three variants on ``comm``, moving ``t`` to or from ``peer``."""
    ours = Calls(lambda: comm.send(t, peer, TAG), lambda: comm.recv(t, peer, TAG),
                 lambda: comm.all_reduce(t), blocking=False)
    raw = comm.raw
    if comm.backend == "mpi":
        from mpi4py import MPI

        buf = [t.numpy(), MPI.FLOAT]

        async def spin(request: Any) -> None:
            while not request.Test():
                await asyncio.sleep(0)

        return {
            "raw": Calls(lambda: raw.Send(buf, peer, TAG), lambda: raw.Recv(buf, peer, TAG),
                         lambda: raw.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), blocking=True),
            "asyncomm": ours,
            "naive": Calls(lambda: spin(raw.Isend(buf, peer, TAG)),
                           lambda: spin(raw.Irecv(buf, peer, TAG)),
                           lambda: spin(raw.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)),
                           blocking=False),
        }
    loop = asyncio.get_running_loop()

    def off(work: Any) -> asyncio.Future[Any]:
        return loop.run_in_executor(None, work.wait)

    return {
        "raw": Calls(lambda: raw.send([t], peer, TAG).wait(),
                     lambda: raw.recv([t], peer, TAG).wait(),
                     lambda: raw.allreduce([t]).wait(), blocking=True),
        "asyncomm": ours,
        "naive": Calls(lambda: off(raw.send([t], peer, TAG)), lambda: off(raw.recv([t], peer, TAG)),
                       lambda: off(raw.allreduce([t])), blocking=False),
    }


def timed(op: str, calls: Calls, rank: int) -> Timed:
    """One iteration of ``op`` on this rank (a step of ``None``: this rank sits it out)."""
    if op == "allreduce":
        return Timed(calls.allreduce, calls.blocking)
    return pair(rank, calls.send, calls.recv, blocking=calls.blocking)


def pair(rank: int, send: Callable[[], Any], recv: Callable[[], Any],
         answer: Callable[[], Any] | None = None, hear: Callable[[], Any] | None = None, *,
         blocking: bool) -> Timed:
    """One call between ranks 0 and 1: rank 0 runs ``send`` then ``hear``, rank 1 ``recv``
    then ``answer`` (a ping-pong, without ``answer`` and ``hear``: ``send`` and ``recv``
    again; a burst: then an ack)."""
    if rank > 1:
        return Timed(None, blocking)
    first, second = (send, hear or recv) if rank == 0 else (recv, answer or send)
    if blocking:
        def both() -> None:
            first()
            second()

        return Timed(both, True)
    return Timed(first, False, then=second)


async def measure(comm: Comm, ops: Sequence[str], sizes: Sequence[int], rounds: int,
                quick: bool) -> list[Record]:
    """Measure every (op, size, variant); return rank 0's records (``[]`` elsewhere)."""
    import torch

    records: list[Record] = []
    peer = 1 - comm.rank if comm.rank < 2 else 0
    for op in ops:
        for size in sizes:
            calls = variants(comm, torch.zeros(size // 4), peer)
            warmup, iters = iterations(size, quick)
            each = {v: timed(op, calls[v], comm.rank) for v in VARIANTS}
            samples = await alternate(comm, each, rounds, warmup, iters)
            if op == "pingpong":  # one-way latency: half a round trip
                samples = {v: [s / 2 for s in samples[v]] for v in VARIANTS}
            if comm.rank == 0:
                records.append(record(op, size, iters, samples))
                progress(records[-1])
    return records


def record(op: str, size: int, iters: int, samples: dict[str, list[float]]) -> Record:
    us = {v: statistics.median(samples[v]) * 1e6 for v in VARIANTS}
    return {
        "bench": "core", "op": op, "size": size,
        **{f"{v}_us": us[v] for v in VARIANTS},
        "ratio_asyncomm_raw": us["asyncomm"] / us["raw"],
        "ratio_naive_raw": us["naive"] / us["raw"],
        "iterations": iters,
        "samples_us": {v: [s * 1e6 for s in samples[v]] for v in VARIANTS},
    }


async def idle(comm: Comm, wait_s: float) -> list[Record]:
    """Rank 1 awaits a message that rank 0 sends ``wait_s`` later; CPU seconds per variant."""
    import torch

    calls = variants(comm, torch.zeros(2), 1 - comm.rank if comm.rank < 2 else 0)
    spent: dict[str, tuple[float, float]] = {}
    for variant in VARIANTS:
        await comm.barrier()
        call = calls[variant]
        if comm.rank == 0:
            await asyncio.sleep(wait_s)
            done = call.send()
            if not call.blocking:
                await done
        elif comm.rank == 1:
            cpu, wall = time.process_time(), time.perf_counter()
            done = call.recv()
            if not call.blocking:
                await done
            spent[variant] = (time.process_time() - cpu, time.perf_counter() - wall)
    everyone = await comm.all_gather_object(spent)
    return [{"bench": "idle", "op": "idle", "variant": v, "wait_s": wait_s,
             "cpu_s": everyone[1][v][0], "wall_s": everyone[1][v][1]} for v in VARIANTS
            ] if comm.rank == 0 else []


# The latency targets by (op, size, backend): the most asyncomm/raw may be (None: no
# bound), and whether asyncomm must be at or below the hand-written bridge (``naive``) too.
TARGETS: dict[tuple[str, int, str], tuple[float | None, bool]] = {
    ("pingpong", 8, "mpi"): (1.5, False),
    ("pingpong", 8, "gloo"): (2.0, False),
    ("allreduce", 8, "mpi"): (2.0, True),
    ("allreduce", 8, "gloo"): (None, True),
}


def verdict(rec: Record) -> str:
    """The target a latency record is measured against, and whether it is met ("": none)."""
    target = TARGETS.get((rec["op"], rec["size"], rec.get("backend", "")))
    if target is None:
        return ""
    most, below_naive = target
    words, met = [], True
    if most is not None:
        words.append(f"<= {most:g}x")
        met = rec["ratio_asyncomm_raw"] <= most
    if below_naive:
        words.append("<= naive")
        met = met and rec["asyncomm_us"] <= rec["naive_us"]
    return f"{', '.join(words)}: {'met' if met else 'MISSED'}"


def progress(rec: Record) -> None:
    print(f"bench: {rec['op']} {size_text(rec['size'])}: "
          + ", ".join(f"{v} {us_text(rec[f'{v}_us'])} us" for v in VARIANTS), file=sys.stderr,
          flush=True)


def table(records: Sequence[Record]) -> list[str]:
    """The lines of the latency or the idle table (after the header line)."""
    m = records[0]
    if m["op"] == "idle":
        lines = [f"idle: rank 1 awaits a message rank 0 sends after {m['wait_s']:g} s",
                 f"{'variant':<10}{'wall s':>9}{'CPU s':>9}{'CPU/wall':>10}"]
        return lines + [f"{r['variant']:<10}{r['wall_s']:>9.2f}{r['cpu_s']:>9.3f}"
                        f"{r['cpu_s'] / r['wall_s']:>10.2f}" for r in records]
    lines = [f"median of {m['rounds']} rounds; ping-pong: one-way latency",
             f"{'op':<10}{'size':>8}{'raw us':>10}{'asyncomm us':>13}{'naive us':>10}"
             f"{'asyncomm/raw':>14}{'naive/raw':>11}  target"]
    return lines + [(f"{r['op']:<10}{size_text(r['size']):>8}{us_text(r['raw_us']):>10}"
                     f"{us_text(r['asyncomm_us']):>13}{us_text(r['naive_us']):>10}"
                     f"{r['ratio_asyncomm_raw']:>14.2f}{r['ratio_naive_raw']:>11.2f}  "
                     f"{verdict(r)}").rstrip() for r in records]
