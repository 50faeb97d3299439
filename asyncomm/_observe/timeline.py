"""Read the ranks' trace files: one Chrome/Perfetto trace, overlap metrics, a PNG timeline.

Note on rows
------------
Trace viewers draw the complete ("X") events of one thread as a stack, so events of one
thread must nest. Operations in flight together do not, so each rank's communication is
spread over as few rows (tids) as keep every row free of overlaps, and so is compute.
Compute rows are tids 1, 2, ...; communication rows start at tid 100.

Note on the metrics
-------------------
Per rank, as docs/tracing.md defines them: lengths of unions of spans (concurrent spans
count once) and of the intersection of the communication and compute unions (hidden).
Communication under compute is hidden only while it progressed: where a rank reported a
stall under compute (MPI requests in flight that nothing tested: ``_core.polling``'s note
on stalls), its communication is neither hidden nor exposed, but stalled (its cost comes
later, as exposed time); a stall with no compute running is exposed, as the step pays it.
Nor does compute on the thread that tests those requests hide them: what a test moves
there lengthens the computation as much as it shortens the wait.
Waits that a rank reported inside its compute spans (DDP's backward waiting for its
all-reduces: ``trace.ddp``) are taken out of its compute.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncomm._observe.recorder import FORMAT

Interval = tuple[float, float]

COMPUTE_TID = 1
WAIT_TID = 98
STALL_TID = 99
COMM_TID = 100
_COMM_CATS = ("op", "channel", "actor", "torch")
# Kinds that synchronise rather than move data: left out of the overlap figures by default
# (a barrier "hidden" under compute says nothing of how data moved).
SYNC_KINDS = frozenset({"barrier"})


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Return the union of ``intervals`` as sorted, disjoint intervals.

    Args:
        intervals: ``(start, end)`` pairs; empty ones (``end <= start``) are left out.

    Returns:
        The union, sorted, intervals that touch or overlap joined into one.
    """
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    """Return the total length of the union of ``intervals``.

    Args:
        intervals: ``(start, end)`` pairs (as :func:`union` takes them).

    Returns:
        The length covered, each stretch counted once.
    """
    return sum(end - start for start, end in union(intervals))


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Return the union of ``a`` less the union of ``b``, sorted and disjoint.

    Args:
        a: ``(start, end)`` pairs to cut from.
        b: ``(start, end)`` pairs to cut out.

    Returns:
        The intervals covered by ``a`` and not by ``b``.
    """
    out: list[Interval] = []
    cut, first = union(b), 0
    for start, end in union(a):
        while first < len(cut) and cut[first][1] <= start:
            first += 1
        for cut_start, cut_end in cut[first:]:
            if cut_start >= end:
                break
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
        if start < end:
            out.append((start, end))
    return out


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Return the intersection of the unions of ``a`` and ``b``, sorted and disjoint.

    Args:
        a: ``(start, end)`` pairs.
        b: ``(start, end)`` pairs.

    Returns:
        The intervals covered by both ``a`` and ``b``.
    """
    left = union(a)
    return subtract(left, subtract(left, b))


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's communication ran under compute (seconds).

    Attributes:
        communication: time communication was in flight and progressing.
        compute: time compute ran.
        hidden: communication time under compute.
        exposed: communication time with no compute running (``communication - hidden``).
        spans: how many communication spans were recorded.
        stalled: time communication was in flight under compute and not progressing
            (counted in none of the above).
    """

    communication: float  # in flight and progressing
    compute: float
    hidden: float
    exposed: float
    spans: int  # communication spans recorded
    stalled: float = 0.0  # in flight under compute, not progressing (not in the above)

    @property
    def hidden_fraction(self) -> float:
        """Return hidden / communication (0 without communication)."""
        return self.hidden / self.communication if self.communication > 0 else 0.0


def measure(communication: Iterable[Interval], compute: Iterable[Interval],
            stalled: Iterable[Interval] = (), holding: Iterable[Interval] = ()) -> Overlap:
    """Return the overlap metrics of communication and compute spans (seconds, as every
    figure of a trace; any one unit gives its figures in that unit).

    Args:
        communication: the communication spans, ``(start, end)`` each.
        compute: the compute spans.
        stalled: when communication did not progress: under compute, it counts only as
            stalled there.
        holding: compute on the thread that makes communication progress (a part of
            ``compute``): communication under it counts only as stalled.

    Returns:
        The metrics, an :class:`Overlap`.
    """
    spans = list(communication)
    every = union(spans)
    work = union(compute)
    comm = subtract(every, union(intersect(intersect(every, stalled), work)
                                 + intersect(every, holding)))
    total = length(comm)
    hidden = length(intersect(comm, work))
    return Overlap(communication=total, compute=length(work), hidden=hidden,
                   exposed=total - hidden, spans=len(spans), stalled=length(every) - total)


def load(directory: str | Path) -> list[dict[str, Any]]:
    """Read every rank's file of a trace directory, in rank order.

    Args:
        directory: the trace directory, holding the ranks' ``rank*.json`` files.

    Returns:
        Each file's contents, by rank (files of no rank last, by process id).

    Raises:
        FileNotFoundError: the directory holds no rank files.
        ValueError: a file is not an asyncomm trace (or not JSON).
    """
    files = sorted(Path(directory).glob("rank*.json"))
    ranks: list[dict[str, Any]] = []
    for path in files:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path} is not an asyncomm trace file")
        ranks.append(doc)
    if not ranks:
        raise FileNotFoundError(f"no rank*.json trace files in {directory}")
    ranks.sort(key=lambda doc: (doc["rank"] is None, doc["rank"] or 0, doc["pid"]))
    return ranks


def _clock(ranks: Sequence[dict[str, Any]]) -> list[float]:
    """Return, per rank, what to add to its perf_counter times to share one time base: one
    host shares its monotonic clock, as is; across hosts, go through each rank's anchor."""
    if len({doc["host"] for doc in ranks}) == 1:
        return [0.0] * len(ranks)
    return [doc["anchor"]["wall_ns"] / 1e9 - doc["anchor"]["perf_counter"] for doc in ranks]


def _rows(spans: list[dict[str, Any]], base: int) -> None:
    """Give each span a ``tid`` from ``base`` on so that spans of a row never overlap."""
    ends: list[float] = []  # per row, the end of its last span
    for span in sorted(spans, key=lambda s: (s["start"], -s["end"])):
        row = next((i for i, end in enumerate(ends) if end <= span["start"]), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = span["end"]
        span["tid"] = base + row


def merge(directory: str | Path) -> dict[str, Any]:
    """Merge a trace directory's rank files into one Chrome/Perfetto trace-event object.

    Complete ("X") events, ``pid`` = rank, compute and communication on separate rows
    (``tid``); ``ts``/``dur`` in microseconds from the earliest event. Operations that never
    completed are left out.

    Args:
        directory: the trace directory, as :func:`load` reads it.

    Returns:
        The trace: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``,
        to write as JSON.

    Raises:
        FileNotFoundError, ValueError: as :func:`load`.
    """
    ranks = load(directory)
    offsets = _clock(ranks)
    pids = [doc["rank"] if doc["rank"] is not None else doc["pid"] for doc in ranks]
    spans: dict[int, list[dict[str, Any]]] = {}  # per pid, its completed events, time-shifted
    for doc, offset, pid in zip(ranks, offsets, pids, strict=True):
        spans.setdefault(pid, []).extend(
            {**event, "start": event["start"] + offset, "end": event["end"] + offset}
            for event in doc["events"] if event["end"] is not None)
    zero = min((span["start"] for own in spans.values() for span in own), default=0.0)
    events: list[dict[str, Any]] = []
    for pid in pids:
        mine = [span for span in spans[pid] if span["cat"] != "step"]
        compute = [s for s in mine if s["cat"] == "compute"]
        comm = [s for s in mine if s["cat"] not in ("compute", "stall", "wait")]
        _rows(compute, COMPUTE_TID)
        _rows(comm, COMM_TID)
        for span in mine:
            if span["cat"] in ("stall", "wait"):
                span["tid"] = STALL_TID if span["cat"] == "stall" else WAIT_TID
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for tid in sorted({s["tid"] for s in mine}):
            row = (f"compute {tid - COMPUTE_TID}" if tid < WAIT_TID
                  else "waiting, not compute" if tid == WAIT_TID
                  else "in flight, not progressing" if tid == STALL_TID
                  else f"communication {tid - COMM_TID}")
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": row}})
        for span in mine:
            events.append(_event(pid, span, zero))
        for index, mark in enumerate(s for s in spans[pid] if s["cat"] == "step"):
            events.append({"name": f"step {index}", "cat": "step", "ph": "i", "s": "p",
                           "pid": pid, "tid": COMPUTE_TID, "ts": (mark["start"] - zero) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "asyncomm", "ranks": len(ranks),
                          "clock": "monotonic" if not any(offsets) else "wall"}}


def _event(pid: int, span: dict[str, Any], zero: float) -> dict[str, Any]:
    if span["cat"] in ("compute", "stall", "wait"):
        name = span["name"] if span["cat"] != "stall" else "stalled"
        args = {"thread": span["thread"]} if "thread" in span else {}
    else:
        name = span["name"] or span["kind"]
        args = {key: span[key] for key in ("kind", "bytes", "peer", "tag", "seq", "comm",
                                           "error") if span.get(key) is not None}
    return {"name": name, "cat": span["cat"], "ph": "X", "pid": pid, "tid": span["tid"],
            "ts": (span["start"] - zero) * 1e6, "dur": (span["end"] - span["start"]) * 1e6,
            "args": args}


Spans = dict[int, list[Interval]]  # per rank


def _spans(trace: dict[str, Any], us_per_unit: float, sync: bool = False
           ) -> tuple[Spans, Spans, Spans, Spans]:
    """Return each rank's communication (with barriers where ``sync``), compute (less its
    waits), stall spans and compute on the thread that reported stalls (see the note on the
    metrics) of a merged trace, in units of ``us_per_unit`` microseconds."""
    comm: Spans = {}
    work: Spans = {}
    stalls: Spans = {}
    waits: Spans = {}
    testers = {(e["pid"], e["args"]["thread"]) for e in trace["traceEvents"]
               if e.get("cat") == "stall" and "thread" in e.get("args", {})}
    holding: Spans = {}
    into_cat = {"compute": work, "stall": stalls, "wait": waits}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        moved = event["cat"] in _COMM_CATS and (sync or event["args"].get("kind")
                                                not in SYNC_KINDS)
        into = into_cat.get(event["cat"], comm if moved else None)
        if into is not None:
            start = event["ts"] / us_per_unit
            span = (start, start + event["dur"] / us_per_unit)
            into.setdefault(event["pid"], []).append(span)
            if into is work and (event["pid"], event["args"].get("thread")) in testers:
                holding.setdefault(event["pid"], []).append(span)
    work = {pid: subtract(spans, waits.get(pid, [])) for pid, spans in work.items()}
    return comm, work, stalls, holding


def overlap(trace: dict[str, Any], sync: bool = False) -> dict[int, Overlap]:
    """Return each rank's overlap metrics (seconds) from a merged trace.

    Args:
        trace: a merged trace, as :func:`merge` returns it.
        sync: count barriers as communication too.

    Returns:
        Per rank, in rank order, its :class:`Overlap`.
    """
    comm, work, stalls, holding = _spans(trace, 1e6, sync)
    return {pid: measure(comm.get(pid, []), work.get(pid, []), stalls.get(pid, []),
                         holding.get(pid, []))
            for pid in sorted(comm.keys() | work.keys())}


def steps(trace: dict[str, Any], sync: bool = False) -> dict[int, list[Overlap]]:
    """Return each rank's overlap metrics (seconds) per step: from each of its
    ``trace.step()`` marks to its next (the last step ends at its last span).

    Args:
        trace: a merged trace, as :func:`merge` returns it.
        sync: count barriers as communication too.

    Returns:
        Per rank that marked steps, an :class:`Overlap` for each of its steps, in order.
    """
    comm, work, stalls, holding = _spans(trace, 1e6, sync)
    found: dict[int, list[Overlap]] = {}
    for pid, marks in _marks(trace).items():
        end = max((e for _, e in comm.get(pid, []) + work.get(pid, [])), default=marks[-1])
        windows = list(zip(marks, [*marks[1:], max(end, marks[-1])], strict=True))
        found[pid] = [measure(intersect(comm.get(pid, []), [window]),
                              intersect(work.get(pid, []), [window]), stalls.get(pid, []),
                              holding.get(pid, []))
                      for window in windows]
    return found


def _marks(trace: dict[str, Any]) -> dict[int, list[float]]:
    """Each rank's step marks, in seconds, in order."""
    marks: dict[int, list[float]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "i" and event.get("cat") == "step":
            marks.setdefault(event["pid"], []).append(event["ts"] / 1e6)
    return {pid: sorted(times) for pid, times in marks.items()}


def window(trace: dict[str, Any], first: int, last: int) -> Interval:
    """The time (seconds) from the earliest rank's start of step ``first`` to the latest
    rank's start of step ``last + 1`` (or its last span).

    Args:
        trace: a merged trace, as :func:`merge` returns it.
        first: the first step, counted from 0 (``trace.step()`` marks).
        last: the last step, ``first`` or later.

    Returns:
        ``(start, end)``, in seconds, as :func:`draw`'s ``panels`` take it.

    Raises:
        ValueError: ``first`` is negative, ``last`` is before it, or a rank marked no step
            ``first`` (or the trace marks no steps).
    """
    marks = _marks(trace)
    if not marks or first < 0 or last < first or any(len(m) <= first for m in marks.values()):
        raise ValueError(f"steps {first}..{last}: the trace marks "
                         f"{min((len(m) for m in marks.values()), default=0)} steps per rank "
                         "(asyncomm.trace.step())")
    comm, work, _, _ = _spans(trace, 1e6, sync=True)
    ends = [max((e for _, e in comm.get(p, []) + work.get(p, [])), default=m[-1])
            for p, m in marks.items()]
    stops = [m[last + 1] if last + 1 < len(m) else end
             for m, end in zip(marks.values(), ends, strict=True)]
    return min(m[first] for m in marks.values()), max(stops)


def report(metrics: dict[int, Overlap]) -> str:
    """Return the metrics as a table, one row per rank, in milliseconds.

    Args:
        metrics: per rank, its :class:`Overlap` (as :func:`overlap` returns them).

    Returns:
        The table, a header line then the rows, in ``metrics``' order.
    """
    lines = [f"{'rank':>4}  {'spans':>6}  {'comm ms':>10}  {'hidden ms':>10}  "
             f"{'exposed ms':>10}  {'compute ms':>10}  {'stalled ms':>10}  {'hidden':>6}"]
    for rank, m in metrics.items():
        lines.append(f"{rank:>4}  {m.spans:>6}  {m.communication * 1e3:>10.3f}  "
                     f"{m.hidden * 1e3:>10.3f}  {m.exposed * 1e3:>10.3f}  "
                     f"{m.compute * 1e3:>10.3f}  {m.stalled * 1e3:>10.3f}  "
                     f"{m.hidden_fraction:>6.0%}")
    return "\n".join(lines)


def draw(trace: dict[str, Any], path: str | Path, title: str | None = None,
         panels: Sequence[tuple[str, Interval]] = ()) -> Path:
    """Draw a PNG timeline of a merged trace: a row per rank, compute above communication.

    Each row shows the union of the rank's compute spans in one colour, of its transfers
    (ops, channels, actors, torch's own collectives) in another, of its barriers in a third
    and, in a fourth, the communication in flight that was not progressing (stalls).

    Args:
        trace: a merged trace, as :func:`merge` returns it.
        path: the PNG file to write.
        title: a title over the figure (None: none).
        panels: ``(label, (start, end))`` pairs, in seconds (as :func:`window` gives): each
            such time is drawn beside the others, from its own start; empty: the whole run.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'asyncomm[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    comm, work, stalls, holding = _spans(trace, 1e3)
    every, _, _, _ = _spans(trace, 1e3, sync=True)
    ranks = sorted(every.keys() | work.keys())
    shown: list[tuple[str, Interval | None]] = (
        [(label, (a * 1e3, b * 1e3)) for label, (a, b) in panels] or [(title or "", None)])
    figure, axes = plt.subplots(1, len(shown), squeeze=False, sharey=True,
                                figsize=(6 + 6 * len(shown), 1.0 + 0.7 * max(1, len(ranks))))
    for axis, (label, within) in zip(axes[0], shown, strict=True):
        zero = within[0] if within is not None else 0.0
        for row, rank in enumerate(ranks):
            stalled = stalls.get(rank, []) + holding.get(rank, [])
            for spans, low, colour in (
                    (work.get(rank, []), row - 0.40, "tab:blue"),
                    (every.get(rank, []), row + 0.05, "tab:gray"),
                    (subtract(comm.get(rank, []), stalled), row + 0.05, "tab:orange"),
                    (intersect(every.get(rank, []), stalled), row + 0.05, "tab:red")):
                bars = [(start - zero, max(end - start, 1e-6)) for start, end in union(spans)]
                if bars:
                    axis.broken_barh(bars, (low, 0.35), facecolors=colour)
        if within is not None:
            axis.set_xlim(0.0, within[1] - within[0])
        axis.set_xlabel("time (ms)" if within is None else "ms from the window's start")
        axis.set_title(label)
    axes[0][0].set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes[0][0].set_ylim(-0.6, len(ranks) - 0.4)
    axes[0][0].invert_yaxis()
    if panels and title:
        figure.suptitle(title)
    axes[0][-1].legend(handles=[
        matplotlib.patches.Patch(color="tab:blue", label="compute"),
        matplotlib.patches.Patch(color="tab:orange", label="transfers"),
        matplotlib.patches.Patch(color="tab:gray", label="barriers"),
        matplotlib.patches.Patch(color="tab:red", label="in flight, not progressing")],
        loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def summarise(directory: str | Path, json_path: str | Path | None = None,
              png_path: str | Path | None = None,
              chosen: Sequence[tuple[int, int]] = ()) -> dict[int, Overlap]:
    """Merge a trace directory, write its trace JSON and PNG, print and return its metrics.

    Without matplotlib no PNG is drawn.

    Args:
        directory: the trace directory, as :func:`load` reads it.
        json_path: where to write the merged trace (None: ``trace.json`` in ``directory``).
        png_path: where to draw the timeline (None: ``timeline.png`` in ``directory``).
        chosen: ranges of steps, ``(first, last)`` (see ``trace.step``): their figures are
            printed too, rank by rank, and the PNG shows only them, each beside the others.

    Returns:
        Per rank, its :class:`Overlap` over the whole run.

    Raises:
        FileNotFoundError, ValueError: as :func:`load`, and :func:`window`.
    """
    trace = merge(directory)
    panels = [(f"steps {first} to {last}", window(trace, first, last))
              for first, last in chosen]
    out = Path(json_path) if json_path is not None else Path(directory) / "trace.json"
    out.write_text(json.dumps(trace))
    metrics = overlap(trace)
    print(report(metrics))
    per_rank = steps(trace) if chosen else {}
    for first, last in chosen:
        for rank, per_step in per_rank.items():
            for index in range(first, min(last + 1, len(per_step))):
                m = per_step[index]
                print(f"rank {rank} step {index}: comm {m.communication * 1e3:.3f} ms, hidden "
                      f"{m.hidden * 1e3:.3f} ms, exposed {m.exposed * 1e3:.3f} ms, compute "
                      f"{m.compute * 1e3:.3f} ms, stalled {m.stalled * 1e3:.3f} ms")
    print(f"trace: {out} (open in https://ui.perfetto.dev or chrome://tracing)")
    try:
        png = draw(trace, png_path if png_path is not None else Path(directory) / "timeline.png",
                   None, panels)
    except ImportError:
        print("timeline: not drawn (pip install 'asyncomm[plot]' for the PNG)")
    else:
        print(f"timeline: {png}")
    return metrics
