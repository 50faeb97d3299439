"""``asyncomm bench``: the smoke runs complete and write sane records (no timing thresholds)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncomm._tools import bench
from asyncomm._tools import launch as _launch
from asyncomm._tools import soak as _soak
from asyncomm._tools.bench import channels, core, harness

BACKEND = "both" if _launch.find_mpiexec() is not None else "gloo"
EXPECTED = ("gloo", "mpi") if BACKEND == "both" else ("gloo",)


def _bench_run(tmp_path: Path, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "asyncomm", "bench", *args, "--backend", BACKEND, "--quick",
         "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("ASYNCOMM_")},  # defaults
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records: list[dict[str, Any]] = json.loads(out.read_text())
    assert {r["backend"] for r in records} == set(EXPECTED)
    return records


@pytest.mark.timeout(120)
def test_quick_runs_write_every_section_op_and_variant(tmp_path: Path) -> None:
    # Three sections in one launch per backend (starting ranks is the slow part).
    records = _bench_run(tmp_path, "all,idle,channels", "--rounds", "1")
    assert {r["bench"] for r in records} == {"core", "idle", "channels"}
    _check_core([r for r in records if r["bench"] == "core"])
    _check_idle([r for r in records if r["bench"] == "idle"])
    _check_channels([r for r in records if r["bench"] == "channels"])


def _check_core(records: list[dict[str, Any]]) -> None:
    seen = {(r["backend"], r["op"], r["size"]) for r in records}
    assert seen == {(b, op, size) for b in EXPECTED for op in core.OPS
                    for size in core.QUICK_SIZES}
    for r in records:
        assert r["ranks"] == 2 and r["loop"] in ("uvloop", "asyncio") and r["torch"]
        for variant in core.VARIANTS:
            assert r[f"{variant}_us"] > 0, r
            assert len(r["samples_us"][variant]) == r["rounds"]
        assert r["ratio_asyncomm_raw"] == pytest.approx(r["asyncomm_us"] / r["raw_us"])


def _check_idle(records: list[dict[str, Any]]) -> None:
    assert {(r["backend"], r["variant"]) for r in records} == {
        (b, v) for b in EXPECTED for v in core.VARIANTS}
    for r in records:
        assert r["op"] == "idle" and r["cpu_s"] >= 0 and r["wall_s"] >= r["wait_s"] * 0.5
        if r["variant"] == "asyncomm":  # the library's default back-off: no core burnt
            assert r["cpu_s"] < 0.5 * r["wall_s"], r


def _check_channels(records: list[dict[str, Any]]) -> None:
    assert [(r["backend"], r["op"], r["size"]) for r in records if r["op"] == "pingpong"] == [
        (b, "pingpong", size) for b in EXPECTED for size in channels.CHANNEL_SIZES]
    assert {(r["backend"], r["op"]) for r in records} == {
        (b, test) for b in EXPECTED for test in channels.CHANNEL_TESTS}
    for r in records:
        compared, base, unit, target = channels.CHANNEL_TESTS[r["op"]]
        target = channels.BACKEND_TARGETS.get((r["op"], r["size"], r["backend"]), target)
        assert r["target"] == (None if target is None else f"{target[0]} {target[1]:g}"), r
        assert r["bench"] == "channels" and r["ranks"] == 2 and r["unit"] == unit
        assert (r["compared"], r["base"]) == (compared, base)
        assert r["value"] > 0 and r["base_value"] > 0, r
        assert r["ratio"] == pytest.approx(r["value"] / r["base_value"])
        assert {v: len(s) for v, s in r["samples"].items()} == {compared: r["rounds"],
                                                                 base: r["rounds"]}
        assert (r["met"] is None) == (target is None)


@pytest.mark.timeout(120)
def test_soak_checks_a_mix_of_traffic_on_three_ranks(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncomm", "bench", "soak", "--seconds", "1", "-n", "3",
         "--backend", BACKEND], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [line for line in done.stdout.splitlines() if "] soak:" in line]
    assert len(reports) == len(EXPECTED), done.stdout
    for line in reports:
        assert "every result checked, no errors" in line
        for kind in _soak.KINDS:
            assert f"{kind} " in line, line


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

    assert core.verdict(rec("pingpong", 8, "mpi", 1.9, 1.5)) == "<= 2x: met"
    assert core.verdict(rec("pingpong", 8, "mpi", 2.1, 1.5)) == "<= 2x: MISSED"
    assert core.verdict(rec("allreduce", 8, "mpi", 1.9, 1.8)) == "<= 2x, <= naive: MISSED"
    assert core.verdict(rec("allreduce", 8, "mpi", 1.9, 2.3)) == "<= 2x, <= naive: met"
    assert core.verdict(rec("allreduce", 8, "gloo", 3.0, 3.1)) == "<= naive: met"
    assert core.verdict(rec("pingpong", 64, "mpi", 9.0, 1.0)) == ""
