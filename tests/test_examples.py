"""Every script in examples/ runs on 4 ranks and prints what it promises.

Each example's ``main(comm)`` runs on every rank of a pooled 4-rank world, on gloo and
on MPI, with a fresh communicator of its own (so channels, actors and groups start
clean); what each rank prints is collected and labelled ``[rank]`` as the launcher
labels it. Lines arrive in any order across ranks, so they are compared as a multiset;
lines that carry timings or counts that vary from run to run (channels and actors) are
matched by regular expressions instead, and their numbers checked against each other.
The quickstart also runs the way the README says, under ``asyncomm run -n 4`` on both
backends and alone, so the launcher path is covered end to end (starting a world costs
seconds of interpreter start-up: one launch per backend is enough here; the launcher
has tests of its own).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncomm import Comm
from asyncomm.testing import World, fresh, run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
N = 4
LIST = str([float(r + 1) for r in range(N)])  # "[1.0, 2.0, 3.0, 4.0]"
TOTAL = float(sum(range(1, N + 1)))  # 10.0


def each(line: Callable[[int], str]) -> list[str]:
    """One labelled line per rank."""
    return [f"[{r}] {line(r)}" for r in range(N)]


def left(r: int) -> int:
    return (r - 1) % N


def quickstart_line(r: int) -> str:
    evens = sum(range(0, N, 2)) if r % 2 == 0 else None
    config = {"lr": 0.1, "steps": 3}
    return f"rank {r}/{N}: sum={TOTAL:g} max={N - 1} ring<-{left(r)} config={config} evens={evens}"


EXPECTED: dict[str, Callable[[str], list[str]]] = {
    "broadcast": lambda _: each(lambda r: f"Rank {r} has data: 1.0"),
    "all_reduce": lambda _: [
        *each(lambda r: f"Rank {r} initial tensor: {r + 1.0}"),
        *each(lambda r: f"Rank {r} final tensor: {TOTAL}"),
    ],
    "reduce": lambda _: [
        f"[0] Rank 0 final tensor: {TOTAL}",
        *each(lambda r: f"Rank {r} sent tensor: {r + 1.0}")[1:],
    ],
    "scatter": lambda _: [
        f"[0] Rank 0 scatter list: {LIST}",
        *each(lambda r: f"Rank {r} received tensor: {r + 1.0}"),
    ],
    "gather": lambda _: [
        f"[0] Rank 0 gathered list: {LIST}",
        *each(lambda r: f"Rank {r} sent tensor: {r + 1.0}")[1:],
    ],
    "all_gather": lambda _: each(lambda r: f"Rank {r} gathered list: {LIST}"),
    "nonblocking_all_reduce": lambda _: each(
        lambda r: f"Rank {r} async all_reduce result: {float(sum(range(N)))}"
    ),
    "send_recv": lambda _: [
        f"[0] Rank 0 sent tensors to ranks {list(range(1, N))}",
        *each(lambda r: f"Rank {r} received tensor: {10.0 * r} from rank 0")[1:],
        *each(lambda r: f"Rank {r} ring: got {float(left(r))} from rank {left(r)}"),
    ],
    "quickstart": lambda backend: [
        *each(quickstart_line),
        f"[0] ok: {N} rank(s) on {backend}, all checks passed",
    ],
    "resilient_buffers": lambda _: [
        *(f"[{t}] trainer {t}: 20 steps, 20 trajectories acknowledged" for t in (0, 1)),
        "[0] coordinator: 40 acknowledged trajectories, all in each of 2 live buffer(s); "
        "buffers lost: []",
    ],
}


def check_pingpong(found: dict[str, str]) -> None:
    assert int(found["us"]) > 0


def check_parameter_server(found: dict[str, str]) -> None:
    assert float(found["after"]) < float(found["before"]) / 10, found


def check_overlap(found: dict[str, str]) -> None:
    counts = [int(found[f"b{mb}"]) for mb in (1, 5, 25)]
    assert counts[0] > counts[1] > counts[2] >= 2, found  # the settings compare real layouts
    assert Path(found["png"]).read_bytes().startswith(b"\x89PNG"), found


def check_gfn_layout(found: dict[str, str]) -> None:
    steps = [int(found[f"steps{t}"]) for t in (0, 1)]
    assert steps[0] == steps[1], "trainers leave their all-reduce loop on the same step"
    assert int(found["stored"]) == int(found["total"]) == sum(steps) >= 64, found


def check_pipeline_digits(found: dict[str, str]) -> None:
    assert float(found["accuracy"]) >= 0.95, found
    assert float(found["rate"]) > 0 and 0 <= float(found["bubble"]) < 1, found


# name: (one pattern per expected line, or a function of the backend giving them, matched in
# any order; a check of their groups)
PATTERNS: dict[str, tuple[list[str] | Callable[[str], list[str]],
                          Callable[[dict[str, str]], None]]] = {
    "channel_pingpong": (
        [r"\[0\] ping-pong: 101 round trips, ball = 101", r"\[0\] round trip: (?P<us>\d+) us"],
        check_pingpong,
    ),
    "parameter_server": (
        [
            rf"\[0\] parameter server: {30 * (N - 1)} updates from {N - 1} workers",
            r"\[0\] parameter server: loss (?P<before>[\d.]+) -> (?P<after>[\d.]+)",
        ],
        check_parameter_server,
    ),
    "gfn_layout": (
        [
            r"\[3\] layout: trainers \[0, 1\], buffers \[2\], coordinator 3",
            r"\[3\] coordinator: 64\+ trajectories after \d+ polls; stopping the trainers",
            *(rf"\[{t}\] trainer {t}: stopped after (?P<steps{t}>\d+) steps, "
              rf"sent (?P=steps{t}) trajectories to buffer 2" for t in (0, 1)),
            r"\[2\] buffer 2: stored (?P<stored>\d+) trajectories from trainers \[0, 1\]",
            r"\[3\] coordinator: (?P<total>\d+) trajectories in 1 buffer\(s\), sample of 4 ok",
        ],
        check_gfn_layout,
    ),
    "overlap": (
        lambda backend: [
            *(rf"\[0\] bucket {mb} MB: (?P<b{mb}>\d+) bucket\(s\), step [\d.]+ ms, "
              r"exposed communication [\d.]+ ms" for mb in (1, 5, 25)),
            r"\[0\] flat: 1 all-reduce, step [\d.]+ ms, exposed communication [\d.]+ ms",
            # DDP runs on a torch process group: gloo's only
            *([r"\[0\] DDP: 25 MB buckets, step [\d.]+ ms"] if backend == "gloo" else []),
            # --quick: 3 steps after a warm-up step, per setting
            *(rf"\[0\]   trace, steps {first}-{first + 2}: communication hidden [\d.]+ ms, "
              r"exposed [\d.]+ ms, stalled [\d.]+ ms"
              for first in range(1, 20 if backend == "gloo" else 16, 4)),
            rf"\[0\] overlap: {5 if backend == 'gloo' else 4} settings, weights identical on "
            rf"all {N} ranks",
            r"\[0\] timeline: (?P<png>\S+timeline\.png)",
        ],
        check_overlap,
    ),
}
# Arguments for examples that take them (``options(argv)``): fewer epochs than the
# digits example's default still reach 95%; overlap's --quick is a smaller model (its full
# size takes a minute), its trace written to the test's own folder (``TRACE``).
TRACE = "{trace}"
ARGS = {"pipeline_digits": ["--epochs", "6"], "overlap": ["--quick", "--trace", TRACE]}
# The launcher's MPI path is covered by test_launcher, test_lifecycle and test_debug.
LAUNCHED = [pytest.param("gloo", id="gloo")]


def run_python(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root; stop it and its ranks if it hangs."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        return run_command([sys.executable, *args], timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{' '.join(args)} hung for {timeout} s\n{hung.stdout}{hung.stderr}")


def match_lines(lines: list[str], patterns: list[str]) -> dict[str, str]:
    """Match every line to its own pattern (any order); return the named groups."""
    left_over, found = list(lines), {}
    for pattern in patterns:
        hits = [(line, m) for line in left_over if (m := re.fullmatch(pattern, line))]
        assert hits, f"no line matches {pattern!r} in:\n" + "\n".join(lines)
        line, match = hits[0]
        left_over.remove(line)
        found.update(match.groupdict())
    assert not left_over, f"unexpected lines: {left_over}"
    return found


def test_every_example_is_covered() -> None:
    # test_with_asyncomm.py is itself a test file, collected from examples/ by pytest
    assert sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("test_")) == (
        sorted([*EXPECTED, *PATTERNS, "pipeline_digits"]))


def check_output(backend: str, name: str, lines: list[str]) -> None:
    """Check the labelled lines ``name`` printed on ``backend`` against what it promises."""
    if name in PATTERNS:
        patterns, check = PATTERNS[name]
        check(match_lines(lines, patterns(backend) if callable(patterns) else patterns))
        return
    assert Counter(lines) == Counter(EXPECTED[name](backend)), "\n".join(lines)


async def check_example(comm: Comm, name: str, argv: list[str]) -> list[str]:
    """Run ``examples/NAME.py``'s ``main`` on a fresh communicator; return its printed lines."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    async with fresh(comm) as sub:
        with contextlib.redirect_stdout(printed):
            await (module.main(sub, module.options(argv)) if argv else module.main(sub))
    return [f"[{comm.rank}] {line}" for line in printed.getvalue().splitlines()]


@pytest.mark.parametrize("name", [*EXPECTED, *PATTERNS])
def test_example(world4: World, name: str, tmp_path: Path) -> None:
    argv = [str(tmp_path) if arg == TRACE else arg for arg in ARGS.get(name, [])]
    results = world4.run(check_example, name, argv, timeout=90.0)
    lines = [line for rank_lines in results for line in rank_lines]
    check_output(world4.backend, name, lines)


# It trains for seconds: on 2 ranks of gloo (the executor's results on MPI and on 4
# ranks are checked in test_pipeline_exec).
DIGITS = [
    r"\[1\] 1f1b: 2 stages on 2 ranks, 4 microbatches of 16, 6 epochs, last loss [\d.]+",
    r"\[1\] test accuracy: (?P<accuracy>[\d.]+)",
    r"\[1\] throughput: (?P<rate>\d+) samples/s",
    r"\[1\] bubble: (?P<bubble>[\d.]+) measured \(per rank( [\d.]+){2}\), 0\.20 in theory",
]


def test_pipeline_digits(world2: World) -> None:
    if world2.backend != "gloo":
        pytest.skip("trained on gloo only")
    results = world2.run(check_example, "pipeline_digits", ARGS["pipeline_digits"],
                         timeout=90.0)
    check_pipeline_digits(match_lines([line for lines in results for line in lines], DIGITS))


@pytest.mark.parametrize("backend", LAUNCHED)
def test_quickstart_under_the_launcher(backend: str) -> None:
    args = ["-m", "asyncomm", "run", "-n", str(N)]
    if backend != "gloo":
        args += ["--backend", backend]
    done = run_python(*args, "examples/quickstart.py")
    assert done.returncode == 0, done.stdout + done.stderr
    check_output(backend, "quickstart", done.stdout.splitlines())


def test_quickstart_runs_alone() -> None:
    done = run_python("examples/quickstart.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "ok: 1 rank(s) on gloo, all checks passed"


def test_resilient_buffers_lose_a_buffer_and_no_acknowledged_trajectory() -> None:
    # The last buffer is killed (SIGKILL) mid-run: training goes on over the survivors, and
    # every trajectory a trainer counted acknowledged is in the buffer left.
    done = run_python("-m", "asyncomm", "run", "-n", str(N), "--keep-going",
                      "examples/resilient_buffers.py", "--kill-after", "5", timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr  # the job says a rank died
    assert Counter(done.stdout.splitlines()) == Counter([
        *(f"[{t}] trainer {t}: 20 steps, 20 trajectories acknowledged" for t in (0, 1)),
        "[0] coordinator: 40 acknowledged trajectories, all in each of 1 live buffer(s); "
        "buffers lost: [3]"]), done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "asyncomm run: rank 3 failed first (killed by SIGKILL); the others went on "
        "(--keep-going)"), done.stderr
