"""Tracing: interval arithmetic, the recorder on real worlds, ``asyncomm run --trace``."""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import asyncomm
from asyncomm import Comm
from asyncomm.__main__ import main as cli
from asyncomm.testing import World, run_command
from asyncomm.trace import Overlap, intersect, measure, merge, overlap, steps, subtract, union

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"

# -- interval arithmetic on hand-made spans ------------------------------------------


def test_union_merges_overlapping_and_touching_spans_and_drops_empty_ones() -> None:
    spans = [(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (6.0, 6.5), (9.0, 9.0)]
    assert union(spans) == [(0.0, 4.0), (5.0, 7.0)]
    assert union([]) == []


def test_intersect_of_unions() -> None:
    assert intersect([(0, 10)], [(2, 3), (5, 12), (20, 30)]) == [(2, 3), (5, 10)]
    assert intersect([(0, 1)], [(1, 2)]) == []


def test_concurrent_operations_are_not_counted_twice() -> None:
    # Two ops in flight together over [0, 4] and one more over [6, 8]; compute [1, 7].
    m = measure([(0, 4), (1, 3), (6, 8)], [(1, 7)])
    assert m == Overlap(communication=6, compute=6, hidden=4, exposed=2, spans=3)
    assert m.hidden_fraction == pytest.approx(4 / 6)


def test_fully_hidden_and_fully_exposed() -> None:
    assert measure([(2, 3), (4, 5)], [(0, 10)]).exposed == 0
    exposed = measure([(0, 2)], [(3, 4), (5, 6)])
    assert (exposed.hidden, exposed.exposed, exposed.compute) == (0, 2, 2)
    assert measure([], [(0, 1)]) == Overlap(0, 1, 0, 0, 0)
    assert measure([], []).hidden_fraction == 0.0


def test_subtract_of_unions() -> None:
    assert subtract([(0, 10), (12, 14)], [(2, 3), (5, 6), (9, 13)]) == [(0, 2), (3, 5),
                                                                         (6, 9), (13, 14)]
    assert subtract([(0, 1)], []) == [(0, 1)]
    assert subtract([(1, 2)], [(0, 5)]) == []


def test_stalled_communication_under_compute_is_neither_hidden_nor_exposed() -> None:
    # In flight over [0, 10], compute over [0, 6], not progressing over [0, 6] (the loop held)
    # and [8, 9] (the rank waits, untested: the step pays it): what progressed under compute
    # is hidden, what ran with no compute is exposed.
    m = measure([(0, 10)], [(0, 6)], stalled=[(0, 5), (8, 9)])
    assert (m.communication, m.hidden, m.exposed, m.stalled) == (5, 1, 4, 5)
    assert measure([(0, 10)], [(0, 6)]).hidden == 6  # with no stalls, all of it progressed


def _rank_file(directory: Path, rank: int, host: str, perf: float, wall_ns: int,
               events: list[dict[str, Any]]) -> None:
    doc = {"format": "asyncomm-trace", "version": 1, "rank": rank, "size": 2,
           "host": host, "pid": 100 + rank, "anchor": {"perf_counter": perf, "wall_ns": wall_ns},
           "comms": [{"rank": rank, "size": 2, "backend": "gloo"}], "events": events}
    (directory / f"rank{rank}.json").write_text(json.dumps(doc))


def _op(kind: str, start: float, end: float | None, seq: int) -> dict[str, Any]:
    return {"cat": "op", "kind": kind, "bytes": 8, "peer": None, "tag": None, "seq": seq,
            "comm": 0, "start": start, "end": end, "error": None, "name": None}


def _compute_span(name: str, start: float, end: float) -> dict[str, Any]:
    return {"cat": "compute", "kind": "compute", "name": name, "start": start, "end": end,
            "thread": 0}


def test_merge_aligns_hosts_by_wall_clock_and_keeps_rows_free_of_overlaps(
        tmp_path: Path) -> None:
    # Rank 1's perf_counter runs 1000 s behind rank 0's; their wall anchors line them up.
    _rank_file(tmp_path, 0, "a", 10.0, 50 * 10**9, [
        _op("all_reduce", 10.0, 10.004, 1), _op("all_reduce", 10.001, 10.003, 2),
        _op("send", 10.005, None, 3),  # never completed: left out
        _compute_span("fwd", 10.0005, 10.0025)])
    _rank_file(tmp_path, 1, "b", 1010.0, 50 * 10**9, [_op("all_reduce", 1010.001, 1010.004, 1)])
    trace = merge(tmp_path)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert Counter((e["pid"], e["cat"]) for e in spans) == {(0, "op"): 2, (0, "compute"): 1,
                                                           (1, "op"): 1}
    rank1 = next(e for e in spans if e["pid"] == 1)
    assert rank1["ts"] == pytest.approx(1000.0)  # us after rank 0's first event
    assert rank1["args"] == {"kind": "all_reduce", "bytes": 8, "seq": 1, "comm": 0}
    rows = {(e["pid"], e["tid"]) for e in spans if e["cat"] == "op"}
    assert len(rows) == 3  # rank 0's two concurrent ops on two rows
    assert all(e["tid"] != f["tid"] for e in spans for f in spans
               if e["cat"] == "compute" and f["cat"] == "op")
    metrics = overlap(trace)
    assert metrics[0].communication == pytest.approx(0.004)
    assert metrics[0].hidden == pytest.approx(0.002)
    assert metrics[1] == Overlap(pytest.approx(0.003), 0, 0, pytest.approx(0.003), 1)


# -- the recorder on real worlds ---------------------------------------------------


async def check_start_records_until_stop(comm: Comm, directory: str) -> int:
    peer = 1 - comm.rank
    # Without ASYNCOMM_TRACE (the test worlds have none) nothing records.
    assert not asyncomm.trace.enabled()
    asyncomm.trace.start(directory)
    try:
        assert asyncomm.trace.enabled()
        t = torch.ones(16)
        await comm.all_reduce(t)
        if comm.rank == 0:
            await comm.send(t, peer, tag=5)
        else:
            assert await comm.recv(torch.empty(16), tag=5) == 0  # any source: the trace names it
        with pytest.raises(ValueError):
            comm.all_reduce(t, op="nonsense")  # raises before issuing: not recorded
        await asyncomm.compute(torch.mm, torch.ones(8, 8), torch.ones(8, 8), name="mm")
        channel = comm.channel(77)
        if comm.rank == 0:
            await channel.send(t, peer)  # float32[16]: 64 bytes of payload
        else:
            await channel.recv(peer)
    finally:
        path = asyncomm.trace.stop()
    assert path == Path(directory) / f"rank{comm.rank}.json"
    doc = json.loads(path.read_text())
    ops = [e for e in doc["events"] if e["cat"] == "op"]
    assert [(e["kind"], e["bytes"], e["peer"], e["error"]) for e in ops] == [
        ("all_reduce", 64, None, None), ("send" if comm.rank == 0 else "recv", 64, peer, None)]
    assert [e["tag"] for e in ops] == [None, 5]
    assert ops[0]["seq"] < ops[1]["seq"]
    computes = [e for e in doc["events"] if e["cat"] == "compute"]
    assert [e["name"] for e in computes] == ["mm"]
    [message] = [e for e in doc["events"] if e["cat"] == "channel"]
    assert message["kind"] == ("channel_send" if comm.rank == 0 else "channel_recv")
    assert all(e["start"] <= e["end"] for e in doc["events"])
    # Off again: nothing more is recorded or written.
    assert not asyncomm.trace.enabled()
    before = path.read_bytes()
    await comm.all_reduce(t)
    await asyncomm.compute(torch.mm, torch.ones(8, 8), torch.ones(8, 8))
    assert path.read_bytes() == before
    # And on again: the communicator records into the new trace, only what came after.
    asyncomm.trace.start(directory + "-again")
    try:
        await comm.all_reduce(t)
    finally:
        again = asyncomm.trace.stop()
    ops = [e["kind"] for e in json.loads(again.read_text())["events"] if e["cat"] == "op"]
    assert ops == ["all_reduce"], ops
    await comm.barrier()  # the peer has written its file too
    assert sorted(os.listdir(directory)) == sorted(f"rank{r}.json" for r in range(comm.size))
    return int(message["bytes"])


def test_start_records_every_op_and_compute_until_stop(world2: World, tmp_path: Path) -> None:
    sent, received = world2.run(check_start_records_until_stop, str(tmp_path))
    assert sent == received > 64  # the head and the tensor's bytes, counted alike on both sides


# -- asyncomm run --trace, end to end ----------------------------------------------

SCRIPT = """
    import torch
    import asyncomm

    class Echo(asyncomm.Actor):
        @asyncomm.endpoint
        def echo(self, x):
            return x

    async def main(comm):
        asyncomm.trace.start("elsewhere")  # a script that traces itself: the run's DIR wins
        peer = 1 - comm.rank
        comm.serve(Echo(), "echo")
        t = torch.ones(256)
        pending = [comm.all_reduce(t) for _ in range(3)]  # in flight together
        await asyncomm.compute(torch.mm, torch.ones(64, 64), torch.ones(64, 64), name="fwd")
        for handle in pending:
            await handle
        await comm.broadcast(t, 0)
        await comm.barrier()
        if comm.rank == 0:
            await comm.send(t, peer, tag=1)
            await comm.recv(t, peer, tag=2)
        else:
            await comm.recv(t, peer, tag=1)
            await comm.send(t, peer, tag=2)
        out = await comm.all_gather(torch.ones(4))
        ch = comm.channel(9)
        if comm.rank == 0:
            await ch.send(torch.ones(32), peer)
        else:
            await ch.recv(peer)
        assert await comm.actor(peer, "echo").echo(3) == 3
        await asyncomm.compute(sum, [1, 2, 3], name="bwd")
        async with asyncomm.trace.span("on the loop"):
            sum(range(1000))
        await comm.barrier()

    asyncomm.run(main)
"""

ISSUED = {"all_reduce": 3, "broadcast": 1, "barrier": 2, "send": 1, "recv": 1, "all_gather": 1}


def _run_traced(tmp_path: Path, backend: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "trace"
    out.mkdir()
    (out / "rank7.json").write_text("{}")  # an earlier run's: the launcher clears it
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("ASYNCOMM_TRACE", None)
    done = run_command([sys.executable, "-m", "asyncomm", "run", "-n", "2", "--backend", backend,
                        "--trace", str(out), script.name], 90, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, out


# gloo only: a launch costs seconds of start-up, MPI tracing is checked on the pooled
# worlds above, and the launcher hands its environment to mpiexec's ranks the same way
# for every variable (the debug-mode launcher test covers that path).
@pytest.mark.parametrize("backend", ["gloo"])
def test_run_trace_records_what_each_rank_issued(tmp_path: Path, backend: str) -> None:
    done, out = _run_traced(tmp_path, backend)
    assert sorted(p.name for p in out.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        doc = json.loads((out / f"rank{rank}.json").read_text())
        assert (doc["rank"], doc["size"]) == (rank, 2)
        events = doc["events"]
        assert all(0 < e["start"] <= e["end"] and e["error"] is None for e in events
                   if e["cat"] != "compute") and all(e["start"] <= e["end"] for e in events)
        kinds = Counter(e["kind"] for e in events if e["cat"] == "op")
        assert kinds == ISSUED, kinds
        assert [e["name"] for e in events if e["cat"] == "compute"] == [
            "fwd", "bwd", "on the loop"]
        assert Counter(e["kind"] for e in events if e["cat"] == "channel") == {
            "channel_send" if rank == 0 else "channel_recv": 1}
        assert [(e["kind"], e["name"]) for e in events if e["cat"] == "actor"] == [
            ("actor_call", "echo.echo")]
        seqs = [e["seq"] for e in events if e["cat"] == "op"]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        reduces = [e for e in events if e["kind"] == "all_reduce"]
        assert {e["bytes"] for e in reduces} == {1024}
    # The launcher merged the files: valid trace-event JSON, the metrics, the PNG.
    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for event in spans:
        assert isinstance(event["name"], str) and event["ts"] >= 0 and event["dur"] >= 0
        assert isinstance(event["tid"], int) and isinstance(event["args"], dict)
    for row in {(e["pid"], e["tid"]) for e in spans}:  # X events of a row never overlap
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == row)
        assert all(a[1] <= b[0] + 1e-3 for a, b in itertools.pairwise(mine))  # us, rounding
    assert Counter(e["name"] for e in spans if e["cat"] == "op") == {
        kind: 2 * n for kind, n in ISSUED.items()}
    assert "exposed ms" in done.stdout and (out / "timeline.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "elsewhere").exists(), "the run's --trace directory owns tracing"
    assert done.stderr.count(f"RuntimeWarning: asyncomm: tracing into {out}") == 2, done.stderr
    if backend == "gloo":  # the command, once: own output paths
        png, merged = tmp_path / "t.png", tmp_path / "t.json"
        assert cli(["trace", str(out), "--png", str(png), "--json", str(merged)]) == 0
        assert png.read_bytes()[:8] == PNG and json.loads(merged.read_text()) == trace
        assert cli(["trace", str(tmp_path)]) == 2  # no rank files there


async def check_torch_collectives_on_the_timeline(comm: Comm, directory: str
                                                  ) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    plain = copy.deepcopy(model)
    buckets = {"process_group": comm.raw, "bucket_cap_mb": 0.01}  # a few buckets each step
    traced = asyncomm.trace.ddp(nn.parallel.DistributedDataParallel(model, **buckets))
    untraced = nn.parallel.DistributedDataParallel(plain, **buckets)
    asyncomm.trace.start(directory)
    try:
        for step in range(3):
            asyncomm.trace.step()
            x = torch.full((4, 64), float(comm.rank + step))
            traced(x).sum().backward()
            untraced(x).sum().backward()
            for a, b in zip(model.parameters(), plain.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)  # the hook does what DDP does
        t = torch.ones(8)
        asyncomm.trace.work(comm.raw.allreduce([t]), "all_reduce", t).wait()
        await comm.barrier()
    finally:
        path = asyncomm.trace.stop()
    assert path is not None
    return [e for e in json.loads(path.read_text())["events"] if e["cat"] == "torch"]


def test_ddp_and_raw_collectives_are_on_the_timeline(world2: World, tmp_path: Path) -> None:
    if world2.backend != "gloo":
        pytest.skip("DDP runs on a torch process group: gloo's")
    for events in world2.run(check_torch_collectives_on_the_timeline, str(tmp_path)):
        ddp = [e for e in events if e["name"] == "ddp:all_reduce"]
        assert len(ddp) >= 3 and all(e["bytes"] > 0 and e["end"] >= e["start"]
                                      for e in ddp), events  # a bucket or more a step
        assert [e["bytes"] for e in events if e["name"] == "torch:all_reduce"] == [32], events
    trace = merge(tmp_path)
    metrics = overlap(trace)  # barriers are synchronisation: not counted
    assert all(m.spans == len(ddp) + 1 for m in metrics.values()), metrics
    per_step = steps(trace)  # each step of each rank has DDP's all-reduces in it
    assert sorted(per_step) == [0, 1] and all(
        len(s) == 3 and all(m.communication > 0 for m in s) for s in per_step.values()), per_step
    png = tmp_path / "steps.png"
    assert cli(["trace", str(tmp_path), "--steps", "1:1", "--steps", "2:2", "--png",
                      str(png)]) == 0  # two panels side by side
    assert png.read_bytes().startswith(b"\x89PNG")
    assert cli(["trace", str(tmp_path), "--steps", "5:6"]) == 2  # not that many steps


async def check_gradsync_sum_on_the_timeline(comm: Comm, directory: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    sync = asyncomm.GradSync(model, comm)
    asyncomm.trace.start(directory)
    try:
        for step in range(3):
            model(torch.full((4, 64), float(comm.rank + step))).sum().backward()
            await sync.wait()
            model.zero_grad()
    finally:
        path = asyncomm.trace.stop()
        sync.close()
    assert path is not None
    return [e for e in json.loads(path.read_text())["events"] if e["cat"] == "torch"]


def test_gradsync_sum_through_shared_memory_is_on_the_timeline(world2: World,
                                                                tmp_path: Path) -> None:
    # From the second step on, the ranks of one host sum through shared memory: each sum is
    # communication on the timeline, with the gradients' bytes.
    grads = (64 * 64 + 64) * 2 * 4
    for events in world2.run(check_gradsync_sum_on_the_timeline, str(tmp_path)):
        assert [(e["name"], e["bytes"]) for e in events] == [
            ("gradsync:shared_sum", grads)] * 2, events
    assert all(m.communication > 0 for m in overlap(merge(tmp_path)).values())


async def check_held_loop_under_an_all_reduce(comm: Comm, directory: str) -> None:
    asyncomm.trace.start(directory)
    try:
        t = torch.ones(4 << 20)  # 16 MiB: not done by its first tests
        a = torch.randn(256, 256)
        await comm.barrier()
        handle = comm.all_reduce(t)
        with asyncomm.trace.span("held"):  # the loop is held: nothing tests the request
            for _ in range(200):
                a = torch.tanh(a @ a)
        await handle
        await comm.barrier()
    finally:
        asyncomm.trace.stop()


def test_an_all_reduce_under_a_held_loop_is_hidden_only_where_it_progresses(
        world2: World, tmp_path: Path) -> None:
    """MPI moves an all-reduce's data only while the loop tests it, gloo's on gloo's threads:
    under a computation that holds the loop, the trace must count none of MPI's as hidden
    (its step time hides none of it), and gloo's as hidden."""
    world2.run(check_held_loop_under_an_all_reduce, str(tmp_path))
    metrics = overlap(merge(tmp_path))
    assert sorted(metrics) == [0, 1], metrics
    for m in metrics.values():
        assert m.compute > 0 and m.communication > 0, metrics
        if world2.backend == "mpi":
            assert m.hidden == 0 and m.stalled > 0, metrics
        else:
            assert m.hidden > 0 and m.stalled == 0, metrics
