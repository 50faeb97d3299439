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

The workers also run under any launcher on their own, e.g.
``mpiexec -n 2 python -m asyncomm._bench all``: rank 0 then prints the table and writes
the JSON itself.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
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
from typing import Any

import torch

from asyncomm._comm import Comm

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


def iterations(size: int, quick: bool = False) -> tuple[int, int]:
    """Warm-up and timed iterations for a message of ``size`` bytes (fewer as it grows)."""
    iters = max(4, min(1000, (64 * MIB) // size))
    if quick:
        iters = max(2, iters // 10)
    return max(1, iters // 10), iters


async def _core(comm: Comm, ops: Sequence[str], sizes: Sequence[int], rounds: int,
                quick: bool) -> list[Record]:
    """Measure every (op, size, variant); return rank 0's records (``[]`` elsewhere)."""
    records: list[Record] = []
    peer = 1 - comm.rank if comm.rank < 2 else 0
    for op in ops:
        for size in sizes:
            calls = _variants(comm, torch.zeros(size // 4), peer)
            warmup, iters = iterations(size, quick)
            samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for r in range(rounds):
                for variant in VARIANTS[r % 3:] + VARIANTS[: r % 3]:  # rotate: no fixed order
                    await comm.barrier()
                    step = _step(op, calls[variant], comm.rank)
                    if step is not None:
                        per_call = await _seconds_per_call(step, calls[variant].blocking,
                                                           warmup, iters)
                        samples[variant].append(per_call / (2 if op == "pingpong" else 1))
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


def _meta(comm: Comm, rounds: int, quick: bool) -> Record:
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
    p.add_argument("what", nargs="?", default="all", choices=(*OPS, "all", "idle"),
                   help="what to measure (default: all = pingpong and allreduce)")
    p.add_argument("--sizes", type=_sizes, metavar="BYTES,...",
                   help="message sizes (suffixes K, M allowed); default 8 B to 16 MiB")
    p.add_argument("--rounds", type=_positive, metavar="R",
                   help="rounds per variant (default 5, 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="sizes 8 B and 1 MiB, fewer iterations and rounds, idle waits 0.5 s "
                   "(a smoke test)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write the records here (default bench-core.json, or bench-idle.json)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm bench`` on its subparser."""
    _options(p)
    p.add_argument("--backend", choices=(*BACKENDS, "both"), default="gloo",
                   help="backend to measure; both: gloo, then mpi (default gloo)")
    p.add_argument("-n", "--nproc", type=_positive, default=2, metavar="N",
                   help="ranks (default 2)")
    p.set_defaults(func=command)


def _settings(args: argparse.Namespace) -> tuple[tuple[int, ...], int, Path]:
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    rounds = args.rounds or (3 if args.quick else 5)
    path = args.json or Path("bench-idle.json" if args.what == "idle" else "bench-core.json")
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
    wait_s = IDLE_WAIT_S / 4 if args.quick else IDLE_WAIT_S
    ops = OPS if args.what == "all" else (args.what,)

    async def main(comm: Comm) -> list[Record]:
        if comm.size < 2:
            raise SystemExit("asyncomm bench: needs at least 2 ranks")
        meta = _meta(comm, rounds, args.quick)
        found = await (_idle(comm, wait_s) if args.what == "idle"
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
