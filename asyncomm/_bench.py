"""``asyncomm bench``: OSU-style latency of asyncomm beside the raw backend, in one run.

``asyncomm bench`` starts N ranks of ``python -m asyncomm._bench`` with the launcher of
``asyncomm run``, once per backend. For each operation and message size every rank runs
three variants of the same exchange on the same communicator:

- ``raw``: the backend's blocking call on ``comm.raw`` (the floor to compare with);
- ``asyncomm``: ``await comm.send(...)``, ``await comm.all_reduce(...)``;
- ``naive``: the bridge people write by hand: the blocking ``wait()`` in the loop's
  thread pool (gloo), or ``Test()`` in a ``sleep(0)`` loop (MPI).

The variants alternate round by round (each round: a barrier, a warm-up, then timed
iterations) so that the machine's noise hits them alike; the table gives the median over
rounds of the time per iteration. Ping-pong reports the one-way latency (half a round
trip), allreduce the time per call. ``asyncomm bench idle`` measures the CPU time a rank
spends while it awaits a message that only comes after a while.

``asyncomm bench channels`` measures channels (``comm.channel``) between ranks 0 and 1 the
same way, each row against a baseline, with the ratio (and the target it should meet):

- ``pingpong``: one-way latency of an 8 B and a 1 MiB tensor, vs the raw blocking
  send/recv of the same bytes;
- ``stream``: bandwidth of 1 MiB messages with 64 in flight (the sender gathers 64
  ``send``s, the receiver consumes them, then acknowledges), vs 64 raw isend/irecv in
  flight (into 64 buffers), wait all, ack (as osu_bw); target asyncomm/raw >= 0.8;
- ``rate``: small dicts per second, sent one after the other, vs the backend's pickle path
  (mpi4py ``comm.send``/``recv``; gloo: torch's ``send_object_list``); target >= 1.0;
- ``channels``: ping-pong latency with each exchange on the next of 1000 open channels, vs
  all on one channel; target 1000/1 <= 1.2.

The workers also run under any launcher on their own, e.g.
``mpiexec -n 2 python -m asyncomm._bench all``: rank 0 then prints the table and writes
the JSON itself.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import importlib
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from asyncomm._comm import Comm

# torch is imported by the functions that measure, which run in the ranks: the parent
# process of ``asyncomm bench`` only launches them and prints their tables.

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_SIZES = (8, 64, KIB, 16 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)
QUICK_SIZES = (8, MIB)
OPS = ("pingpong", "allreduce")
VARIANTS = ("raw", "asyncomm", "naive")
BACKENDS = ("gloo", "mpi")
TAG = 77  # every variant's point-to-point messages; variants never overlap in time
IDLE_WAIT_S = 2.0

Record = dict[str, Any]


# -- what is measured ------------------------------------------------------------------


@dataclass(frozen=True)
class Calls:
    """One variant's operations on one tensor: each returns when done, or an awaitable."""

    send: Callable[[], Any]  # to the peer
    recv: Callable[[], Any]  # from the peer
    allreduce: Callable[[], Any]
    blocking: bool  # True: a call returns once the operation is done


def _variants(comm: Comm, t: torch.Tensor, peer: int) -> dict[str, Calls]:
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


def _step(op: str, calls: Calls, rank: int) -> Callable[[], Any] | None:
    """One iteration of ``op`` on this rank (``None``: this rank sits it out)."""
    if op == "allreduce":
        return calls.allreduce
    if rank > 1:
        return None
    first, second = (calls.send, calls.recv) if rank == 0 else (calls.recv, calls.send)
    if calls.blocking:
        def step() -> None:
            first()
            second()

        return step

    async def step_async() -> None:
        await first()
        await second()

    return step_async


@dataclass(frozen=True)
class Timed:
    """One variant of a measurement on this rank: ``step`` runs one timed iteration."""

    step: Callable[[], Any] | None  # None: this rank sits the variant out
    blocking: bool  # True: ``step()`` returns when done; False: it returns an awaitable


async def _seconds_per_call(step: Callable[[], Any], blocking: bool, warmup: int,
                            iters: int) -> float:
    """Run ``step`` ``warmup`` times, then time ``iters`` calls; return seconds per call."""
    if blocking:
        for _ in range(warmup):
            step()
        start = time.perf_counter()
        for _ in range(iters):
            step()
    else:
        for _ in range(warmup):
            await step()
        start = time.perf_counter()
        for _ in range(iters):
            await step()
    return (time.perf_counter() - start) / iters


async def _alternate(comm: Comm, variants: dict[str, Timed], rounds: int, warmup: int,
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
                samples[name].append(await _seconds_per_call(
                    timed.step, timed.blocking, warmup + (prime if r == 0 else 0), iters))
    return samples


def iterations(size: int, quick: bool = False) -> tuple[int, int]:
    """Warm-up and timed iterations for a message of ``size`` bytes (fewer as it grows)."""
    iters = max(4, min(1000, (64 * MIB) // size))
    if quick:
        iters = max(2, iters // 10)
    return max(1, iters // 10), iters


async def _core(comm: Comm, ops: Sequence[str], sizes: Sequence[int], rounds: int,
                quick: bool) -> list[Record]:
    """Measure every (op, size, variant); return rank 0's records (``[]`` elsewhere)."""
    import torch

    records: list[Record] = []
    peer = 1 - comm.rank if comm.rank < 2 else 0
    for op in ops:
        for size in sizes:
            calls = _variants(comm, torch.zeros(size // 4), peer)
            warmup, iters = iterations(size, quick)
            timed = {v: Timed(_step(op, calls[v], comm.rank), calls[v].blocking)
                     for v in VARIANTS}
            samples = await _alternate(comm, timed, rounds, warmup, iters)
            if op == "pingpong":  # one-way latency: half a round trip
                samples = {v: [s / 2 for s in samples[v]] for v in VARIANTS}
            if comm.rank == 0:
                records.append(_record(op, size, iters, samples))
                _progress(records[-1])
    return records


def _record(op: str, size: int, iters: int, samples: dict[str, list[float]]) -> Record:
    us = {v: statistics.median(samples[v]) * 1e6 for v in VARIANTS}
    return {
        "op": op, "size": size,
        **{f"{v}_us": us[v] for v in VARIANTS},
        "ratio_asyncomm_raw": us["asyncomm"] / us["raw"],
        "ratio_naive_raw": us["naive"] / us["raw"],
        "iterations": iters,
        "samples_us": {v: [s * 1e6 for s in samples[v]] for v in VARIANTS},
    }


async def _idle(comm: Comm, wait_s: float) -> list[Record]:
    """Rank 1 awaits a message that rank 0 sends ``wait_s`` later; CPU seconds per variant."""
    import torch

    calls = _variants(comm, torch.zeros(2), 1 - comm.rank if comm.rank < 2 else 0)
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
    return [{"op": "idle", "variant": v, "wait_s": wait_s, "cpu_s": everyone[1][v][0],
             "wall_s": everyone[1][v][1]} for v in VARIANTS] if comm.rank == 0 else []


# -- channels ---------------------------------------------------------------------------

CHANNEL_SIZES = (8, MIB)  # ping-pong sizes of ``bench channels``
STREAM_BYTES, IN_FLIGHT = MIB, 64
OPEN_CHANNELS = 1000
SMALL_MESSAGE = {"step": 0, "loss": 0.5, "ids": [1, 2, 3]}
# test: (variant compared, baseline variant, unit, target on the ratio compared/baseline)
CHANNEL_TESTS: dict[str, tuple[str, str, str, tuple[str, float] | None]] = {
    "pingpong": ("asyncomm", "raw", "us", None),
    "awaited": ("awaited", "raw", "us", None),  # the least any awaitable message costs
    "stream": ("asyncomm", "raw", "MiB/s", (">=", 0.8)),
    "rate": ("asyncomm", "pickle", "msg/s", (">=", 1.0)),
    "channels": (f"{OPEN_CHANNELS} channels", "1 channel", "us", ("<=", 1.2)),
}
_TAGS = {"pingpong": 1, "stream": 2, "rate": 3, "ack": 4, "one": 5, "many": 1 << 20}


def _awaited(comm: Comm, t: torch.Tensor, peer: int) -> Calls:
    """Raw sends and receives of ``t``, each awaited as cheaply as an event loop allows.

    No checks, framing, routing or decoding: only what any library that lets a task await
    a request must do. On MPI, one loop callback tests the requests in flight and settles
    a future per request; on gloo, whose requests complete only in ``wait()``, a thread
    waits and settles it: the core bench's ``naive`` variant.
    """
    if comm.backend != "mpi":
        return _variants(comm, t, peer)["naive"]
    from mpi4py import MPI

    raw, loop = comm.raw, asyncio.get_running_loop()
    buf = [t.numpy(), MPI.FLOAT]
    pending: list[tuple[Any, asyncio.Future[None]]] = []

    def poll() -> None:
        for entry in [e for e in pending if e[0].Test()]:
            pending.remove(entry)
            entry[1].set_result(None)
        if pending:
            loop.call_soon(poll)

    def awaiting(request: Any) -> asyncio.Future[None]:
        future = loop.create_future()
        pending.append((request, future))
        if len(pending) == 1:
            loop.call_soon(poll)
        return future

    return Calls(lambda: awaiting(raw.Isend(buf, peer, TAG)),
                 lambda: awaiting(raw.Irecv(buf, peer, TAG)), _no_allreduce, blocking=False)


@dataclass(frozen=True)
class Case:
    """One row of ``bench channels``: its variants on this rank and how to read the times."""

    test: str  # a key of CHANNEL_TESTS
    size: int  # bytes per message
    variants: dict[str, Timed]
    warmup: int
    iters: int
    per_call: float  # per timed call: MiB or messages moved, or 1/2 (one way of a round trip)
    prime: int = 0  # untimed calls before the first round (beside its warm-up)


def _exchange(rank: int, send: Callable[[], Any], recv: Callable[[], Any],
              blocking: bool) -> Timed:
    """A ping-pong between ranks 0 and 1 (the core bench's ``_step``)."""
    return Timed(_step("pingpong", Calls(send, recv, _no_allreduce, blocking), rank), blocking)


def _no_allreduce() -> None:
    raise AssertionError("bench channels measures no all-reduce")


def _burst(rank: int, send: Callable[[], Any], recv: Callable[[], Any],
           ack_send: Callable[[], Any], ack_recv: Callable[[], Any], blocking: bool) -> Timed:
    """One call: rank 0 runs ``send`` and rank 1 ``recv``, then rank 1 acknowledges."""
    if rank > 1:
        return Timed(None, blocking)
    first, second = (send, ack_recv) if rank == 0 else (recv, ack_send)
    if blocking:
        def step() -> None:
            first()
            second()

        return Timed(step, True)

    async def step_async() -> None:
        await first()
        await second()

    return Timed(step_async, False)


def _raw_stream(comm: Comm, t: torch.Tensor, peer: int) -> Timed:
    """``IN_FLIGHT`` sends (receives) of ``t`` on ``comm.raw`` in flight at once, then an ack.

    Each receive of a window has a buffer of its own (as each message a channel delivers
    does), allocated once: osu_bw's single buffer for all 64 is not a valid MPI program,
    and would measure a cache-hot copy instead of the delivery of 64 messages.
    """
    import torch

    raw, n = comm.raw, IN_FLIGHT
    inbox = [torch.empty_like(t) for _ in range(n if comm.rank == 1 else 0)]
    flag = torch.zeros(2)
    if comm.backend == "mpi":
        from mpi4py import MPI

        out, ack = [t.numpy(), MPI.FLOAT], [flag.numpy(), MPI.FLOAT]
        into = [[b.numpy(), MPI.FLOAT] for b in inbox]
        return _burst(
            comm.rank,
            lambda: MPI.Request.Waitall([raw.Isend(out, peer, TAG) for _ in range(n)]),
            lambda: MPI.Request.Waitall([raw.Irecv(b, peer, TAG) for b in into]),
            lambda: raw.Send(ack, peer, TAG + 1), lambda: raw.Recv(ack, peer, TAG + 1),
            blocking=True)

    def wait_all(works: list[Any]) -> None:
        for work in works:
            work.wait()

    return _burst(
        comm.rank,
        lambda: wait_all([raw.send([t], peer, TAG) for _ in range(n)]),
        lambda: wait_all([raw.recv([b], peer, TAG) for b in inbox]),
        lambda: raw.send([flag], peer, TAG + 1).wait(),
        lambda: raw.recv([flag], peer, TAG + 1).wait(), blocking=True)


def _pickled(comm: Comm, peer: int) -> Timed:
    """``IN_FLIGHT`` small objects one after the other through pickle, then an ack.

    MPI: mpi4py's ``comm.send``/``comm.recv``; gloo: torch's ``send_object_list``.
    """
    n, msg = IN_FLIGHT, SMALL_MESSAGE
    if comm.backend == "mpi":
        raw = comm.raw

        def send_mpi() -> None:
            for _ in range(n):
                raw.send(msg, peer, TAG)

        def recv_mpi() -> None:
            for _ in range(n):
                raw.recv(source=peer, tag=TAG)

        return _burst(comm.rank, send_mpi, recv_mpi, lambda: raw.send(None, peer, TAG + 1),
                      lambda: raw.recv(source=peer, tag=TAG + 1), blocking=True)
    import torch.distributed as dist

    box: list[Any] = [None]

    def send_torch() -> None:
        for _ in range(n):
            dist.send_object_list([msg], peer)

    def recv_torch() -> None:
        for _ in range(n):
            dist.recv_object_list(box, peer)

    return _burst(comm.rank, send_torch, recv_torch, lambda: dist.send_object_list([0], peer),
                  lambda: dist.recv_object_list(box, peer), blocking=True)


def _channel_cases(comm: Comm, sizes: Sequence[int], quick: bool) -> list[Case]:
    """Every row of ``bench channels``, as run by this rank (ranks above 1 sit out)."""
    import torch

    from asyncomm import _wire

    rank, peer = comm.rank, 1 - comm.rank if comm.rank < 2 else 0
    ack = comm.channel(_TAGS["ack"])

    def ack_send() -> Any:
        return ack.send(0, peer)

    def ack_recv() -> Any:
        return ack.recv(peer)

    cases = []
    ch = comm.channel(_TAGS["pingpong"])
    for size in sizes:  # ping-pong: channel vs blocking send/recv of the same bytes
        t = torch.zeros(size // 4)
        warmup, iters = iterations(size, quick)
        iters = max(2, iters // 2)  # more rounds than the core bench, each shorter
        raw = _variants(comm, t, peer)["raw"]
        cases.append(Case("pingpong", size, {
            "raw": Timed(_step("pingpong", raw, rank), True),
            "asyncomm": _exchange(rank, functools.partial(ch.send, t, peer),
                                  lambda: ch.recv(peer), blocking=False),
        }, warmup, iters, 0.5))
    if sizes:  # the smallest message, awaited with nothing else: the floor of the first row
        t = torch.zeros(min(sizes) // 4)
        warmup, iters = iterations(min(sizes), quick)
        awaited = _awaited(comm, t, peer)
        cases.append(Case("awaited", t.nbytes, {
            "raw": Timed(_step("pingpong", _variants(comm, t, peer)["raw"], rank), True),
            "awaited": _exchange(rank, awaited.send, awaited.recv, blocking=False),
        }, warmup, max(2, iters // 2), 0.5))

    big = torch.zeros(STREAM_BYTES // 4)  # stream: IN_FLIGHT sends in flight, then an ack
    stream = comm.channel(_TAGS["stream"])

    async def stream_send() -> None:
        await asyncio.gather(*(stream.send(big, peer) for _ in range(IN_FLIGHT)))

    async def stream_recv() -> None:
        for _ in range(IN_FLIGHT):
            await stream.recv(peer)

    cases.append(Case("stream", STREAM_BYTES, {
        "raw": _raw_stream(comm, big, peer),
        "asyncomm": _burst(rank, stream_send, stream_recv, ack_send, ack_recv, blocking=False),
    }, 1, 2 if quick else 8, STREAM_BYTES * IN_FLIGHT / MIB))

    small = comm.channel(_TAGS["rate"])  # rate: small dicts one after the other, then an ack

    async def small_send() -> None:
        for _ in range(IN_FLIGHT):
            await small.send(SMALL_MESSAGE, peer)

    async def small_recv() -> None:
        for _ in range(IN_FLIGHT):
            await small.recv(peer)

    frame = len(_wire.encode(_wire.Kind.DATA, _TAGS["rate"], 0, SMALL_MESSAGE)[0])
    iters = 2 if quick else 40
    cases.append(Case("rate", frame, {
        "pickle": _pickled(comm, peer),
        "asyncomm": _burst(rank, small_send, small_recv, ack_send, ack_recv, blocking=False),
    }, max(1, iters // 10), iters, IN_FLIGHT))

    one = comm.channel(_TAGS["one"])  # ping-pong over one channel vs rotating over many
    many = [comm.channel(_TAGS["many"] + i) for i in range(OPEN_CHANNELS)]
    turn = itertools.cycle(many)  # both ranks take the channels in the same order
    now = [many[0]]
    tiny = torch.zeros(2)

    def rotate_send() -> Any:
        if rank == 0:  # rank 0 starts an exchange on the next channel, rank 1 answers on it
            now[0] = next(turn)
        return now[0].send(tiny, peer)

    def rotate_recv() -> Any:
        if rank == 1:
            now[0] = next(turn)
        return now[0].recv(peer)

    cases.append(Case("channels", tiny.nbytes, {
        "1 channel": _exchange(rank, lambda: one.send(tiny, peer), lambda: one.recv(peer),
                               blocking=False),
        f"{OPEN_CHANNELS} channels": _exchange(rank, rotate_send, rotate_recv, blocking=False),
    }, 50, OPEN_CHANNELS // 20 if quick else OPEN_CHANNELS, 0.5,
        prime=OPEN_CHANNELS // 20 if quick else OPEN_CHANNELS))
    return cases  # (priming has every channel carry a message each way before timing;
    # --quick, a smoke run, primes and times only a twentieth of them)


async def _channels(comm: Comm, sizes: Sequence[int], rounds: int, quick: bool
                    ) -> list[Record]:
    """Measure channels beside their baselines; return rank 0's records (``[]`` elsewhere)."""
    records: list[Record] = []
    for case in _channel_cases(comm, sizes, quick):
        samples = await _alternate(comm, case.variants, rounds, case.warmup, case.iters,
                                   case.prime)
        if comm.rank == 0:
            records.append(_channel_record(case, samples))
            _channel_progress(records[-1])
    return records


def _channel_record(case: Case, samples: dict[str, list[float]]) -> Record:
    """Rank 0's record of one case, from its seconds per call, per variant and round."""
    ours, base, unit, target = CHANNEL_TESTS[case.test]
    if unit == "us":  # lower is better
        values = {v: [s * case.per_call * 1e6 for s in samples[v]] for v in samples}
    else:
        values = {v: [case.per_call / s for s in samples[v]] for v in samples}
    median = {v: statistics.median(values[v]) for v in values}
    ratio = median[ours] / median[base]
    met = None
    if target is not None:
        met = ratio >= target[1] if target[0] == ">=" else ratio <= target[1]
    return {
        "bench": "channels", "op": case.test, "size": case.size, "unit": unit,
        "base": base, "compared": ours, "base_value": median[base], "value": median[ours],
        "ratio": ratio, "target": None if target is None else f"{target[0]} {target[1]:g}",
        "met": met, "iterations": case.iters, "samples": values,
    }


def _channel_progress(rec: Record) -> None:
    print(f"bench: channels {rec['op']} {_size(rec['size'])}: {rec['base']} "
          f"{_value(rec['base_value'])} {rec['unit']}, {rec['compared']} "
          f"{_value(rec['value'])} {rec['unit']}", file=sys.stderr, flush=True)


def _meta(comm: Comm, rounds: int, quick: bool) -> Record:
    import torch

    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    meta: Record = {
        "backend": comm.backend, "ranks": comm.size,
        "loop": "uvloop" if loop == "uvloop" else "asyncio",
        "torch": torch.__version__, "mpi4py": _version("mpi4py"), "mpi_library": None,
        "python": platform.python_version(), "rounds": rounds, "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if comm.backend == "mpi":
        from mpi4py import MPI

        meta["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    return meta


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- output ---------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _us(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _value(x: float) -> str:
    return _us(x) if x < 10_000 else f"{x:,.0f}"


def _progress(rec: Record) -> None:
    print(f"bench: {rec['op']} {_size(rec['size'])}: "
          + ", ".join(f"{v} {_us(rec[f'{v}_us'])} us" for v in VARIANTS), file=sys.stderr,
          flush=True)


def table(records: Sequence[Record]) -> str:
    """Render the records of one backend's run: a header, then one line per row."""
    if not records:
        return ""
    m = records[0]
    lines = [f"backend {m['backend']}, {m['ranks']} ranks, loop {m['loop']}, "
             f"torch {m['torch']}, mpi4py {m['mpi4py'] or '-'}, python {m['python']}"
             + (f"\n{m['mpi_library']}" if m["mpi_library"] else "")]
    if m.get("bench") == "channels":
        return "\n".join([*lines, *_channel_table(records)])
    if m.get("bench") == "gradsync":
        from asyncomm import _bench_gradsync

        return "\n".join([*lines, *_bench_gradsync.table(records)])
    if m.get("bench") == "pipeline":
        from asyncomm import _bench_pipeline

        return _bench_pipeline.table(records)
    if m["op"] == "idle":
        lines.append(f"idle: rank 1 awaits a message rank 0 sends after {m['wait_s']:g} s")
        lines.append(f"{'variant':<10}{'wall s':>9}{'CPU s':>9}{'CPU/wall':>10}")
        lines += [f"{r['variant']:<10}{r['wall_s']:>9.2f}{r['cpu_s']:>9.3f}"
                  f"{r['cpu_s'] / r['wall_s']:>10.2f}" for r in records]
        return "\n".join(lines)
    lines.append(f"median of {m['rounds']} rounds; ping-pong: one-way latency")
    lines.append(f"{'op':<10}{'size':>8}{'raw us':>10}{'asyncomm us':>13}{'naive us':>10}"
                 f"{'asyncomm/raw':>14}{'naive/raw':>11}")
    lines += [f"{r['op']:<10}{_size(r['size']):>8}{_us(r['raw_us']):>10}"
              f"{_us(r['asyncomm_us']):>13}{_us(r['naive_us']):>10}"
              f"{r['ratio_asyncomm_raw']:>14.2f}{r['ratio_naive_raw']:>11.2f}" for r in records]
    return "\n".join(lines)


def _channel_table(records: Sequence[Record]) -> list[str]:
    m = records[0]
    lines = [f"channels: median of {m['rounds']} rounds; ping-pong: one-way latency; "
             f"stream: {IN_FLIGHT} x {_size(STREAM_BYTES)} in flight; "
             f"rate: {IN_FLIGHT} dicts one after the other",
             f"{'test':<10}{'size':>8}{'unit':>7}{'baseline':>11}{'value':>10}"
             f"{'compared':>15}{'value':>10}{'ratio':>7}  target"]
    for r in records:
        target = "" if r["target"] is None else f"{r['target']}: {'met' if r['met'] else 'MISSED'}"
        lines.append(f"{r['op']:<10}{_size(r['size']):>8}{r['unit']:>7}{r['base']:>11}"
                     f"{_value(r['base_value']):>10}{r['compared']:>15}{_value(r['value']):>10}"
                     f"{r['ratio']:>7.2f}  {target}".rstrip())
    return lines


# -- command line ----------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    units = {"k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "b": 1, "": 1}
    sizes = []
    for item in text.split(","):
        word = item.strip().lower()
        digits = word.rstrip("kmib")
        try:
            size = int(digits) * units[word[len(digits):]]
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(f"not a size in bytes: {item!r}") from None
        if size < 4 or size % 4:
            raise argparse.ArgumentTypeError(f"{item!r}: sizes are whole float32s (4 B each)")
        sizes.append(size)
    return tuple(sizes)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return value


def _options(p: argparse.ArgumentParser) -> None:
    """The options the command and its workers share."""
    p.add_argument("what", nargs="?", default="all",
                   choices=(*OPS, "all", "idle", "channels", "gradsync", "pipeline", "soak"),
                   help="what to measure (default: all = pingpong and allreduce; channels: "
                   "asyncomm channels beside the raw backend; soak: a random mix of traffic "
                   "for --seconds, every result checked; gradsync: GradSync beside DDP, and "
                   "asyncomm.compute under an all-reduce; pipeline: the pipeline executor "
                   "against torch.distributed.pipelining and against the simulator's bubble)")
    p.add_argument("--seconds", type=float, default=10.0, metavar="S",
                   help="how long soak runs (default 10)")
    p.add_argument("--sizes", type=_sizes, metavar="BYTES,...",
                   help="message sizes (suffixes K, M allowed); default 8 B to 16 MiB "
                   "(channels: the ping-pong sizes, default 8 B and 1 MiB)")
    p.add_argument("--rounds", type=_positive, metavar="R",
                   help="rounds per variant (default 5, channels 9; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="sizes 8 B and 1 MiB, fewer iterations and rounds, idle waits 0.2 s "
                   "(a smoke test)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write the records here (default bench-core.json, bench-idle.json "
                   "or bench-channels.json)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm bench`` on its subparser."""
    _options(p)
    p.add_argument("--backend", choices=(*BACKENDS, "both"), default="gloo",
                   help="backend to measure; both: gloo, then mpi (default gloo)")
    p.add_argument("-n", "--nproc", type=_positive, default=2, metavar="N",
                   help="ranks (default 2)")
    p.set_defaults(func=command)


def _settings(args: argparse.Namespace) -> tuple[tuple[int, ...], int, Path]:
    sizes = args.sizes or (CHANNEL_SIZES if args.what == "channels"
                           else QUICK_SIZES if args.quick else DEFAULT_SIZES)
    rounds = args.rounds or (3 if args.quick else 9 if args.what == "channels" else 5)
    path = args.json or Path(f"bench-{args.what}.json"
                             if args.what in ("idle", "channels", "gradsync", "pipeline")
                             else "bench-core.json")
    return sizes, rounds, path


def command(args: argparse.Namespace) -> int:
    """Run ``asyncomm bench`` as parsed: one launch per backend; return the exit code."""
    from asyncomm._launch import find_mpiexec, launch

    sizes, rounds, path = _settings(args)
    if args.nproc < 2:
        print("asyncomm bench: -n must be at least 2", file=sys.stderr)
        return 2
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    records: list[Record] = []
    code = 0
    with tempfile.TemporaryDirectory(prefix="asyncomm-bench-") as tmp:
        for backend in backends:
            if backend == "mpi" and find_mpiexec() is None:
                print("asyncomm bench: mpiexec not found; pip install 'asyncomm[mpi]'",
                      file=sys.stderr)
                code = code or 2
                continue
            if args.what == "soak":
                print(f"asyncomm bench soak: {backend}, {args.nproc} ranks", flush=True)
                code = launch(["-m", "asyncomm._soak", "--seconds", str(args.seconds)],
                              args.nproc, backend=backend)
                if code != 0:
                    break
                continue
            part = Path(tmp) / f"{backend}.json"
            argv = ["-m", "asyncomm._bench", args.what, "--rounds", str(rounds),
                    "--sizes", ",".join(map(str, sizes)), "--json", str(part), "--no-table",
                    *(["--quick"] if args.quick else [])]
            code = launch(argv, args.nproc, backend=backend)
            if code != 0:
                break
            mine = json.loads(part.read_text())
            print(table(mine) + "\n", flush=True)
            records += mine
    if records:
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {path}")
    return code


def _worker(argv: Sequence[str] | None = None) -> int:
    """Every rank's entry point: measure, then rank 0 reports."""
    import asyncomm

    parser = argparse.ArgumentParser(prog="python -m asyncomm._bench")
    _options(parser)
    parser.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes, rounds, path = _settings(args)
    wait_s = IDLE_WAIT_S / 10 if args.quick else IDLE_WAIT_S
    ops = OPS if args.what == "all" else (args.what,)

    async def main(comm: Comm) -> list[Record]:
        if comm.size < 2:
            raise SystemExit("asyncomm bench: needs at least 2 ranks")
        meta = _meta(comm, rounds, args.quick)
        if args.what in ("gradsync", "pipeline"):  # sections with a module of their own
            section = importlib.import_module(f"asyncomm._bench_{args.what}")
            return [{**meta, **r} for r in await section.measure(comm, rounds, args.quick)]
        found = await (_idle(comm, wait_s) if args.what == "idle"
                       else _channels(comm, sizes, rounds, args.quick)
                       if args.what == "channels"
                       else _core(comm, ops, sizes, rounds, args.quick))
        return [{**meta, **r} for r in found]

    records = asyncomm.run(main)
    if records:  # rank 0
        path.write_text(json.dumps(records, indent=1) + "\n")
        if not args.no_table:
            print(table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
