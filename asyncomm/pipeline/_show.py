"""See a schedule: its step x rank grid as text, its Gantt chart as a PNG, and the command
``asyncomm pipeline show``.
"""

from __future__ import annotations

import argparse
import os
import sys

from asyncomm.pipeline._schedule import SCHEDULES, Op, Schedule, get, parse
from asyncomm.pipeline._simulate import Simulation, simulate


def _number(value: float) -> str:
    return f"{value:g}"


def render(simulation: Simulation, step: float | None = None) -> str:
    """Return the step x rank grid of ``simulation`` as text, with its bubble and peak.

    One row per time step (see :meth:`Simulation.grid`), one column per rank; an empty
    cell is a rank idle (or waiting for a message) during that step.
    """
    schedule = simulation.schedule
    step = simulation.step_size() if step is None else step
    rows = simulation.grid(step)
    header = ["step", *(f"rank {rank}" for rank in range(schedule.n_ranks))]
    table = [header, *([str(index), *cells] for index, cells in enumerate(rows))]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    lines = [
        f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, "
        f"{schedule.n_microbatches} microbatches; costs F={_number(simulation.f_cost)} "
        f"B={_number(simulation.b_cost)} message={_number(simulation.comm_cost)}; "
        f"one row per {_number(step)} time"
    ]
    for line in table:
        cells = [line[0].rjust(widths[0])]
        cells += [cell.ljust(width) for cell, width in zip(line[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"bubble: {simulation.bubble:.1%} of rank time idle "
        f"(makespan {_number(simulation.makespan)})"
    )
    peaks = " ".join(str(peak) for peak in simulation.peak_activations)
    lines.append(f"peak activations per rank: {peaks}")
    return "\n".join(lines)


def plot(simulation: Simulation, path: str | os.PathLike[str]) -> None:
    """Write the Gantt chart of ``simulation`` to the PNG file ``path`` (matplotlib, Agg)."""
    # A bare Figure draws with Agg and leaves pyplot's global state (and any GUI) alone.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule = simulation.schedule
    n_ranks = schedule.n_ranks
    width = min(max(6.0, simulation.makespan * 0.35), 40.0)
    figure = Figure(figsize=(width, 1.2 + 0.55 * n_ranks))
    axes = figure.add_subplot()
    colors = {Op.F: "tab:blue", Op.B: "tab:orange"}
    per_rank = schedule.stages_per_rank
    for rank, timeline in enumerate(simulation.timelines):
        for span in timeline:
            action = span.action
            if not action.op.is_compute or span.end <= span.start:
                continue
            # Later virtual stages of a rank in lighter shades.
            chunk = action.stage // n_ranks
            alpha = 1.0 - 0.5 * chunk / max(per_rank - 1, 1)
            axes.broken_barh(
                [(span.start, span.end - span.start)],
                (rank - 0.4, 0.8),
                facecolors=colors[action.op],
                edgecolor="white",
                alpha=alpha,
            )
            label = (
                str(action.microbatch) if per_rank == 1 else f"{action.microbatch}@s{action.stage}"
            )
            axes.text(
                (span.start + span.end) / 2,
                rank,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="black",
            )
    axes.set_yticks(range(n_ranks), [f"rank {rank}" for rank in range(n_ranks)])
    axes.set_ylim(n_ranks - 0.5, -0.5)
    axes.set_xlim(0, simulation.makespan)
    axes.set_xlabel("time")
    axes.set_title(
        f"{schedule.name}: {n_ranks} ranks, {schedule.n_stages} stages, "
        f"{schedule.n_microbatches} microbatches; bubble {simulation.bubble:.1%}"
    )
    axes.legend(
        handles=[
            Patch(color=colors[Op.F], label="forward"),
            Patch(color=colors[Op.B], label="backward"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png", dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``asyncomm pipeline`` and its ``show`` command on ``parser``."""
    commands = parser.add_subparsers(dest="pipeline_command", required=True)
    show = commands.add_parser(
        "show",
        help="print a schedule's step x rank grid, bubble and peak activations",
        description=(
            "Validate a pipeline schedule, simulate it, and print its step x rank grid "
            "(rows: time steps; cells: F3 / B3 = forward / backward of microbatch 3, with "
            "@sN naming the stage when ranks host several; blank: idle), its bubble "
            "fraction and its peak activations per rank."
        ),
    )
    show.add_argument(
        "name",
        metavar="NAME",
        help=f"a schedule ({', '.join(SCHEDULES)}) or a file holding one in text form "
        "(one line per rank, e.g. 'F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0')",
    )
    show.add_argument(
        "--stages",
        type=int,
        metavar="S",
        help="pipeline ranks; for gpipe and 1f1b also the stages (one per rank); for "
        "interleaved the ranks, each hosting --stages-per-rank virtual stages",
    )
    show.add_argument("--microbatches", type=int, metavar="M", help="microbatches per step")
    show.add_argument(
        "--stages-per-rank",
        type=int,
        metavar="V",
        help="interleaved only: virtual stages per rank (default 2)",
    )
    show.add_argument("--f-cost", type=float, default=1.0, help="time of a forward (1)")
    show.add_argument("--b-cost", type=float, default=2.0, help="time of a backward (2)")
    show.add_argument("--comm-cost", type=float, default=0.0, help="time of a message (0)")
    show.add_argument("--png", metavar="PATH", help="also write a Gantt chart to this PNG file")
    show.set_defaults(func=show_command)


def _schedule(args: argparse.Namespace) -> Schedule:
    if args.name.lower() in SCHEDULES:
        if args.stages is None or args.microbatches is None:
            raise ValueError(f"{args.name} needs --stages and --microbatches")
        options = {}
        if args.stages_per_rank is not None:
            if args.name.lower() != "interleaved":
                raise ValueError("--stages-per-rank applies to the interleaved schedule only")
            options["stages_per_rank"] = args.stages_per_rank
        return get(args.name, args.stages, args.microbatches, **options)
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
        simulation = simulate(_schedule(args), args.f_cost, args.b_cost, args.comm_cost)
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
