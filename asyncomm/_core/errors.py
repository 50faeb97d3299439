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


# A C++ source location, "[.../pair.cc:553] " or "[enforce fail at .../pair.cc:446] ": at
# the start of a backend's message, or inside what repeats it ("it raised RuntimeError: [...").
_SOURCE = re.compile(r"\[[^\[\]]*\.(?:cc|cpp|h|hpp):\d+\] ")


def gist(exc: BaseException) -> str:
    """Return the gist of an error: the note a backend added to say it better (``add_note``),
    else its first line, without a C++ source location or gloo's advice (the whole error
    stays in ``__cause__``)."""
    notes = getattr(exc, "__notes__", None)
    if notes:
        return str(notes[0])
    return plain(str(exc).split("\n")[0])


def plain(text: str) -> str:
    """Return ``text`` without C++ source locations or gloo's advice."""
    return _SOURCE.sub("", text).split(". This is typically")[0]


_RANK = re.compile(r"^rank \d+: ")


def restated(kind: type[CommError], where: str, cause: BaseException) -> CommError:
    """Return ``kind`` saying ``cause`` for ``where`` (``describe``'s prefix): a backend's
    error by its gist, chained; asyncomm's own in its words, said once (its rank prefix
    dropped, not chained: one failure, one message)."""
    if isinstance(cause, CommError):
        error = kind(f"{where}: {_RANK.sub('', str(cause), count=1)}")
        error.__cause__ = cause.__cause__
    else:
        error = kind(f"{where}: {gist(cause)}")
        error.__cause__ = cause
    return error


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
