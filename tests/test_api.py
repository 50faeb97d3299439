"""The public surface: what ``import asyncomm`` offers, and the error hierarchy."""

from __future__ import annotations

import asyncomm

PUBLIC = {
    "Actor", "ActorRef", "Channel", "Comm", "CommClosedError", "CommError", "CommTimeoutError",
    "GradSync", "Handle", "Mesh", "Message", "MismatchError", "PeerFailedError", "ProtocolError",
    "ReduceOp", "RemoteError", "__version__", "compute", "endpoint", "init", "run", "trace",
}


def test_the_export_list_is_the_public_surface() -> None:
    assert set(asyncomm.__all__) == PUBLIC
    assert all(hasattr(asyncomm, name) for name in asyncomm.__all__)
    assert sorted(asyncomm.__all__) == list(asyncomm.__all__)


def test_every_error_is_a_comm_error() -> None:
    for error in (asyncomm.CommTimeoutError, asyncomm.CommClosedError,
                  asyncomm.PeerFailedError, asyncomm.MismatchError, asyncomm.ProtocolError,
                  asyncomm.RemoteError):
        assert issubclass(error, asyncomm.CommError)
    assert issubclass(asyncomm.CommTimeoutError, TimeoutError)
    remote = asyncomm.RemoteError("rank 2: x.y raised KeyError: k", 2, "Traceback ...")
    assert remote.rank == 2 and remote.remote_traceback == "Traceback ..."


def test_reduce_ops_parse_by_name() -> None:
    assert asyncomm.ReduceOp.parse("SUM") is asyncomm.ReduceOp.SUM
    assert [op.value for op in asyncomm.ReduceOp] == [
        "sum", "avg", "product", "min", "max", "band", "bor", "bxor"]
