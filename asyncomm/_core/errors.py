"""The error hierarchy: every failure of a communication raises a ``CommError``.

Messages name the rank, the operation, and the peer and tag where there is one;
they never contain payload bytes.
"""

from __future__ import annotations

import re


class CommError(Exception):
    """Base class of every error asyncomm raises for a failed communication."""


class CommTimeoutError(CommError, TimeoutError):
    """Raised when an operation did not complete before its deadline.

    The backend may still be using the operation's buffers; the handle keeps
    them alive until it is done.
    """


class CommClosedError(CommError):
    """Raised when an operation is started on, or interrupted by, a closed communicator."""


class PeerFailedError(CommError):
    """Raised when a peer rank died or dropped its connection during an operation.

    The backend's own exception is in ``__cause__``.
    """


class MismatchError(CommError):
    """Raised when ranks disagree on a collective, or a message overflows its receive buffer.

    Ranks disagree when they issue another op, dtype, shape or root at one step.
    """


def truncated(sender: int, size: int, room: int) -> MismatchError:
    """The error of a receive whose message (``size`` bytes) is larger than its buffer."""
    return MismatchError(f"rank {sender} sent {size} bytes, more than the {room} of the "
                         "buffer (truncated)")


class ProtocolError(CommError):
    """Raised when a received frame is malformed, too large, or of an unknown version."""


class RemoteError(CommError):
    """Raised on the caller when an actor endpoint on another rank raised.

    ``rank`` is the remote rank and ``remote_traceback`` its formatted traceback.
    """

    def __init__(self, message: str, rank: int, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


_SOURCE = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ")  # "[.../pair.cc:553] "


def gist(exc: BaseException) -> str:
    """Return the gist of an error: its first line, without a C++ source location or gloo's
    advice (the whole error stays in ``__cause__``)."""
    text = _SOURCE.sub("", str(exc).split("\n")[0])
    return text.split(". This is typically")[0]


def describe(rank: int, op: str, seq: int | None = None, peer: int | None = None,
             tag: int | None = None) -> str:
    """Return the prefix every error message starts with: who did what with whom."""
    parts = [f"rank {rank}: {op}"]
    if seq is not None:
        parts.append(f"#{seq}")
    if peer is not None:
        parts.append(f"peer {peer}")
    elif op == "recv":
        parts.append("peer any")
    if tag is not None:
        parts.append(f"tag {tag}")
    return " ".join(parts)


for _error in (CommError, CommTimeoutError, CommClosedError, PeerFailedError, MismatchError,
               ProtocolError, RemoteError):
    _error.__module__ = "asyncomm"  # tracebacks say asyncomm.CommTimeoutError
