"""See a schedule: its step x rank grid as text, its Gantt chart as a PNG."""

from __future__ import annotations

import os

from asyncomm.pipeline._schedule import Op
from asyncomm.pipeline._simulate import Simulation


def _number(value: float) -> str:
    return f"{value:g}"


def render(simulation: Simulation, step: float | None = None) -> str:
    """Return the step x rank grid of ``simulation`` as text, with its bubble and peak.

    One row per time step (see :meth:`Simulation.grid`), one column per rank; an empty
    cell is a rank idle (or waiting for a message) during that step.

    Args:
        simulation: the timed run, as :func:`simulate` returns it.
        step: the time per row; default: :meth:`Simulation.step_size`.

    Raises:
        ValueError: ``step`` is not > 0.
    """
    schedule = simulation.schedule
    step = simulation.step_size() if step is None else step
    rows = simulation.grid(step)
    header = ["step", *(f"rank {rank}" for rank in range(schedule.n_ranks))]
    table = [header, *([str(index), *cells] for index, cells in enumerate(rows))]
    widths = [max(len(line[column]) for line in table) for column in range(len(header))]
    backward = (f"B={_number(simulation.b_cost)} W={_number(simulation.w_cost)}"
                if schedule.splits_backward
                else f"B+W={_number(simulation.b_cost + simulation.w_cost)}")
    lines = [f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_stages} stages, "
             f"{schedule.n_microbatches} microbatches; costs F={_number(simulation.f_cost)} "
             f"{backward} message={_number(simulation.comm_cost)}; "
             f"one row per {_number(step)} time"]
    for line in table:
        cells = [line[0].rjust(widths[0])]
        cells += [cell.ljust(width) for cell, width in zip(line[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines.append(f"bubble: {simulation.bubble:.1%} of rank time idle "
                 f"(makespan {_number(simulation.makespan)})")
    peaks = " ".join(str(peak) for peak in simulation.peak_activations)
    lines.append(f"peak activations per rank: {peaks}")
    return "\n".join(lines)


def plot(simulation: Simulation, path: str | os.PathLike[str]) -> None:
    """Write the Gantt chart of ``simulation`` to the PNG file ``path`` (matplotlib, Agg).

    Args:
        simulation: the timed run, as :func:`simulate` returns it.
        path: the file to write (replaced if it exists).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'asyncomm[plot]'``).
        OSError: ``path`` cannot be written.
    """
    # A bare Figure draws with Agg and leaves pyplot's global state (and any GUI) alone.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule = simulation.schedule
    n_ranks = schedule.n_ranks
    width = min(max(6.0, simulation.makespan * 0.35), 40.0)
    figure = Figure(figsize=(width, 1.2 + 0.55 * n_ranks))
    axes = figure.add_subplot()
    colors = {Op.F: "tab:blue", Op.B: "tab:orange", Op.W: "tab:green"}
    per_rank = schedule.stages_per_rank
    for rank, timeline in enumerate(simulation.timelines):
        for span in timeline:
            action = span.action
            if not action.op.is_compute or span.end <= span.start:
                continue
            # Later virtual stages of a rank in lighter shades.
            chunk = schedule.stages_of(rank).index(action.stage)
            alpha = 1.0 - 0.5 * chunk / max(per_rank - 1, 1)
            axes.broken_barh([(span.start, span.end - span.start)], (rank - 0.4, 0.8),
                             facecolors=colors[action.op], edgecolor="white", alpha=alpha)
            label = str(action.microbatch) if per_rank == 1 else (
                f"{action.microbatch}@s{action.stage}")
            axes.text((span.start + span.end) / 2, rank, label, ha="center", va="center",
                      fontsize=7, color="black")
    axes.set_yticks(range(n_ranks), [f"rank {rank}" for rank in range(n_ranks)])
    axes.set_ylim(n_ranks - 0.5, -0.5)
    axes.set_xlim(0, simulation.makespan)
    axes.set_xlabel("time")
    axes.set_title(f"{schedule.name}: {n_ranks} ranks, {schedule.n_stages} stages, "
                   f"{schedule.n_microbatches} microbatches; bubble {simulation.bubble:.1%}")
    kinds = [(Op.F, "forward"), (Op.B, "backward")]
    if schedule.splits_backward:
        kinds = [(Op.F, "forward"), (Op.B, "B: input gradient"), (Op.W, "W: weight gradient")]
    axes.legend(handles=[Patch(color=colors[op], label=label) for op, label in kinds],
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png", dpi=100)
