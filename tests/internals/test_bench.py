"""``asyncomm bench``: the smoke runs complete and write sane records (no timing thresholds).

Internals on purpose: the sections' parts are called directly (measurements, tables, the
soak's checks), and the pipeline section's measurements run on a pooled world."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncomm import Comm
from asyncomm._tools import bench
from asyncomm._tools import mpiexec as _mpiexec
from asyncomm._tools import soak as _soak
from asyncomm._tools.bench import channels, core, harness
from asyncomm.testing import World, run_command

BACKEND = "both" if _mpiexec.find() is not None else "gloo"
EXPECTED = ("gloo", "mpi") if BACKEND == "both" else ("gloo",)


@pytest.mark.timeout(300)
def test_a_small_channels_run_writes_whole_records(tmp_path: Path) -> None:
    # A smoke run: one section on one backend, the smallest size, one round; it runs and
    # writes whole records. No measured figure is checked beyond being there: a test
    # machine's load decides them (targets and ratios: the table tests below).
    out = tmp_path / "bench.json"
    done = run_command(
        [sys.executable, "-m", "asyncomm", "bench", "channels", "--quick", "--sizes", "8",
         "--rounds", "1", "--backend", "gloo", "--json", str(out)], 110, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("ASYNCOMM_")},  # defaults
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records: list[dict[str, Any]] = json.loads(out.read_text())
    assert {(r["bench"], r["backend"], r["ranks"]) for r in records} == {("channels", "gloo", 2)}
    assert [r["size"] for r in records if r["op"] == "pingpong"] == [8], records
    # (the mesh rows need 3 ranks or more)
    assert {r["op"] for r in records} == set(channels.CHANNEL_TESTS) - {"mesh", "mesh-seq"}, \
        records
    for r in records:
        compared, base, unit, _ = channels.CHANNEL_TESTS[r["op"]]
        assert r["unit"] == unit and (r["compared"], r["base"]) == (compared, base), r
        assert r["value"] > 0 and r["base_value"] > 0, r
        assert {v: len(s) for v, s in r["samples"].items()} == {compared: 1, base: 1}, r
        assert {"ratio", "target", "met"} <= r.keys(), r


@pytest.mark.timeout(300)
def test_soak_checks_a_mix_of_traffic_on_three_ranks(tmp_path: Path) -> None:
    # A second of traffic: how many rounds (and so which kinds of operation) fit in it, a
    # loaded machine decides; every one is checked, and the run says so.
    done = run_command(
        [sys.executable, "-m", "asyncomm", "bench", "soak", "--seconds", "1", "-n", "3",
         "--backend", BACKEND], 110, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [line for line in done.stdout.splitlines() if "] soak:" in line]
    assert len(reports) == len(EXPECTED), done.stdout
    for line in reports:
        said = re.search(r"soak: (\d+) rounds in [\d.]+ s, every result checked, no errors; "
                         r"operations per rank: (.*)$", line)
        assert said is not None and int(said[1]) >= 1, line
        kinds = [kind_count.split()[0] for kind_count in said[2].split(", ")]
        assert kinds and set(kinds) <= set(_soak.KINDS), line


def test_soak_checks_can_fail() -> None:
    with pytest.raises(AssertionError, match="wrong result: x"):
        _soak._expect(False, "x")


def test_channel_table_shows_ratios_and_targets() -> None:
    meta = {"backend": "mpi", "ranks": 2, "loop": "uvloop", "torch": "2", "mpi4py": "4",
            "python": "3", "mpi_library": None, "rounds": 1}
    samples = {"raw": [2e-3], "pickle": [1e-3], "asyncomm": [1e-3],
               "1 channel": [1e-5], "1000 channels": [1.5e-5]}
    cases = [channels.Case(test, 8, {}, 1, 1, per) for test, per in
             [("pingpong", 0.5), ("stream", 64.0), ("rate", 64.0), ("channels", 0.5)]]
    records = [{**meta, **channels.record(c, samples)} for c in cases]
    assert [r["ratio"] for r in records] == pytest.approx([0.5, 2.0, 1.0, 1.5])
    assert [r["met"] for r in records] == [None, True, True, False]
    lines = bench.table(records).splitlines()
    assert lines[0].startswith("backend mpi, 2 ranks")
    assert lines[-4].split()[-1] == "0.50"  # no target for ping-pong
    assert lines[-3].endswith(">= 0.8: met") and lines[-1].endswith("<= 1.2: MISSED")


def test_sizes_parse_suffixes_and_reject_partial_floats() -> None:
    assert bench._sizes("8, 1K,4kib,1M") == (8, 1024, 4096, 1 << 20)
    for bad in ("6", "0", "x", "1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench._sizes(bad)


def test_iterations_shrink_with_size() -> None:
    counts = [harness.iterations(size)[1] for size in core.DEFAULT_SIZES]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 4
    assert all(harness.iterations(s, quick=True)[1] < harness.iterations(s)[1]
               for s in core.DEFAULT_SIZES)


def test_the_core_table_says_whether_targets_are_met() -> None:
    def rec(op: str, size: int, backend: str, ours: float, naive: float) -> dict[str, Any]:
        return {"op": op, "size": size, "backend": backend, "raw_us": 1.0, "asyncomm_us": ours,
                "naive_us": naive, "ratio_asyncomm_raw": ours, "ratio_naive_raw": naive}

    assert core.verdict(rec("pingpong", 8, "mpi", 1.4, 1.5)) == "<= 1.5x: met"
    assert core.verdict(rec("pingpong", 8, "mpi", 1.6, 1.5)) == "<= 1.5x: MISSED"
    assert core.verdict(rec("pingpong", 8, "gloo", 2.1, 3.0)) == "<= 2x: MISSED"
    assert core.verdict(rec("allreduce", 8, "mpi", 1.9, 1.8)) == "<= 2x, <= naive: MISSED"
    assert core.verdict(rec("allreduce", 8, "mpi", 1.9, 2.3)) == "<= 2x, <= naive: met"
    assert core.verdict(rec("allreduce", 8, "gloo", 3.0, 3.1)) == "<= naive: met"
    assert core.verdict(rec("pingpong", 64, "mpi", 9.0, 1.0)) == ""


async def check_bench(comm: Comm) -> None:
    """``asyncomm bench pipeline``'s measurements run and give sane records (no timing limits)."""
    from asyncomm._tools.bench import pipeline as bench

    records = await bench.bubble(comm, 0.001, 2 * comm.size, steps=1)
    if comm.backend == "gloo":
        records += await bench.versus_torch(comm, width=8, batch=8, n_microbatches=2,
                                            rounds=1, steps=1)
    assert [(r["test"], r["schedule"]) for r in records] == [
        *(("bubble", s) for s in bench.BUBBLE_SCHEDULES),
        *((("vs_torch", s) for s in bench.TORCH_SCHEDULES) if comm.backend == "gloo" else ())]
    for r in records:
        assert r["ratio"] > 0, r
        if r["test"] == "bubble":
            assert 0 < r["theory"] < 1 and r["measured"] < 1, r
    text = "\n".join(bench.table([{"backend": comm.backend, "ranks": comm.size, "torch": "x",
                                   "rounds": 1, **r} for r in records]))
    assert "interleaved" in text and ("1f1b" in text)


def test_bench_measurements_run(world2: World) -> None:
    world2.run(check_bench)
