"""``asyncomm bench``: asyncomm beside the raw backend, side by side in one run.

``asyncomm bench SECTION`` starts N ranks with the launcher of ``asyncomm run``,
once per backend; each rank runs ``python -m asyncomm bench --worker ...``, and
rank 0 writes the records, which this process prints as tables. Sections, one
module each: ``core`` (``pingpong``, ``allreduce``, ``all``, ``idle``),
``channels``, ``gradsync``, ``pipeline``; ``soak`` (``asyncomm._tools.soak``)
checks a random mix of traffic instead of timing it. Several sections, comma
separated, run one after the other in one launch.

The workers also run under any launcher on their own, e.g. ``mpiexec -n 2 python
-m asyncomm bench --worker all``: rank 0 then prints the tables and writes the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncomm._tools.bench.channels import CHANNEL_SIZES
from asyncomm._tools.bench.core import DEFAULT_SIZES, IDLE_WAIT_S, QUICK_SIZES
from asyncomm._tools.bench.harness import KIB, MIB, Record

if TYPE_CHECKING:
    from asyncomm._comm import Comm

BACKENDS = ("gloo", "mpi")
# section -> the module that measures it (and renders its table); a record's "bench" is a
# section or a module's name, so ``SECTIONS.get(bench, bench)`` is the module that renders it
SECTIONS = {"pingpong": "core", "allreduce": "core", "all": "core", "idle": "core",
            "channels": "channels", "gradsync": "gradsync", "pipeline": "pipeline",
            "soak": "soak"}


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [s for s in chosen if s not in SECTIONS]
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown) or text!r}: "
                                         f"expected {', '.join(SECTIONS)}")
    if "soak" in chosen and len(chosen) > 1:
        raise argparse.ArgumentTypeError("soak runs alone")
    return chosen


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm bench`` on its subparser."""
    p.add_argument("what", nargs="?", default=("all",), type=_sections,
                   metavar="SECTION[,SECTION...]",
                   help="what to measure (default: all = pingpong and allreduce; idle: the "
                   "CPU a rank spends awaiting; channels: asyncomm channels beside the raw "
                   "backend; gradsync: GradSync beside DDP, and asyncomm.compute under an "
                   "all-reduce; pipeline: the pipeline executor against "
                   "torch.distributed.pipelining and the simulator's bubble; soak: a random "
                   "mix of traffic for --seconds, every result checked)")
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
                   help="write the records here (default bench-SECTION.json)")
    p.add_argument("--backend", choices=(*BACKENDS, "both"), default="gloo",
                   help="backend to measure; both: gloo, then mpi (default gloo)")
    p.add_argument("-n", "--nproc", type=_positive, default=2, metavar="N",
                   help="ranks (default 2)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # in each rank
    p.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=command)


def _sizes_for(args: argparse.Namespace, section: str) -> tuple[int, ...]:
    return tuple(args.sizes or (CHANNEL_SIZES if section == "channels" else
                                QUICK_SIZES if args.quick else DEFAULT_SIZES))


def _path(args: argparse.Namespace) -> Path:
    first = args.what[0]
    return Path(args.json or (f"bench-{first}.json" if first not in ("pingpong", "allreduce",
                                                                    "all") else "bench-core.json"))


def command(args: argparse.Namespace) -> int:
    """Run ``asyncomm bench`` as parsed: one launch per backend; return the exit code."""
    if args.worker:
        return _worker(args)
    from asyncomm._tools import mpiexec
    from asyncomm._tools.launch import launch

    if args.nproc < 2:
        print("asyncomm bench: -n must be at least 2", file=sys.stderr)
        return 2
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    records: list[Record] = []
    code = 0
    for backend in backends:
        if backend == "mpi" and mpiexec.find() is None:
            print("asyncomm bench: mpiexec not found; pip install 'asyncomm[mpi]'",
                  file=sys.stderr)
            code = code or 2
            continue
        if args.what == ("soak",):
            print(f"asyncomm bench soak: {backend}, {args.nproc} ranks", flush=True)
        # (a file beside the result, not a temporary directory: the launcher forks this
        # process, and its ranks would remove such a directory as they exit)
        part = _path(args).with_suffix(f".{backend}.part")
        argv = ["-m", "asyncomm", "bench", "--worker", ",".join(args.what),
                "--seconds", str(args.seconds), "--json", str(part), "--no-table",
                *(["--rounds", str(args.rounds)] if args.rounds else []),
                *(["--sizes", ",".join(map(str, args.sizes))] if args.sizes else []),
                *(["--quick"] if args.quick else [])]
        code = launch(argv, args.nproc, backend=backend, fork=True)  # (the command line's)
        if code != 0:
            break
        if args.what != ("soak",) and part.exists():  # soak says its own result
            mine = json.loads(part.read_text())
            part.unlink()
            print(table(mine) + "\n", flush=True)
            records += mine
    if records:
        path = _path(args)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {path}")
    return code


def _worker(args: argparse.Namespace) -> int:
    """Every rank's part: measure each section, then rank 0 reports."""
    import asyncomm

    if args.what == ("soak",):
        from asyncomm._tools import soak

        return soak.run(args.seconds)

    async def main(comm: Comm) -> list[Record]:
        from asyncomm._tools.bench import harness

        if comm.size < 2:
            raise SystemExit("asyncomm bench: needs at least 2 ranks")
        found: list[Record] = []
        for section in dict.fromkeys("all" if s in ("pingpong", "allreduce") and "all" in
                                     args.what else s for s in args.what):
            rounds = int(args.rounds or (3 if args.quick else 9 if section == "channels" else 5))
            meta = harness.meta(comm, rounds, args.quick)
            module = importlib.import_module(f"asyncomm._tools.bench.{SECTIONS[section]}")
            if section == "idle":
                measured = await module.idle(comm, IDLE_WAIT_S / 10 if args.quick
                                             else IDLE_WAIT_S)
            elif SECTIONS[section] == "core":
                ops = module.OPS if section == "all" else (section,)
                measured = await module.measure(comm, ops, _sizes_for(args, section), rounds,
                                                args.quick)
            elif section == "channels":
                measured = await module.measure(comm, _sizes_for(args, section), rounds,
                                                args.quick)
            else:
                measured = await module.measure(comm, rounds, args.quick)
            found += [{**meta, **record} for record in measured]
        return found

    records = asyncomm.run(main)
    if records:  # rank 0
        _path(args).write_text(json.dumps(records, indent=1) + "\n")
        if not args.no_table:
            print(table(records), flush=True)
    return 0


def table(records: Sequence[Record]) -> str:
    """Render one backend's records: a header, then each section's table."""
    if not records:
        return ""
    m = records[0]
    header = (f"backend {m['backend']}, {m['ranks']} ranks, loop {m['loop']}, "
              f"torch {m['torch']}, mpi4py {m['mpi4py'] or '-'}, python {m['python']}"
              + (f"\n{m['mpi_library']}" if m["mpi_library"] else ""))
    parts = [header]
    for section in dict.fromkeys(r["bench"] for r in records):
        mine = [r for r in records if r["bench"] == section]
        module = importlib.import_module(f"asyncomm._tools.bench.{SECTIONS.get(section, section)}")
        parts.append("\n".join(module.table(mine)))
    return "\n".join(parts)
