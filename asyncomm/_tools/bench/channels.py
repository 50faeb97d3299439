"""``asyncomm bench channels``: channels between ranks 0 and 1 beside the raw backend.

One row per test of ``CHANNEL_TESTS`` (the variant compared, its baseline, the unit, and the
target on their ratio; ``BACKEND_TARGETS`` where one backend differs): ``pingpong``,
``stream``, ``rate``, ``burst``, ``actor`` and ``channels``; with 3 ranks or more, ``mesh``
and ``mesh-seq`` (rank 0 calls a mesh of every other rank). docs/benchmarks.md ("Channels")
says what each row measures against what.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import statistics
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncomm._tools.bench.core import TAG, pair, timed, variants
from asyncomm._tools.bench.harness import (
    MIB,
    Record,
    Timed,
    alternate,
    iterations,
    size_text,
    value_text,
)

if TYPE_CHECKING:
    import torch

    from asyncomm._comm import Comm

CHANNEL_SIZES = (8, MIB)  # ping-pong sizes of ``bench channels``
STREAM_BYTES, IN_FLIGHT = MIB, 64
OPEN_CHANNELS = 1000
SMALL_MESSAGE = {"step": 0, "loss": 0.5, "ids": [1, 2, 3]}
# test: (variant compared, baseline variant, unit, target on the ratio compared/baseline)
CHANNEL_TESTS: dict[str, tuple[str, str, str, tuple[str, float] | None]] = {
    "pingpong": ("asyncomm", "raw", "us", None),
    "stream": ("asyncomm", "raw", "MiB/s", (">=", 0.8)),
    "rate": ("asyncomm", "pickle", "msg/s", (">=", 1.0)),
    "burst": ("asyncomm", "raw", "msg/s", None),
    "actor": ("actor call", "channel", "us", ("<=", 1.3)),
    "channels": (f"{OPEN_CHANNELS} channels", "1 channel", "us", ("<=", 1.2)),
    "mesh": ("mesh call", "together", "us", ("<=", 1.0)),  # with 3 ranks or more
    "mesh-seq": ("mesh call", "one by one", "us", None),
}
# Targets that hold for one backend and size only: (test, size, backend) -> target.
BACKEND_TARGETS: dict[tuple[str, int, str], tuple[str, float]] = {
    ("pingpong", 8, "mpi"): ("<=", 2.0),
    ("stream", STREAM_BYTES, "mpi"): (">=", 0.9),
}
_TAGS = {"pingpong": 1, "stream": 2, "rate": 3, "ack": 4, "one": 5, "burst": 6, "echo": 7,
         "many": 1 << 20}


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


def _repeat(call: Callable[[], Any]) -> Callable[[], None]:
    """``IN_FLIGHT`` blocking calls of ``call``, one after the other."""
    def calls() -> None:
        for _ in range(IN_FLIGHT):
            call()

    return calls


def _repeat_awaited(call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """``IN_FLIGHT`` calls of ``call``, each awaited before the next."""
    async def calls() -> None:
        for _ in range(IN_FLIGHT):
            await call()

    return calls


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
        return pair(
            comm.rank,
            lambda: MPI.Request.Waitall([raw.Isend(out, peer, TAG) for _ in range(n)]),
            lambda: MPI.Request.Waitall([raw.Irecv(b, peer, TAG) for b in into]),
            lambda: raw.Send(ack, peer, TAG + 1), lambda: raw.Recv(ack, peer, TAG + 1),
            blocking=True)

    def wait_all(works: list[Any]) -> None:
        for work in works:
            work.wait()

    return pair(
        comm.rank,
        lambda: wait_all([raw.send([t], peer, TAG) for _ in range(n)]),
        lambda: wait_all([raw.recv([b], peer, TAG) for b in inbox]),
        lambda: raw.send([flag], peer, TAG + 1).wait(),
        lambda: raw.recv([flag], peer, TAG + 1).wait(), blocking=True)


def _pickled(comm: Comm, peer: int) -> Timed:
    """``IN_FLIGHT`` small objects one after the other through pickle, then an ack.

    MPI: mpi4py's ``comm.send``/``comm.recv``; gloo: torch's ``send_object_list``.
    """
    msg = SMALL_MESSAGE
    if comm.backend == "mpi":
        raw = comm.raw
        return pair(comm.rank, _repeat(functools.partial(raw.send, msg, peer, TAG)),
                    _repeat(functools.partial(raw.recv, source=peer, tag=TAG)),
                    lambda: raw.send(None, peer, TAG + 1),
                    lambda: raw.recv(source=peer, tag=TAG + 1), blocking=True)
    import torch.distributed as dist

    box: list[Any] = [None]
    return pair(comm.rank, _repeat(lambda: dist.send_object_list([msg], peer)),
                _repeat(functools.partial(dist.recv_object_list, box, peer)),
                lambda: dist.send_object_list([0], peer),
                lambda: dist.recv_object_list(box, peer), blocking=True)


def _channel_cases(comm: Comm, sizes: Sequence[int], quick: bool) -> list[Case]:
    """Every row of ``bench channels``, as run by this rank (ranks above 1 sit out)."""
    import torch

    from asyncomm._core import wire

    rank, peer = comm.rank, 1 - comm.rank if comm.rank < 2 else 0
    ack = comm.channel(_TAGS["ack"])
    ack_send, ack_recv = functools.partial(ack.send, 0, peer), functools.partial(ack.recv, peer)
    cases = []
    ch = comm.channel(_TAGS["pingpong"])
    for size in sizes:  # ping-pong: channel vs blocking send/recv of the same bytes
        t = torch.zeros(size // 4)
        warmup, iters = iterations(size, quick)
        iters = max(2, iters // 2)  # more rounds than the core bench, each shorter
        raw = variants(comm, t, peer)["raw"]
        cases.append(Case("pingpong", size, {
            "raw": timed("pingpong", raw, rank),
            "asyncomm": pair(rank, functools.partial(ch.send, t, peer), lambda: ch.recv(peer),
                             blocking=False),
        }, warmup, iters, 0.5))

    big = torch.zeros(STREAM_BYTES // 4)  # stream: IN_FLIGHT sends in flight, then an ack
    stream = comm.channel(_TAGS["stream"])

    async def stream_send() -> None:
        await asyncio.gather(*(stream.send(big, peer) for _ in range(IN_FLIGHT)))

    cases.append(Case("stream", STREAM_BYTES, {
        "raw": _raw_stream(comm, big, peer),
        "asyncomm": pair(rank, stream_send, _repeat_awaited(functools.partial(stream.recv, peer)),
                         ack_send, ack_recv, blocking=False),
    }, 1, 2 if quick else 8, STREAM_BYTES * IN_FLIGHT / MIB))

    small = comm.channel(_TAGS["rate"])  # rate: small dicts one after the other, then an ack
    frame = len(wire.encode(wire.Kind.DATA, _TAGS["rate"], 0, SMALL_MESSAGE)[0])
    iters = 2 if quick else 40
    cases.append(Case("rate", frame, {
        "pickle": _pickled(comm, peer),
        "asyncomm": pair(rank, _repeat_awaited(functools.partial(small.send, SMALL_MESSAGE, peer)),
                         _repeat_awaited(functools.partial(small.recv, peer)), ack_send, ack_recv,
                         blocking=False),
    }, max(1, iters // 10), iters, IN_FLIGHT))

    cases.append(_burst_case(comm, rank, peer, ack_send, ack_recv, quick))
    cases.append(_actor_case(comm, rank, peer, quick))

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
        "1 channel": pair(rank, lambda: one.send(tiny, peer), lambda: one.recv(peer),
                          blocking=False),
        f"{OPEN_CHANNELS} channels": pair(rank, rotate_send, rotate_recv, blocking=False),
    }, 50, OPEN_CHANNELS // 20 if quick else OPEN_CHANNELS, 0.5,
        prime=OPEN_CHANNELS // 20 if quick else OPEN_CHANNELS))
    return cases  # (priming has every channel carry a message each way before timing;
    # --quick, a smoke run, primes and times only a twentieth of them)


def _burst_case(comm: Comm, rank: int, peer: int, ack_send: Callable[[], Any],
                ack_recv: Callable[[], Any], quick: bool) -> Case:
    """``IN_FLIGHT`` 8 B tensors one after the other, then an ack: raw vs a channel."""
    import torch

    t = torch.zeros(2)
    burst = comm.channel(_TAGS["burst"])
    raw = variants(comm, t, peer)["raw"]
    raw_ack = variants(comm, torch.zeros(1), peer)["raw"]
    iters = 2 if quick else 40
    return Case("burst", t.nbytes, {
        "raw": pair(rank, _repeat(raw.send), _repeat(raw.recv), raw_ack.send, raw_ack.recv,
                    blocking=True),
        "asyncomm": pair(rank, _repeat_awaited(functools.partial(burst.send, t, peer)),
                         _repeat_awaited(functools.partial(burst.recv, peer)), ack_send, ack_recv,
                         blocking=False),
    }, max(1, iters // 10), iters, IN_FLIGHT)


def _echo_class() -> type[Any]:
    """The actor of the ``actor`` and ``mesh`` rows (imports asyncomm, hence torch, when called)."""
    import asyncomm

    class Echo(asyncomm.Actor):
        @asyncomm.endpoint
        def echo(self, x: Any) -> Any:
            return x

    return Echo


def _actor_case(comm: Comm, rank: int, peer: int, quick: bool) -> Case:
    """Round trips of an actor call (rank 0 calls rank 1's echo) vs of a channel."""
    import torch

    t = torch.zeros(2)
    if rank == 1:
        comm.serve(_echo_class()(), "bench-echo")
    echo = comm.actor(1, "bench-echo").echo
    ch = comm.channel(_TAGS["echo"])

    warmup, iters = iterations(t.nbytes, quick)
    iters = max(2, iters // 2)
    return Case("actor", t.nbytes, {
        "channel": pair(rank, functools.partial(ch.send, t, peer), lambda: ch.recv(peer),
                        blocking=False),
        "actor call": Timed(functools.partial(echo, t) if rank == 0 else None, False),
    }, warmup, iters, 1.0)


async def _mesh_cases(comm: Comm, quick: bool) -> list[Case]:
    """Rank 0 calls every member of a mesh of the other ranks: one mesh call, against the
    same actor calls issued together (gathered), and one after another."""
    import torch

    t = torch.zeros(2)
    mesh = await comm.spawn(_echo_class(), name="bench-mesh", ranks=range(1, comm.size))
    refs = [mesh[r] for r in mesh.ranks]

    async def together() -> None:
        await asyncio.gather(*(ref.echo(t) for ref in refs))

    async def one_by_one() -> None:
        for ref in refs:
            await ref.echo(t)

    warmup, iters = iterations(t.nbytes, quick)
    iters = max(2, iters // 5)  # (each a round trip to every member)
    call = Timed(functools.partial(mesh.echo.call, t) if comm.rank == 0 else None, False)
    return [Case(test, t.nbytes, {"mesh call": call, name: Timed(
                 variant if comm.rank == 0 else None, False)}, warmup, iters, 1.0)
            for test, name, variant in (("mesh", "together", together),
                                        ("mesh-seq", "one by one", one_by_one))]


async def measure(comm: Comm, sizes: Sequence[int], rounds: int, quick: bool
                    ) -> list[Record]:
    """Measure channels beside their baselines; return rank 0's records (``[]`` elsewhere)."""
    records: list[Record] = []
    cases = _channel_cases(comm, sizes, quick)
    if comm.size >= 3:
        cases += await _mesh_cases(comm, quick)
    for case in cases:
        samples = await alternate(comm, case.variants, rounds, case.warmup, case.iters,
                                   case.prime)
        if comm.rank == 0:
            records.append(record(case, samples, comm.backend))
            progress(records[-1])
    await comm.barrier()  # members serve until rank 0 has made its last call
    return records


def record(case: Case, samples: dict[str, list[float]], backend: str = "gloo") -> Record:
    """Rank 0's record of one case, from its seconds per call, per variant and round."""
    ours, base, unit, target = CHANNEL_TESTS[case.test]
    target = BACKEND_TARGETS.get((case.test, case.size, backend), target)
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


def progress(rec: Record) -> None:
    print(f"bench: channels {rec['op']} {size_text(rec['size'])}: {rec['base']} "
          f"{value_text(rec['base_value'])} {rec['unit']}, {rec['compared']} "
          f"{value_text(rec['value'])} {rec['unit']}", file=sys.stderr, flush=True)


def table(records: Sequence[Record]) -> list[str]:
    m = records[0]
    lines = [f"channels: median of {m['rounds']} rounds; ping-pong: one-way latency; "
             f"stream: {IN_FLIGHT} x {size_text(STREAM_BYTES)} in flight; "
             f"rate: {IN_FLIGHT} dicts one after the other; burst: {IN_FLIGHT} x 8 B; "
             "actor, mesh: round trips (mesh: of every member)",
             f"{'test':<10}{'size':>8}{'unit':>7}{'baseline':>11}{'value':>10}"
             f"{'compared':>15}{'value':>10}{'ratio':>7}  target"]
    for r in records:
        target = "" if r["target"] is None else f"{r['target']}: {'met' if r['met'] else 'MISSED'}"
        lines.append(f"{r['op']:<10}{size_text(r['size']):>8}{r['unit']:>7}{r['base']:>11}"
                     f"{value_text(r['base_value']):>10}{r['compared']:>15}{value_text(r['value']):>10}"
                     f"{r['ratio']:>7.2f}  {target}".rstrip())
    return lines
