"""How asyncomm words what it says, one function at a time (internals, on purpose):
the gist of a backend's error, the grouped state of the ranks at a timeout, and the one
line a rank says when it stops on an error that follows another's."""

from __future__ import annotations

import sys

import pytest

import asyncomm
from asyncomm._core import errors
from asyncomm._observe import status


@pytest.mark.parametrize(("said", "gist"), [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
     "by peer [127.0.0.1]:41348. This is typically caused by a remote worker crashing. Check "
     "the logs of the remote worker before reporting an error. GLHF!",
     "Connection closed by peer [127.0.0.1]:41348"),
    ("it raised RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
     "unbound_buffer.cc:78] Timed out waiting 100ms for recv operation to complete",
     "it raised RuntimeError: Timed out waiting 100ms for recv operation to complete"),
    ("Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:152] "
     "no error", "Gloo connectFullMesh failed with no error"),
    ("[enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. "
     "16 vs 8", "op.preamble.length <= op.nbytes. 16 vs 8"),
])
def test_an_error_gist_has_no_cpp_source_location(said: str, gist: str) -> None:
    assert errors.gist(RuntimeError(said)) == gist


def test_ranks_that_differ_only_in_durations_are_grouped() -> None:
    # the ranks' clocks started a few ms apart: 1.04 s and 0.96 s print as 1.0 and 1.1
    said = status.summary([(2, "broadcast #1 pending for 1.0 s"), (0, "finished"),
                           (1, "broadcast #1 pending for 1.1 s"),
                           (3, "recv #2 peer 1 tag {7} pending for 2.0 s")])
    assert said == ("rank 0: finished; ranks 1, 2: broadcast #1 pending for 1.0-1.1 s; "
                    "rank 3: recv #2 peer 1 tag {7} pending for 2.0 s"), said


def test_a_consequent_failure_is_said_in_one_line_as_python_words_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncomm import _runtime

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # _quietly installs its own
    monkeypatch.setattr(_runtime, "_previous_hook", None)
    error = asyncomm.PeerFailedError("rank 2: all_reduce #2: rank 1 failed")
    _runtime._quietly(error, "asyncomm: rank 2 stopped: ")
    sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err == ("asyncomm: rank 2 stopped: asyncomm.PeerFailedError: "
                                       "rank 2: all_reduce #2: rank 1 failed\n")
