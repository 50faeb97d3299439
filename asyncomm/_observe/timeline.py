"""Read the ranks' trace files: one Chrome/Perfetto trace, overlap metrics, a PNG timeline.

Note on lanes
-------------
Trace viewers draw the complete ("X") events of one thread as a stack, so events of one
thread must nest. Operations in flight together do not, so each rank's communication is
spread over as few lanes (tids) as keep every lane free of overlaps, and so is compute.
Compute lanes are tids 1, 2, ...; communication lanes start at tid 100.

Note on the metrics
-------------------
Per rank, as docs/tracing.md defines them: lengths of unions of spans (concurrent spans
count once) and of the intersection of the communication and compute unions (hidden).
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
COMM_TID = 100
_COMM_CATS = ("op", "channel", "actor", "torch")
# Kinds that synchronise rather than move data: left out of the overlap figures by default
# (a barrier "hidden" under compute says nothing of how data moved).
SYNC_KINDS = frozenset({"barrier"})


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Return the union of ``intervals`` as sorted, disjoint intervals."""
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
    """Return the total length of the union of ``intervals``."""
    return sum(end - start for start, end in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Return the intersection of the unions of ``a`` and ``b``, sorted and disjoint."""
    left, right = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(left) and j < len(right):
        start = max(left[i][0], right[j][0])
        end = min(left[i][1], right[j][1])
        if start < end:
            out.append((start, end))
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class Overlap:
    """How much of one rank's communication ran under compute (seconds)."""

    communication: float
    compute: float
    hidden: float
    exposed: float
    spans: int  # communication spans recorded

    @property
    def hidden_fraction(self) -> float:
        """Return hidden / communication (0 without communication)."""
        return self.hidden / self.communication if self.communication > 0 else 0.0


def measure(communication: Iterable[Interval], compute: Iterable[Interval]) -> Overlap:
    """Return the overlap metrics of communication and compute spans (seconds, as every
    figure of a trace; any one unit gives its figures in that unit)."""
    spans = list(communication)
    comm = union(spans)
    work = union(compute)
    total = sum(end - start for start, end in comm)
    hidden = sum(end - start for start, end in intersect(comm, work))
    return Overlap(communication=total, compute=sum(end - start for start, end in work),
                   hidden=hidden, exposed=total - hidden, spans=len(spans))


def load(directory: str | Path) -> list[dict[str, Any]]:
    """Read every rank's file of a trace directory, in rank order.

    Raises:
        FileNotFoundError: the directory holds no rank files.
        ValueError: a file is not an asyncomm trace.
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


def _lanes(spans: list[dict[str, Any]], base: int) -> None:
    """Give each span a ``tid`` from ``base`` on so that spans of a lane never overlap."""
    ends: list[float] = []  # per lane, the end of its last span
    for span in sorted(spans, key=lambda s: (s["start"], -s["end"])):
        lane = next((i for i, end in enumerate(ends) if end <= span["start"]), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = span["end"]
        span["tid"] = base + lane


def merge(directory: str | Path) -> dict[str, Any]:
    """Merge a trace directory's rank files into one Chrome/Perfetto trace-event object.

    Complete ("X") events, ``pid`` = rank, compute and communication on separate lanes
    (``tid``); ``ts``/``dur`` in microseconds from the earliest event. Operations that never
    completed are left out.

    Raises:
        FileNotFoundError, ValueError: as :func:`load`.
    """
    ranks = load(directory)
    offsets = _clock(ranks)
    spans: list[tuple[int, dict[str, Any]]] = []
    for doc, offset in zip(ranks, offsets, strict=True):
        pid = doc["rank"] if doc["rank"] is not None else doc["pid"]
        for event in doc["events"]:
            if event["end"] is None:
                continue
            spans.append((pid, {**event, "start": event["start"] + offset,
                                "end": event["end"] + offset}))
    zero = min((span["start"] for _, span in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for doc in ranks:
        pid = doc["rank"] if doc["rank"] is not None else doc["pid"]
        mine = [span for p, span in spans if p == pid and span["cat"] != "step"]
        compute = [s for s in mine if s["cat"] == "compute"]
        comm = [s for s in mine if s["cat"] != "compute"]
        _lanes(compute, COMPUTE_TID)
        _lanes(comm, COMM_TID)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        for tid in sorted({s["tid"] for s in mine}):
            lane = (f"compute {tid - COMPUTE_TID}" if tid < COMM_TID
                    else f"communication {tid - COMM_TID}")
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": lane}})
        for span in mine:
            events.append(_event(pid, span, zero))
        for index, mark in enumerate(s for p, s in spans if p == pid and s["cat"] == "step"):
            events.append({"name": f"step {index}", "cat": "step", "ph": "i", "s": "p",
                           "pid": pid, "tid": COMPUTE_TID, "ts": (mark["start"] - zero) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "asyncomm", "ranks": len(ranks),
                          "clock": "monotonic" if not any(offsets) else "wall"}}


def _event(pid: int, span: dict[str, Any], zero: float) -> dict[str, Any]:
    if span["cat"] == "compute":
        name, args = span["name"], {}
    else:
        name = span["name"] or span["kind"]
        args = {key: span[key] for key in ("kind", "bytes", "peer", "tag", "seq", "comm",
                                           "error") if span.get(key) is not None}
    return {"name": name, "cat": span["cat"], "ph": "X", "pid": pid, "tid": span["tid"],
            "ts": (span["start"] - zero) * 1e6, "dur": (span["end"] - span["start"]) * 1e6,
            "args": args}


def _spans(trace: dict[str, Any], us_per_unit: float, sync: bool = False
           ) -> tuple[dict[int, list[Interval]], dict[int, list[Interval]]]:
    """Return each rank's communication (with barriers where ``sync``) and compute spans of
    a merged trace, in units of ``us_per_unit`` microseconds."""
    comm: dict[int, list[Interval]] = {}
    work: dict[int, list[Interval]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        moved = event["cat"] in _COMM_CATS and (sync or event["args"].get("kind")
                                                not in SYNC_KINDS)
        into = work if event["cat"] == "compute" else comm if moved else None
        if into is not None:
            start = event["ts"] / us_per_unit
            into.setdefault(event["pid"], []).append((start, start + event["dur"] / us_per_unit))
    return comm, work


def overlap(trace: dict[str, Any], sync: bool = False) -> dict[int, Overlap]:
    """Return each rank's overlap metrics (seconds) from a merged trace; barriers count as
    communication only where ``sync``."""
    comm, work = _spans(trace, 1e6, sync)
    return {pid: measure(comm.get(pid, []), work.get(pid, []))
            for pid in sorted(comm.keys() | work.keys())}


def steps(trace: dict[str, Any], sync: bool = False) -> dict[int, list[Overlap]]:
    """Return each rank's overlap metrics (seconds) per step: from each of its
    ``trace.step()`` marks to its next (the last step ends at its last span)."""
    comm, work = _spans(trace, 1e6, sync)
    found: dict[int, list[Overlap]] = {}
    for pid, marks in _marks(trace).items():
        end = max((e for _, e in comm.get(pid, []) + work.get(pid, [])), default=marks[-1])
        windows = list(zip(marks, [*marks[1:], max(end, marks[-1])], strict=True))
        found[pid] = [measure(intersect(union(comm.get(pid, [])), [window]),
                              intersect(union(work.get(pid, [])), [window]))
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

    Raises:
        ValueError: no rank marked that many steps.
    """
    marks = _marks(trace)
    if not marks or first < 0 or last < first or any(len(m) <= first for m in marks.values()):
        raise ValueError(f"steps {first}..{last}: the trace marks "
                         f"{min((len(m) for m in marks.values()), default=0)} steps per rank "
                         "(asyncomm.trace.step())")
    comm, work = _spans(trace, 1e6, sync=True)
    ends = [max((e for _, e in comm.get(p, []) + work.get(p, [])), default=m[-1])
            for p, m in marks.items()]
    stops = [m[last + 1] if last + 1 < len(m) else end
             for m, end in zip(marks.values(), ends, strict=True)]
    return min(m[first] for m in marks.values()), max(stops)


def report(metrics: dict[int, Overlap]) -> str:
    """Return the metrics as a table, one row per rank, in milliseconds."""
    lines = [f"{'rank':>4}  {'spans':>6}  {'comm ms':>10}  {'hidden ms':>10}  "
             f"{'exposed ms':>10}  {'compute ms':>10}  {'hidden':>6}"]
    for rank, m in metrics.items():
        lines.append(f"{rank:>4}  {m.spans:>6}  {m.communication * 1e3:>10.3f}  "
                     f"{m.hidden * 1e3:>10.3f}  {m.exposed * 1e3:>10.3f}  "
                     f"{m.compute * 1e3:>10.3f}  {m.hidden_fraction:>6.0%}")
    return "\n".join(lines)


def draw(trace: dict[str, Any], path: str | Path, title: str | None = None,
         within: Interval | None = None) -> Path:
    """Draw a PNG timeline of a merged trace: a row per rank, compute above communication.

    Each row shows the union of the rank's compute spans in one colour, of its transfers
    (ops, channels, actors, torch's own collectives) in another and of its barriers in a
    third; ``within`` (seconds, as ``window`` gives) shows only that time. Returns ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'asyncomm[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    comm, work = _spans(trace, 1e3)
    every, _ = _spans(trace, 1e3, sync=True)
    ranks = sorted(every.keys() | work.keys())
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.7 * max(1, len(ranks))))
    for row, rank in enumerate(ranks):
        for spans, low, colour in ((work.get(rank, []), row - 0.40, "tab:blue"),
                                   (every.get(rank, []), row + 0.05, "tab:gray"),
                                   (comm.get(rank, []), row + 0.05, "tab:orange")):
            bars = [(start, max(end - start, 1e-6)) for start, end in union(spans)]
            if bars:
                axes.broken_barh(bars, (low, 0.35), facecolors=colour)
    if within is not None:
        axes.set_xlim(within[0] * 1e3, within[1] * 1e3)
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes.set_ylim(-0.6, len(ranks) - 0.4)
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_ylabel("rank")
    axes.set_title(title or "asyncomm timeline")
    axes.legend(handles=[matplotlib.patches.Patch(color="tab:blue", label="compute"),
                         matplotlib.patches.Patch(color="tab:orange", label="transfers"),
                         matplotlib.patches.Patch(color="tab:gray", label="barriers")],
                loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def summarise(directory: str | Path, json_path: str | Path | None = None,
              png_path: str | Path | None = None,
              chosen: tuple[int, int] | None = None) -> dict[int, Overlap]:
    """Merge a trace directory, write its trace JSON and PNG, print and return its metrics.

    The files go to ``json_path`` and ``png_path``, by default ``trace.json`` and
    ``timeline.png`` in ``directory``; without matplotlib no PNG is drawn. With ``chosen``
    steps (first, last: see ``trace.step``) it also prints their figures, rank by rank,
    and the PNG shows only them.

    Raises:
        FileNotFoundError, ValueError: as :func:`load`, and :func:`window`.
    """
    trace = merge(directory)
    within = None if chosen is None else window(trace, *chosen)
    out = Path(json_path) if json_path is not None else Path(directory) / "trace.json"
    out.write_text(json.dumps(trace))
    metrics = overlap(trace)
    print(report(metrics))
    if chosen is not None:
        for rank, per_step in steps(trace).items():
            for index in range(chosen[0], min(chosen[1] + 1, len(per_step))):
                m = per_step[index]
                print(f"rank {rank} step {index}: comm {m.communication * 1e3:.3f} ms, hidden "
                      f"{m.hidden * 1e3:.3f} ms, exposed {m.exposed * 1e3:.3f} ms, compute "
                      f"{m.compute * 1e3:.3f} ms")
    print(f"trace: {out} (open in https://ui.perfetto.dev or chrome://tracing)")
    try:
        png = draw(trace, png_path if png_path is not None else Path(directory) / "timeline.png",
                   None if chosen is None else f"steps {chosen[0]} to {chosen[1]}", within)
    except ImportError:
        print("timeline: not drawn (pip install 'asyncomm[plot]' for the PNG)")
    else:
        print(f"timeline: {png}")
    return metrics
