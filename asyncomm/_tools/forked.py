"""Ranks forked from the launcher, which has loaded torch once for all of them.

Loading torch is most of what starting a rank costs (docs/benchmarks.md): a rank forked
from a launcher that loaded it starts without that. The child becomes what
``python -c CODE ARGS`` would be (its environment, argv, ``sys.path[0]``, standard
streams, a session of its own) and ends as Python ends: non-daemon threads joined,
``atexit`` work done, streams flushed. It is forked before the launcher starts an event
loop or a store, so its only other thread is torch's idle pool thread (torch re-arms its
pools in a forked child, as for DataLoader's workers), and its exit work is what loading
torch and the launcher's modules registered, as in a rank started fresh. So only a
launcher that leaves nothing of its own to be done at exit (no ``atexit``, no
``weakref.finalize``: the command line's) forks its ranks.

``Forked`` is what the launcher's supervision uses of an asyncio subprocess: ``pid``,
``returncode``, ``wait()``, ``stdout`` and ``stderr``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import io
import os
import sys
import threading
import warnings
from collections.abc import Sequence


def possible() -> bool:
    """Whether ranks can be forked here: a child's end is seen through a pidfd (Linux)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):  # (not Linux, or a kernel without pidfds)
        return False
    return True


class Forked:
    """A rank forked from this process: call ``attach`` on the loop that supervises it."""

    def __init__(self, code: str, argv: Sequence[str], env: dict[str, str],
                 close: Sequence[int]) -> None:
        """Fork the rank running ``code`` as ``python -c code *argv`` would, in ``env``; the
        child closes the descriptors in ``close`` (the launcher's, not its)."""
        out, err = os.pipe(), os.pipe()
        for stream in (sys.stdout, sys.stderr):  # (or the child writes them again)
            stream.flush()
        with warnings.catch_warnings():  # (3.12 on warn of any thread: see the note)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(out[0])
            os.close(err[0])
            _become(code, argv, env, out[1], err[1], close)
        os.close(out[1])
        os.close(err[1])
        self.pid = pid
        self.fds = (out[0], err[0])  # the rank's stdout and stderr, read here
        self.returncode: int | None = None
        self.stdout: asyncio.StreamReader | None = None  # (from ``attach`` on)
        self.stderr: asyncio.StreamReader | None = None
        self._ended: asyncio.Future[int] | None = None

    async def attach(self) -> Forked:
        """Read its output and watch for its end on the running loop."""
        loop = asyncio.get_running_loop()
        readers = []
        for fd in self.fds:
            reader = asyncio.StreamReader(loop=loop)
            await loop.connect_read_pipe(functools.partial(asyncio.StreamReaderProtocol, reader),
                                         os.fdopen(fd, "rb", 0))
            readers.append(reader)
        self.stdout, self.stderr = readers
        self._ended = loop.create_future()
        pidfd = os.pidfd_open(self.pid)

        def reap() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)  # (asyncio's: -signal)
            assert self._ended is not None
            self._ended.set_result(self.returncode)

        loop.add_reader(pidfd, reap)
        return self

    async def wait(self) -> int:
        """Wait for the rank to end; return its exit code (negative: the signal that ended
        it)."""
        assert self._ended is not None, "attach first"
        return await asyncio.shield(self._ended)


def _become(code: str, argv: Sequence[str], env: dict[str, str], out: int, err: int,
            close: Sequence[int]) -> None:
    """In the child: run ``code`` as ``python -c`` would, then end as Python ends."""
    status = 1
    try:
        os.setsid()
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        for fd, name in ((1, "stdout"), (2, "stderr")):  # unbuffered, as the launcher asks
            like = getattr(sys, name)  # (PYTHONUNBUFFERED: its pumps split the lines)
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), like.encoding,
                                      like.errors, write_through=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        sys.argv = ["-c", *argv]
        sys.path[0] = ""  # (``python -c``'s: the working directory)
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        status = 0
    except SystemExit as exc:  # as Python ends on it
        status = 0 if exc.code is None else exc.code & 0xFF if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        status = 130
    except BaseException:  # (the code given catches its own: this is ours)
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # as Python's own exit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)
