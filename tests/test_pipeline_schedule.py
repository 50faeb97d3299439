"""Pipeline schedules as data, the simulator's theory and checks, and ``asyncomm pipeline show``.

Pure Python: no ranks are started.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from asyncomm import pipeline
from asyncomm.__main__ import main
from asyncomm.pipeline import Action, Op, Schedule, ScheduleError


def _edit(schedule: Schedule, rank: int, words: list[str]) -> Schedule:
    """Return ``schedule`` with ``rank``'s list replaced by ``words`` (text actions)."""
    actions = list(schedule.actions)
    actions[rank] = tuple(Action.parse(word) for word in words)
    return Schedule(
        schedule.name, schedule.n_ranks, schedule.n_stages, schedule.n_microbatches, actions
    )


def _words(schedule: Schedule, rank: int) -> list[str]:
    return [str(action) for action in schedule.actions[rank]]


# -- the data model and the builders ----------------------------------------------------------


def test_the_export_list_is_sorted_and_complete() -> None:
    assert sorted(pipeline.__all__) == list(pipeline.__all__)
    assert all(hasattr(pipeline, name) for name in pipeline.__all__)
    assert issubclass(ScheduleError, ValueError)


def test_actions_print_and_parse_in_the_compact_form() -> None:
    action = Action(Op.RECV_B, 0, 2)
    assert str(action) == "RECV_B2@s0"
    assert Action.parse("RECV_B2@s0") == action
    assert Action.parse("F3@s1") == Action(Op.F, 1, 3)
    for bad in ("F3", "X3@s1", "F-1@s0", "F3@1"):
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(TypeError, match=r"Action\.stage"):
        Action(Op.F, "1", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="microbatch must be >= 0"):
        Action(Op.F, 0, -1)


def test_schedules_check_their_shape() -> None:
    with pytest.raises(ValueError, match="multiple of n_ranks"):
        Schedule("x", 2, 3, 1, ((), ()))
    with pytest.raises(ValueError, match="1 action lists for 2 ranks"):
        Schedule("x", 2, 2, 1, ((),))
    with pytest.raises(TypeError, match="rank 0 index 0: expected an Action"):
        Schedule("x", 1, 1, 1, (("F0@s0",),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        pipeline.gpipe(2, 0)
    with pytest.raises(TypeError, match="n_ranks must be an int"):
        pipeline.one_f_one_b(2.0, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n_microbatches \(6\) to be a multiple of n_ranks \(4\)"):
        pipeline.interleaved_1f1b(4, 6)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        pipeline.get("zb", 2, 2)
    with pytest.raises(TypeError):
        pipeline.get("1f1b", 2, 2, stages_per_rank=2)


def test_stages_loop_over_the_ranks() -> None:
    schedule = pipeline.get("interleaved", 2, 4, stages_per_rank=3)
    assert (schedule.n_ranks, schedule.n_stages, schedule.stages_per_rank) == (2, 6, 3)
    assert schedule.stages_of(1) == (1, 3, 5)
    assert [schedule.rank_of(stage) for stage in range(6)] == [0, 1, 0, 1, 0, 1]
    for rank in range(2):
        assert {a.stage for a in schedule.actions[rank]} == set(schedule.stages_of(rank))


def test_gpipe_runs_all_forwards_then_all_backwards_with_messages_around_them() -> None:
    schedule = pipeline.gpipe(2, 2)
    assert schedule.format() == (
        "F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0\n"
        "RECV_F0@s1 F0@s1 RECV_F1@s1 F1@s1 B0@s1 SEND_B0@s1 B1@s1 SEND_B1@s1"
    )


def test_one_f_one_b_warms_up_then_alternates() -> None:
    schedule = pipeline.one_f_one_b(4, 6)
    compute = [[str(a) for a in line if a.op.is_compute] for line in schedule.actions]
    assert compute[0] == [
        "F0@s0", "F1@s0", "F2@s0", "F3@s0", "B0@s0", "F4@s0", "B1@s0", "F5@s0", "B2@s0",
        "B3@s0", "B4@s0", "B5@s0",
    ]
    assert compute[3][:4] == ["F0@s3", "B0@s3", "F1@s3", "B1@s3"]


def test_hand_written_schedules_round_trip_through_text() -> None:
    for schedule in (
        pipeline.gpipe(3, 2),
        pipeline.one_f_one_b(4, 5),
        pipeline.interleaved_1f1b(2, 4, 3),
    ):
        assert pipeline.parse(schedule.format(), name=schedule.name) == schedule
    compute = [["F0@s0", "F1@s0", "B0@s0", "B1@s0"], ["F0@s1", "B0@s1", "F1@s1", "B1@s1"]]
    custom = pipeline.from_compute(compute, name="mine")
    assert (custom.n_ranks, custom.n_stages, custom.n_microbatches) == (2, 2, 2)
    assert _words(custom, 1)[:3] == ["RECV_F0@s1", "F0@s1", "B0@s1"]
    pipeline.validate(custom)
    text = "# rank 0\nF0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0\n\nRECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n"
    pipeline.validate(pipeline.parse(text))
    with pytest.raises(ValueError, match=r"rank 1 \(line 2\): cannot parse action 'G0@s1'"):
        pipeline.parse("F0@s0\nG0@s1")
    with pytest.raises(ValueError, match="SEND_F0@s0 is not a forward or backward"):
        pipeline.from_compute([["F0@s0", "SEND_F0@s0"]])


# -- the simulator's theory --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 3), (2, 1), (2, 4), (4, 4), (4, 8)])
def test_bubble_and_peak_activations_match_the_theory(
    name: str, ranks: int, microbatches: int
) -> None:
    simulation = pipeline.simulate(pipeline.get(name, ranks, microbatches))
    assert simulation.bubble == pytest.approx((ranks - 1) / (microbatches + ranks - 1))
    assert simulation.makespan == pytest.approx(3 * (microbatches + ranks - 1))
    if name == "gpipe":
        expected = [microbatches] * ranks
    else:
        expected = [min(microbatches, ranks - rank) for rank in range(ranks)]
    assert list(simulation.peak_activations) == expected


@pytest.mark.parametrize(("ranks", "microbatches", "per_rank"), [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaving_divides_the_bubble_by_the_stages_per_rank(
    ranks: int, microbatches: int, per_rank: int
) -> None:
    simulation = pipeline.simulate(pipeline.interleaved_1f1b(ranks, microbatches, per_rank))
    virtual = microbatches * per_rank
    assert simulation.bubble == pytest.approx((ranks - 1) / (virtual + ranks - 1))


def test_messages_cost_time_on_the_critical_path() -> None:
    # F on rank 0, message, F and B on rank 1, message, B on rank 0.
    simulation = pipeline.simulate(pipeline.gpipe(2, 1), f_cost=1, b_cost=1, comm_cost=0.5)
    assert simulation.makespan == pytest.approx(7.0)
    spans = {str(span.action): (span.start, span.end) for span in simulation.timelines[1]}
    assert spans["F0@s1"] == (1.5, 2.5)
    assert spans["RECV_F0@s1"] == (0.0, 1.5)
    with pytest.raises(ValueError, match="comm_cost must be finite and >= 0"):
        pipeline.simulate(pipeline.gpipe(2, 1), comm_cost=-1)


def test_a_longer_warm_up_hides_message_latency_at_a_cost_in_memory() -> None:
    plain = pipeline.simulate(pipeline.one_f_one_b(4, 16), comm_cost=1.0)
    longer = pipeline.simulate(pipeline.interleaved_1f1b(4, 16, 1), comm_cost=1.0)
    assert longer.bubble < plain.bubble
    assert plain.peak_activations == (4, 3, 2, 1)
    assert longer.peak_activations == (7, 5, 3, 1)


def test_the_grid_has_one_row_per_time_step_and_blanks_for_idle_ranks() -> None:
    simulation = pipeline.simulate(pipeline.one_f_one_b(2, 2))
    assert simulation.grid() == [
        ["F0", ""], ["F1", "F0"], ["", "B0"], ["", "B0"], ["B0", "F1"], ["B0", "B1"],
        ["", "B1"], ["B1", ""], ["B1", ""],
    ]
    assert simulation.bubble == pytest.approx(1 / 3)
    # Costs with no common step of reasonable size: one row per forward's time.
    assert len(pipeline.simulate(pipeline.gpipe(2, 2), b_cost=1.001, w_cost=0).grid()) == 7
    interleaved = pipeline.simulate(pipeline.interleaved_1f1b(2, 2, 2))
    assert interleaved.grid()[:3] == [["F0@s0", ""], ["F1@s0", "F0@s1"], ["F0@s2", "F1@s1"]]


# -- broken schedules ----------------------------------------------------------------------------


def _rejected(schedule: Schedule, match: str) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as caught:
        pipeline.simulate(schedule)
    with pytest.raises(ScheduleError, match=match):
        pipeline.validate(schedule)
    return caught.value


def test_a_swap_that_deadlocks_names_the_waits() -> None:
    words = _words(pipeline.gpipe(2, 2), 0)
    assert words[3:5] == ["SEND_F1@s0", "RECV_B0@s0"]
    words[3:5] = words[4], words[3]
    error = _rejected(
        _edit(pipeline.gpipe(2, 2), 0, words),
        r"gpipe: deadlock: rank 0 index 3 \(RECV_B0@s0\) waits for SEND_B0@s1 "
        r"\(rank 1 index 5\); rank 1 index 2 \(RECV_F1@s1\) waits for SEND_F1@s0 "
        r"\(rank 0 index 4\)",
    )
    assert (error.rank, error.index, error.action) == (0, 3, Action(Op.RECV_B, 0, 0))


def test_a_rank_waiting_on_its_own_later_send_deadlocks() -> None:
    # Two stages on one rank: the receive of stage 1 comes before stage 0's send.
    two_stages = pipeline.parse(
        "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0"
    )
    assert (two_stages.n_ranks, two_stages.n_stages) == (1, 2)
    _rejected(two_stages, r"rank 0 index 0 \(RECV_F0@s1\) waits for SEND_F0@s0 \(rank 0 index 5\)")


def test_a_dropped_backward_is_missing() -> None:
    words = _words(pipeline.one_f_one_b(2, 2), 0)
    words.remove("B1@s0")
    error = _rejected(_edit(pipeline.one_f_one_b(2, 2), 0, words), "rank 0 has no B1@s0")
    assert (error.rank, error.index, error.action) == (0, None, Action(Op.B, 0, 1))


def test_a_duplicate_forward_is_rejected() -> None:
    words = _words(pipeline.one_f_one_b(2, 2), 1)
    words.append("F0@s1")
    _rejected(
        _edit(pipeline.one_f_one_b(2, 2), 1, words),
        rf"1f1b: rank 1 index {len(words) - 1} \(F0@s1\): duplicate of index 1",
    )


def test_a_backward_before_its_forward_is_rejected() -> None:
    words = _words(pipeline.gpipe(2, 2), 1)
    assert words[1] == "F0@s1" and words[4] == "B0@s1"
    words[1], words[4] = words[4], words[1]
    _rejected(
        _edit(pipeline.gpipe(2, 2), 1, words),
        r"rank 1 index 1 \(B0@s1\): backward before its forward \(index 4\)",
    )


def test_a_receive_without_a_send_is_rejected() -> None:
    words = _words(pipeline.gpipe(2, 2), 0)
    words.remove("SEND_F1@s0")
    error = _rejected(
        _edit(pipeline.gpipe(2, 2), 0, words),
        r"rank 1 index 2 \(RECV_F1@s1\): receive with no matching send: no SEND_F1@s0 on rank 0",
    )
    assert error.action == Action(Op.RECV_F, 1, 1)
    words = _words(pipeline.gpipe(2, 2), 1)
    words.remove("RECV_F0@s1")
    _rejected(
        _edit(pipeline.gpipe(2, 2), 1, words),
        r"rank 0 index 1 \(SEND_F0@s0\): send with no matching receive: no RECV_F0@s1 on rank 1",
    )


def test_a_stage_on_the_wrong_rank_is_rejected() -> None:
    words = _words(pipeline.gpipe(2, 2), 0)
    words[0] = "F0@s1"
    _rejected(
        _edit(pipeline.gpipe(2, 2), 0, words),
        r"rank 0 index 0 \(F0@s1\): stage 1 lives on rank 1, not 0",
    )


@pytest.mark.parametrize(
    ("rank", "edit", "match"),
    [
        (0, lambda w: ["RECV_F0@s0", *w], r"index 0 \(RECV_F0@s0\): stage 0 has no previous"),
        (1, lambda w: [*w, "SEND_F0@s1"], r"\(SEND_F0@s1\): the last stage has no next stage"),
        (0, lambda w: [*w, "F0@s2"], r"\(F0@s2\): stage 2 out of range 0..1"),
        (0, lambda w: [*w, "F5@s0"], r"\(F5@s0\): microbatch 5 out of range 0..1"),
        # A send moved before the forward that produces its activation.
        (0, lambda w: [w[1], w[0], *w[2:]], r"index 0 \(SEND_F0@s0\): sends before F0@s0"),
        # A receive moved after the forward that needs it.
        (1, lambda w: [w[1], w[0], *w[2:]], r"index 0 \(F0@s1\): needs RECV_F0@s1, which comes"),
    ],
)
def test_misplaced_actions_are_rejected(
    rank: int, edit: Callable[[list[str]], list[str]], match: str
) -> None:
    schedule = pipeline.gpipe(2, 2)
    _rejected(_edit(schedule, rank, edit(_words(schedule, rank))), match)


def test_a_message_dropped_on_both_sides_is_missing() -> None:
    schedule = pipeline.gpipe(2, 2)
    schedule = _edit(schedule, 0, [w for w in _words(schedule, 0) if w != "SEND_F0@s0"])
    schedule = _edit(schedule, 1, [w for w in _words(schedule, 1) if w != "RECV_F0@s1"])
    _rejected(schedule, r"rank 0 index 0 \(F0@s0\): no SEND_F0@s0 after it")


def test_every_built_in_schedule_is_valid() -> None:
    for ranks in (1, 2, 3, 4):
        for microbatches in (ranks, 2 * ranks, 3 * ranks):
            pipeline.validate(pipeline.gpipe(ranks, microbatches))
            pipeline.validate(pipeline.one_f_one_b(ranks, microbatches + 1))
            for per_rank in (1, 2, 3):
                pipeline.validate(pipeline.interleaved_1f1b(ranks, microbatches, per_rank))
            pipeline.validate(pipeline.zbh1(ranks, microbatches + 1))
            pipeline.validate(pipeline.zbv(ranks, microbatches + 1))


# -- zero-bubble schedules ------------------------------------------------------------------------


def test_zero_bubble_schedules_split_every_backward_in_b_and_w() -> None:
    for schedule in (pipeline.zbh1(4, 8), pipeline.zbv(4, 8)):
        assert schedule.splits_backward
        computes = [a for rank in schedule.actions for a in rank if a.op.is_compute]
        for op in (Op.F, Op.B, Op.W):  # one of each per stage and microbatch
            assert sorted((a.stage, a.microbatch) for a in computes if a.op is op) == [
                (s, m) for s in range(schedule.n_stages) for m in range(8)]
    assert not pipeline.one_f_one_b(4, 8).splits_backward
    assert Action.parse("W3@s1") == Action(Op.W, 1, 3) and Op.W.is_compute


def test_zbv_places_two_stages_per_rank_in_a_v() -> None:
    schedule = pipeline.get("zbv", 4, 8)
    assert schedule.n_stages == 8 and schedule.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.stages_of(0) == (0, 7) and schedule.stages_of(3) == (3, 4)
    assert schedule.rank_of(7) == 0 and schedule.rank_of(4) == 3
    assert pipeline.v_placement(2) == (0, 1, 1, 0)
    # the boundary inside rank 3 is a hand-over on that rank: both ends in its list
    assert {"SEND_F0@s3", "RECV_F0@s4"} <= set(_words(schedule, 3))


def test_zero_bubble_halves_1f1b_bubble_or_better_with_equal_costs() -> None:
    one_f_one_b = pipeline.simulate(pipeline.get("1f1b", 4, 8))  # backward = B + W = 2
    zbh1 = pipeline.simulate(pipeline.get("zbh1", 4, 8))
    zbv = pipeline.simulate(pipeline.get("zbv", 4, 8))
    assert one_f_one_b.bubble == pytest.approx(9 / 33)  # 27.3%
    assert zbh1.bubble == pytest.approx(3 / 27)  # a third of 1F1B's idle time: (p - 1)
    assert zbv.bubble < zbh1.bubble <= one_f_one_b.bubble / 2
    # ZB-H1 keeps 1F1B's peak (rank 0's p), held from F until W
    assert max(zbh1.peak_activations) == max(one_f_one_b.peak_activations) == 4
    assert zbv.peak_activations == (8, 8, 8, 8)  # 2p half-size stages: the same memory


def test_w_costs_its_own_time_and_unsplit_backwards_cost_b_plus_w() -> None:
    zbh1 = pipeline.simulate(pipeline.zbh1(2, 2), f_cost=1, b_cost=1, w_cost=2)
    spans = {str(span.action): span.end - span.start for span in zbh1.timelines[0]}
    assert spans["W0@s0"] == 2 and spans["B0@s0"] == 1
    gpipe = pipeline.simulate(pipeline.gpipe(2, 1), f_cost=1, b_cost=1, w_cost=2)
    assert {str(s.action): s.end - s.start for s in gpipe.timelines[0]}["B0@s0"] == 3
    assert pipeline.simulate(pipeline.zbh1(2, 2)).grid()[-1] == ["W1", "W1"]  # both end on a W


def test_a_w_must_follow_its_b_once_on_its_stages_rank() -> None:
    schedule = pipeline.zbh1(2, 2)
    words = _words(schedule, 1)
    missing = _edit(schedule, 1, [w for w in words if w != "W1@s1"])
    _rejected(missing, r"rank 1 has no W1@s1 \(a schedule with W actions needs one W")
    early = [w for w in words if w != "W0@s1"]
    early.insert(early.index("B0@s1"), "W0@s1")
    _rejected(_edit(schedule, 1, early), r"W0@s1\): weight gradient before its B")
    twice = _edit(schedule, 1, [*words, "W0@s1"])
    _rejected(twice, "duplicate of index")
    elsewhere = _edit(schedule, 0, [*_words(schedule, 0), "W0@s1"])
    _rejected(elsewhere, "stage 1 lives on rank 1, not 0")


def test_hand_written_schedules_with_w_and_a_placement() -> None:
    # two stages on one rank, in the order 1 then 0: a placement of one's own
    schedule = pipeline.from_compute(
        [["F0@s0", "B0@s0", "W0@s0"], ["F0@s1", "B0@s1", "W0@s1"]], placement=[1, 0])
    assert schedule.rank_of(0) == 1 and schedule.stages_of(0) == (1,)
    with pytest.raises(ValueError, match="placement"):
        pipeline.from_compute([["F0@s0", "B0@s0"], ["F0@s1", "B0@s1"]], placement=[0, 0])
    text = "F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0 W0@s0\nRECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 W0@s1"
    parsed = pipeline.parse(text)
    assert parsed.splits_backward and parsed.format() == text
    pipeline.validate(parsed)


# -- asyncomm pipeline show ----------------------------------------------------------------------


def test_show_prints_the_grid_bubble_and_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "show", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    assert lines[2].split() == ["0", "F0"]
    assert lines[5].split() == ["3", "F3", "F2", "F1", "F0"]
    assert len(lines) == 2 + 33 + 2  # title, header, one row per time step, bubble, peak
    assert "bubble: 27.3% of rank time idle (makespan 33)" in out
    assert "peak activations per rank: 4 3 2 1" in out


def test_show_interleaved_names_the_stages(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pipeline", "show", "interleaved", "--stages", "2", "--microbatches", "4",
            "--stages-per-rank", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "interleaved: 2 ranks, 6 stages, 4 microbatches" in out
    assert out.splitlines()[3].split() == ["1", "F1@s0", "F0@s1"]
    assert "bubble: 7.7%" in out  # (p - 1) / (m * v + p - 1) = 1 / 13


def test_show_zero_bubble_schedules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "show", "zbh1"]) == 0  # 4 ranks, 8 microbatches by default
    out = capsys.readouterr().out
    assert "zbh1: 4 ranks, 4 stages, 8 microbatches; costs F=1 B=1 W=1" in out
    assert "bubble: 11.1% of rank time idle" in out
    path = tmp_path / "zbv.png"
    assert main(["pipeline", "show", "zbv", "--png", str(path)]) == 0
    out = capsys.readouterr().out
    assert "zbv: 4 ranks, 8 stages, 8 microbatches" in out and "W0@s7" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["pipeline", "show", "1f1b"]) == 0
    assert "costs F=1 B+W=2" in capsys.readouterr().out


def test_show_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpipe.png"
    assert main(["pipeline", "show", "gpipe", "--stages", "2", "--microbatches", "2",
                 "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in capsys.readouterr().out


def test_show_reads_a_schedule_file_and_reports_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0\nRECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1\n")
    assert main(["pipeline", "show", str(path)]) == 0
    assert "mine.txt: 2 ranks, 2 stages, 1 microbatches" in capsys.readouterr().out
    path.write_text("F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0\nRECV_F0@s1 F0@s1 B0@s1\n")
    assert main(["pipeline", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "rank 0 index 2 (RECV_B0@s0): receive with no matching send: no SEND_B0@s1" in err
    assert main(["pipeline", "show", "1f1b", "--stages", "2"]) == 0  # 8 microbatches
    assert "1f1b: 2 ranks, 2 stages, 8 microbatches" in capsys.readouterr().out
    argv = ["pipeline", "show", "gpipe", "--stages", "2", "--microbatches", "2",
            "--stages-per-rank", "2"]
    assert main(argv) == 2
    assert "--stages-per-rank applies to the interleaved schedule only" in capsys.readouterr().err
