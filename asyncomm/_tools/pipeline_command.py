"""``asyncomm pipeline show NAME``: check a schedule, print its grid, bubble and peak memory."""

from __future__ import annotations

import argparse
import os
import sys

from asyncomm.pipeline._catalog import SCHEDULES, get
from asyncomm.pipeline._schedule import Schedule, parse
from asyncomm.pipeline._show import plot, render
from asyncomm.pipeline._simulate import simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``asyncomm pipeline`` and its ``show`` command on ``parser``."""
    commands = parser.add_subparsers(dest="pipeline_command", required=True)
    show = commands.add_parser(
        "show", help="print a schedule's step x rank grid, bubble and peak activations",
        description="Validate a pipeline schedule, simulate it, and print its step x rank grid "
        "(rows: time steps; cells: F3 / B3 = forward / backward of microbatch 3, with @sN "
        "naming the stage when ranks host several; blank: idle), its bubble fraction and its "
        "peak activations per rank.")
    show.add_argument("name", metavar="NAME",
                      help=f"a schedule ({', '.join(SCHEDULES)}) or a file holding one in text "
                      "form (one line per rank, e.g. 'F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0')")
    show.add_argument("--stages", type=int, metavar="S",
                      help="pipeline ranks (default 4); for gpipe, 1f1b and zbh1 also the "
                      "stages (one per rank); for interleaved the ranks, each hosting "
                      "--stages-per-rank virtual stages; zbv puts two stages on each rank, in a V")
    show.add_argument("--microbatches", type=int, metavar="M",
                      help="microbatches per step (default 8)")
    show.add_argument("--stages-per-rank", type=int, metavar="V",
                      help="interleaved only: virtual stages per rank (default 2)")
    show.add_argument("--f-cost", type=float, default=1.0, help="time of a forward (1)")
    show.add_argument("--b-cost", type=float, default=1.0,
                      help="time of a B, the input-gradient half of a backward (1)")
    show.add_argument("--w-cost", type=float, default=1.0,
                      help="time of a W, the weight-gradient half (1); a backward that is not "
                      "split (gpipe, 1f1b, interleaved) costs B + W")
    show.add_argument("--comm-cost", type=float, default=0.0, help="time of a message (0)")
    show.add_argument("--png", metavar="PATH", help="also write a Gantt chart to this PNG file")
    show.set_defaults(func=show_command)


def _schedule(args: argparse.Namespace) -> Schedule:
    if args.name.lower() in SCHEDULES:
        stages = 4 if args.stages is None else args.stages
        microbatches = 8 if args.microbatches is None else args.microbatches
        options = {}
        if args.stages_per_rank is not None:
            if args.name.lower() != "interleaved":
                raise ValueError("--stages-per-rank applies to the interleaved schedule only")
            options["stages_per_rank"] = args.stages_per_rank
        return get(args.name, stages, microbatches, **options)
    if not os.path.isfile(args.name):
        raise ValueError(f"{args.name!r} is neither a schedule ({', '.join(SCHEDULES)}) nor a file")
    with open(args.name, encoding="utf-8") as file:
        text = file.read()
    name = os.path.basename(args.name)
    schedule = parse(text, name=name, n_microbatches=args.microbatches)
    if args.stages is not None and args.stages != schedule.n_ranks:
        raise ValueError(f"--stages {args.stages}, but {name} has {schedule.n_ranks} ranks")
    if args.stages_per_rank is not None:
        n_stages = schedule.n_ranks * args.stages_per_rank
        schedule = parse(text, name=name, n_stages=n_stages, n_microbatches=args.microbatches)
    return schedule


def show_command(args: argparse.Namespace) -> int:
    """Run ``asyncomm pipeline show`` as parsed; return its exit code."""
    try:
        simulation = simulate(_schedule(args), args.f_cost, args.b_cost, args.comm_cost,
                              args.w_cost)
    except (ValueError, TypeError) as error:
        # ScheduleError is a ValueError: it names the rank, index and action at fault.
        print(f"asyncomm pipeline show: {error}", file=sys.stderr)
        return 2
    print(render(simulation))
    if args.png:
        try:
            plot(simulation, args.png)
        except ImportError:
            print("asyncomm pipeline show: --png needs matplotlib "
                  "(pip install 'asyncomm[plot]')", file=sys.stderr)
            return 2
        print(f"wrote {args.png}")
    return 0
