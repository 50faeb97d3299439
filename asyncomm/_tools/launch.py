"""``asyncomm run``: start N local ranks, label their output, stop them all when one fails.

With gloo (or nccl) the launcher starts the ranks itself (forked once it has loaded torch,
where it can: see ``forked``) and hosts their rendezvous store on loopback, so no rank has
to race for a port; with ``--backend mpi`` it hands the ranks to ``mpiexec`` and only
watches its output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from asyncomm._core.env import MPI_RANK_VARS
from asyncomm._core.errors import plain
from asyncomm._core.settings import BACKENDS
from asyncomm._tools import forked, mpiexec, network

GRACE_S = 3.0  # between SIGTERM and SIGKILL when stopping the world
TAIL_LINES = 200  # stderr lines kept per rank for the failure summary
_TRACEBACK = "Traceback (most recent call last):"
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")  # what torch's excepthook puts before each line
# "[3] text": a line a rank wrote, as mpiexec labels it (see ``mpiexec``).
_LABEL = re.compile(rb"\[(\d+)\] ?")
# Every rank runs its script as python would (its folder first on sys.path, its frames alone
# in a traceback, its path absolute there), except that Ctrl-C ends a rank quietly with 130:
# the launcher says once that the world was interrupted. The signal wakeup fd tells a Ctrl-C
# that a library turned into another error (numpy's import, say) from a failure.
_RUNNER = """\
try:
    import os, runpy, signal, sys
    heard, told = os.pipe()
    os.set_blocking(heard, False)
    os.set_blocking(told, False)
    signal.set_wakeup_fd(told, warn_on_full_buffer=False)
    def unraisable(said, before=sys.unraisablehook):
        if not issubclass(said.exc_type, KeyboardInterrupt):  # Ctrl-C in a callback, an
            before(said)  # import lock's: the launcher says it was interrupted, once
    sys.unraisablehook = unraisable
    del sys.argv[0]
    if sys.argv[0] == "-m":
        del sys.argv[0]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(os.path.abspath(sys.argv[0]), run_name="__main__")
except KeyboardInterrupt:
    raise SystemExit(130) from None
except Exception as error:
    try:
        interrupted = signal.SIGINT in os.read(heard, 1 << 16)
    except BlockingIOError:
        interrupted = False
    if interrupted:
        raise SystemExit(130) from None
    tb = error.__traceback__.tb_next
    while tb is not None and tb.tb_frame.f_globals.get("__name__") == "runpy":
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)
    raise SystemExit(1) from None
"""
# mpiexec labels each chunk a rank writes rather than each line, so make every rank write
# whole lines: line-buffer both streams (even under PYTHONUNBUFFERED).
_LINE_BUFFERED = """\
import sys
for stream in (sys.stdout, sys.stderr):
    stream.reconfigure(line_buffering=True, write_through=False)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm run`` on its subparser."""
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N",
                        help="ranks to start")
    parser.add_argument("--backend", choices=BACKENDS, help="mpi: start the ranks with "
                        "mpiexec; gloo (default) or nccl: start them here")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="set ASYNCOMM_TIMEOUT for every rank")
    parser.add_argument("--grace", type=float, metavar="SECONDS",
                        help="after a rank fails, how long the others have to end on their "
                        "own before they are stopped (ASYNCOMM_GRACE_S, default 10)")
    parser.add_argument("--keep-going", action="store_true", help="when a rank fails, leave "
                        "the others running (they can shrink and go on); the exit status "
                        "still says it failed (gloo)")
    parser.add_argument("--trace", metavar="DIR", help="trace every rank into DIR "
                        "(ASYNCOMM_TRACE), then merge: DIR/trace.json, DIR/timeline.png and "
                        "the overlap metrics")
    parser.add_argument("--hosts", type=int, metavar="K", help="run on K emulated hosts "
                        "(network namespaces, N/K ranks each; needs root): gloo ranks as "
                        "torchrun's would be, MPI through mpiexec with a host list")
    parser.add_argument("--rate", metavar="RATE", help="with --hosts: each host's link "
                        "speed, as tc writes it (1gbit, 100mbit)")
    parser.add_argument("--delay", metavar="TIME", help="with --hosts: one-way link latency "
                        "(5ms), where the kernel has netem")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="SCRIPT names a module, as in python -m")
    parser.add_argument("script", metavar="SCRIPT", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for SCRIPT")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run ``asyncomm run`` as parsed; return its exit code."""
    if not args.module and not os.path.isfile(args.script):
        print(f"asyncomm run: no such script: {args.script}", file=sys.stderr)
        return 2
    argv = ["-m", args.script] if args.module else [args.script]
    if args.hosts is None and (args.rate or args.delay):
        print("asyncomm run: --rate and --delay need --hosts", file=sys.stderr)
        return 2
    try:
        code = launch([*argv, *args.script_args], args.nproc, args.backend,
                      timeout=args.timeout, trace=args.trace, hosts=args.hosts,
                      rate=args.rate, delay=args.delay, grace=args.grace,
                      keep_going=args.keep_going, fork=True)
    except (ValueError, FileNotFoundError, PermissionError) as err:
        print(f"asyncomm run: {err}", file=sys.stderr)
        return 2
    if args.trace is not None:
        from asyncomm._observe import timeline as _timeline

        try:  # also after a failure: the ranks that got far enough wrote their files
            _timeline.summarise(args.trace)
        except (FileNotFoundError, ValueError) as err:  # the program's own code still counts
            print(f"asyncomm run: trace: {err}", file=sys.stderr)
    return code


def launch(script_argv: list[str], n: int, backend: str | None = None,
           env: Mapping[str, str] | None = None, timeout: float | None = None,
           trace: str | os.PathLike[str] | None = None, hosts: int | None = None,
           rate: str | None = None, delay: str | None = None,
           grace: float | None = None, keep_going: bool = False, fork: bool = False) -> int:
    """Run ``python *script_argv`` (a script or ``-m module``, then its arguments) on n ranks.

    Blocks until every rank has exited and returns the world's exit code. ``fork`` forks
    local gloo ranks from this process (see ``forked``): only for one, as the command
    line's, with nothing of its own to do at exit (its ranks would do it too). ``backend``
    becomes ``ASYNCOMM_BACKEND`` (``"mpi"`` starts the ranks with mpiexec), ``timeout``
    ``ASYNCOMM_TIMEOUT``, ``grace`` ``ASYNCOMM_GRACE_S`` (after a rank fails, the others' time
    to end); ``env`` is added to every rank's environment. ``keep_going`` leaves the others
    running instead (gloo: MPICH's mpiexec ends the survivors of a killed rank whatever it
    is asked, and MPI cannot shrink). ``trace`` becomes ``ASYNCOMM_TRACE`` (the directory is
    made, and emptied of an earlier run's rank files). ``hosts`` spreads the ranks over that
    many emulated hosts (see ``network``), their links shaped by ``rate`` and ``delay``.

    Raises:
        ValueError: a bad ``n``, ``hosts``, ``backend``, ``rate`` or ``delay``.
        FileNotFoundError: ``backend="mpi"`` and no mpiexec is found.
        PermissionError: ``hosts`` where network namespaces cannot be made (not root).
    """
    if n < 1:
        raise ValueError(f"-n must be at least 1, not {n}")
    if keep_going and backend == "mpi":
        raise ValueError("--keep-going needs the gloo backend: mpiexec ends the other ranks "
                         "when one is killed, and MPI here cannot shrink (docs/failures.md)")
    if grace is not None and not grace >= 0:
        raise ValueError(f"--grace must be >= 0 seconds, not {grace}")
    if hosts is not None and (hosts < 1 or n % hosts):
        raise ValueError(f"--hosts {hosts}: -n {n} ranks must split evenly over the hosts")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    base = {**os.environ, "ASYNCOMM_LAUNCHED": "1"}
    if grace is not None:
        base["ASYNCOMM_GRACE_S"] = f"{grace:g}"
    if backend is not None:
        base["ASYNCOMM_BACKEND"] = backend
    if timeout is not None:
        base["ASYNCOMM_TIMEOUT"] = f"{timeout:g}"
    if trace is not None:
        directory = Path(trace).resolve()  # the ranks may run elsewhere (mpiexec's cwd)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("rank*.json"):
            stale.unlink()
        base["ASYNCOMM_TRACE"] = str(directory)
    base.update(env or {})
    if hosts is not None:
        with network.Network(hosts, rate, delay) as net:
            if backend == "mpi":
                return _launch_mpi(script_argv, n, base, net)
            return _launch_hosts(script_argv, n, base, net, keep_going)
    if backend == "mpi":
        return _launch_mpi(script_argv, n, base)
    return _launch_local(script_argv, n, base, keep_going, fork)


def _launch_local(script_argv: list[str], n: int, base: dict[str, str],
                  keep_going: bool, fork: bool) -> int:
    """Start n ranks of ``python *script_argv``, host their store, and supervise them."""
    for name in MPI_RANK_VARS:  # an enclosing MPI job must not make ranks look like MPI's
        base.pop(name, None)
    listening = _listen_on_loopback()
    envs = [{**base, **mine, "PYTHONUNBUFFERED": "1"}  # our pumps split lines: write at once
            for mine in local_world(n, listening.getsockname()[1])]
    if fork and forked.possible():  # torch loads once, here, rather than in every rank
        import torch  # noqa: F401  (the store's, and every rank's)

        ranks: list[forked.Forked] = []
        for env in envs:  # (a rank keeps none of the launcher's descriptors, nor another's)
            ranks.append(forked.Forked(_RUNNER, script_argv, env, close=[
                listening.fileno(), *(fd for rank in ranks for fd in rank.fds)]))
        starts: list[_Start] = [rank.attach for rank in ranks]
    else:
        starts = [_spawn([sys.executable, "-c", _RUNNER, *script_argv], env) for env in envs]
    world = asyncio.run(_supervise(starts, _grace(base), labeled=False,
                                   serve=lambda: _serve_store(listening),
                                   keep_going=keep_going))
    return _ended(world, n, keep_going)


def _launch_hosts(script_argv: list[str], n: int, base: dict[str, str],
                  net: network.Network, keep_going: bool) -> int:
    """Start n ranks spread over the hosts of ``net``, as torchrun on each host would: rank 0
    hosts the store on the first host, and asyncomm finds gloo's interface, as under torchrun."""
    per_host = n // net.count
    for name in (*MPI_RANK_VARS, "GLOO_SOCKET_IFNAME", "ASYNCOMM_STORE",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        base.pop(name, None)
    shared = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(per_host),
              "MASTER_ADDR": net.addresses[0], "MASTER_PORT": "29500", "PYTHONUNBUFFERED": "1"}
    envs = [{**base, **shared, "RANK": str(r), "LOCAL_RANK": str(r % per_host)}
            for r in range(n)]
    starts = [_spawn(net.command(r // per_host, [sys.executable, "-c", _RUNNER, *script_argv]),
                     envs[r]) for r in range(n)]
    return _ended(asyncio.run(_supervise(starts, _grace(base), labeled=False,
                                         keep_going=keep_going)), n, keep_going)


def _ended(world: _World, n: int, keep_going: bool) -> int:
    """Say how a world of ranks started here ended; return its exit code."""
    if world.signal is not None:
        _say(f"interrupted by {signal.Signals(world.signal).name}; stopped {n} ranks")
        return 128 + world.signal
    if world.first_failed is None:
        return 0
    rank = world.first()
    code = world.codes[rank] or 1
    _say(f"rank {rank} failed first{_error(world.tails[rank])} ({_how(code)}); "
         + ("the others went on (--keep-going)" if keep_going else "stopped the other ranks"))
    first_code = world.codes[world.first_failed] or 1
    return first_code if first_code > 0 else 1


def _launch_mpi(script_argv: list[str], n: int, env: dict[str, str],
                net: network.Network | None = None) -> int:
    """Run the ranks under mpiexec, passing its rank-labelled output through. With ``net``:
    mpiexec runs on its first host and reaches the others as it would through ssh (Hydra's
    ssh launcher, with a stand-in for ssh), N/K ranks each."""
    program = mpiexec.find()
    if program is None:
        raise FileNotFoundError("mpiexec not found; pip install 'asyncomm[mpi]' provides one")
    python = [sys.executable, "-c", _LINE_BUFFERED + _RUNNER, *script_argv]
    with tempfile.TemporaryDirectory() as folder:
        where = mpiexec.local_options(program)
        if net is not None:
            env = {**network.MPI_OVER_THE_LINK, **env}  # see network's note on MPI
            where = ["-launcher", "ssh", "-launcher-exec", str(net.ssh_stand_in(Path(folder))),
                     "-hosts", ",".join(net.addresses), "-ppn", str(n // net.count),
                     "-iface", network.INTERFACE]
        cmd = [program, "-n", str(n), *where, *mpiexec.label_options(program), *python]
        if net is not None:
            cmd = net.command(0, cmd)
        world = asyncio.run(_supervise([_spawn(cmd, {**env, "ASYNCOMM_BACKEND": "mpi"})],
                                       _grace(env), labeled=True))
    code = world.codes[0] or 0
    if world.signal is not None:
        _say(f"interrupted by {signal.Signals(world.signal).name}; stopped mpiexec")
        return 128 + world.signal
    if code == 0:
        return 0
    ended = f"mpiexec {_how(code)}"
    if world.aborted is not None:
        rank, abort_code = world.aborted
        ended = f"rank {rank} ended the job with MPI_Abort({abort_code}); {ended}"
    if world.failed_at or world.tracebacks:  # the first rank to raise is the likeliest culprit
        rank = min(world.failed_at, key=world.failed_at.__getitem__) if world.failed_at else (
            world.tracebacks[0])
        _say(f"rank {rank} failed first{_error(world.tails[rank])} ({ended})")
    elif dead := _dead_ranks(world.statuses, world.first_dead()):
        _say(f"{dead} ({ended})")  # died without a word: Hydra says who
    else:
        _say(ended)
    return code if code > 0 else 1


def _dead_ranks(statuses: list[int], first: int | None) -> str:
    """Name the ranks whose wait status says they failed: an exit code first, else a signal
    (Hydra kills the other ranks once one dies, with the same signal: only the ``first`` to
    end badly is named, where it is known)."""
    exited = [(r, s >> 8) for r, s in enumerate(statuses) if s & 0x7F == 0 and s >> 8]
    if exited:
        return "; ".join(f"rank {r} exited with code {c}" for r, c in exited)
    killed = [(r, s & 0x7F) for r, s in enumerate(statuses) if s & 0x7F and first in (None, r)]
    return "; ".join(f"rank {r} {_how(-sig)}" for r, sig in killed)


def local_world(n: int, port: int) -> list[dict[str, str]]:
    """Each of ``n`` ranks' variables to meet on this host, as torchrun's: gloo on loopback,
    the store on loopback ``port``, hosted by the launcher (plain torch scripts connect to
    it as clients too)."""
    shared = {"WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port), "ASYNCOMM_STORE": "client",
              "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": loopback_interface()}
    return [{**shared, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(n)]


def loopback_interface() -> str:
    """Return the name of the loopback network interface, for gloo to bind to."""
    return "lo0" if sys.platform == "darwin" else "lo"


def host_store() -> tuple[object, int]:
    """Start the rendezvous store on a free loopback port; return it and the port."""
    sock = _listen_on_loopback()
    port: int = sock.getsockname()[1]
    return _serve_store(sock), port


def _listen_on_loopback() -> socket.socket:
    """Return a socket listening on a free loopback port, for a store to adopt.

    Binding port 0 ourselves gets a free port without a probe-then-bind race and keeps the
    store off every other interface; until a store adopts it, clients wait in its backlog.
    """
    return socket.create_server(("127.0.0.1", 0), backlog=128)


def _serve_store(sock: socket.socket) -> object:
    """Start torch's store server on the listening ``sock``, which it adopts and closes."""
    import torch
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    port = sock.getsockname()[1]
    fd = sock.detach()
    # The libuv store adopts a listening fd from torch 2.8 on (pytorch#150215).
    use_libuv = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 8)
    try:
        return TCPStore("127.0.0.1", port, world_size=None, is_master=True,
                        wait_for_workers=False, master_listen_fd=fd, use_libuv=use_libuv)
    except BaseException:
        os.close(fd)
        raise


@dataclass
class _World:
    """What supervision saw: exit codes, who failed first, and each rank's last stderr lines."""

    codes: list[int | None]
    first_failed: int | None = None  # index of the first process to exit non-zero
    signal: int | None = None  # SIGINT or SIGTERM received by the launcher
    tracebacks: list[int] = field(default_factory=list)  # ranks, in order of first traceback
    statuses: list[int] = field(default_factory=list)  # each rank's wait status (Hydra)
    open_mpi_failed: int | None = None  # the rank Open MPI's report names, its code to come
    aborted: tuple[int, int] | None = None  # (rank, code) of an MPI_Abort
    served: object = None  # what ``serve`` returned, kept until the ranks are gone
    failed_at: dict[int, float] = field(default_factory=dict)  # when a rank said it failed
    exited_at: dict[int, float] = field(default_factory=dict)  # when a process was seen exit
    serves: dict[int, tuple[str, str]] = field(default_factory=dict)  # (world, address)
    pids: dict[int, int] = field(default_factory=dict)  # each rank, by its process id
    first_pid: int = 0  # the process of the first rank to end badly, as MPICH names it
    ended_at: dict[int, float] = field(default_factory=dict)  # when a rank's process ended
    tails: defaultdict[int, deque[str]] = field(
        default_factory=lambda: defaultdict(lambda: deque(maxlen=TAIL_LINES)))


    def first(self) -> int:
        """The rank that failed first: by when it said so, else by when it exited (a process
        that died without a word; one that failed because another did exits after it)."""
        when = {**{r: t for r, t in self.exited_at.items() if self.codes[r]}, **self.failed_at}
        return min(when, key=when.__getitem__) if when else self.first_failed or 0

    def first_dead(self) -> int | None:
        """The rank whose process ended badly first, as seen here (else as MPICH's banner
        says: it names the first it reaped, which under load may be one it killed)."""
        bad = {r: t for r, t in self.ended_at.items() if r < len(self.statuses)
               and self.statuses[r]}
        return min(bad, key=bad.__getitem__) if bad else self.pids.get(self.first_pid)


_Process = asyncio.subprocess.Process | forked.Forked
_Start = Callable[[], Awaitable[_Process]]


def _spawn(cmd: list[str], env: dict[str, str]) -> _Start:
    """What starts ``cmd`` in ``env``, in a session of its own, its output piped here."""
    return functools.partial(asyncio.create_subprocess_exec, *cmd, env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)


def _grace(env: Mapping[str, str]) -> float:
    """``ASYNCOMM_GRACE_S`` in ``env``: after a rank fails, the others' time to end."""
    from asyncomm._core import settings

    return settings.read(env).grace_s


async def _supervise(starts: list[_Start], grace: float, labeled: bool,
                     serve: Callable[[], object] | None = None,
                     keep_going: bool = False) -> _World:
    """Start one process each, and run them until all exit; once one fails, give the others
    ``grace`` s to end on their own, then stop them (``keep_going``: let them run).

    A rank process that dies without saying it failed (a signal, ``os._exit``) is said dead
    to the others (see ``status``' note on failure notices). ``serve``, when given, runs on
    a thread once the processes are started (the store they connect to: spawned ranks load
    torch while it loads here); if it raises, they are stopped and the error raised.
    """
    from asyncomm._observe import status

    world = _World(codes=[None] * len(starts))
    pumped: dict[int, list[asyncio.Future[None]]] = defaultdict(list)
    procs: list[_Process] = []
    stop = asyncio.Event()  # set when all exited, one failed, or the launcher got a signal

    def on_signal(signum: int) -> None:
        # Ranks live in their own sessions so that a terminal's Ctrl-C reaches them once,
        # from here; a second signal means the user is out of patience.
        _kill(procs, signum if world.signal is None else signal.SIGKILL)
        world.signal = signum
        stop.set()

    async def watch(index: int, proc: _Process) -> None:
        world.codes[index] = code = await proc.wait()
        world.exited_at[index] = time.time()
        if code != 0 and (world.first_failed is None or keep_going):
            if world.first_failed is None:
                world.first_failed = index
            await asyncio.wait(pumped[index], timeout=1.0)  # its last words, if any
            if not labeled and index not in world.failed_at and index in world.serves:
                label, _ = world.serves[index]
                await status.tell([a for r, (_, a) in world.serves.items()
                                   if r != index and world.codes[r] is None],
                                  label, index, f"its process {'was ' * (code < 0)}"
                                  f"{_how(code)}", time.time(), gone=True)
            if not keep_going:
                stop.set()

    def stop_if_failed(done: asyncio.Future[object]) -> None:
        if not done.cancelled() and done.exception() is not None:
            stop.set()

    loop = asyncio.get_running_loop()
    handled: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signum, on_signal, signum)  # only in the main thread
            handled.append(signum)
    try:
        for start in starts:
            procs.append(await start())
        pumps = []
        for i, proc in enumerate(procs):
            for stream, kept in ((proc.stdout, False), (proc.stderr, True)):
                if stream is not None:
                    pumps.append(asyncio.ensure_future(
                        _pump(stream, kept, world, None if labeled else i)))
                    pumped[i].append(pumps[-1])
        served = None
        if serve is not None:
            served = asyncio.ensure_future(asyncio.to_thread(serve))
            served.add_done_callback(stop_if_failed)
        exits = asyncio.gather(*(watch(i, proc) for i, proc in enumerate(procs)))
        exits.add_done_callback(lambda _: stop.set())
        await stop.wait()
        if not exits.done() and world.signal is None and world.first_failed is not None:
            await asyncio.wait({exits}, timeout=grace)  # the others may end on their own
        if not exits.done():
            if world.signal is None:
                _kill(procs, signal.SIGTERM)
            if not (await asyncio.wait({exits}, timeout=GRACE_S))[0]:
                _kill(procs, signal.SIGKILL)
            await exits
        # A rank's own children may hold its pipes open: don't wait on them forever.
        for pump in (await asyncio.wait(pumps, timeout=GRACE_S))[1] if pumps else ():
            pump.cancel()
        if served is not None:
            world.served = await served
    finally:
        _kill(procs, signal.SIGKILL)  # only those still running, e.g. when spawning failed
        for handled_signum in handled:
            loop.remove_signal_handler(handled_signum)
    return world


async def _pump(stream: asyncio.StreamReader, is_err: bool, world: _World,
                rank: int | None) -> None:
    """Copy a rank's output line by line, labelled with ``rank`` unless already labelled."""
    prefix = b"" if rank is None else f"[{rank}] ".encode()

    def emit(line: bytes) -> None:
        if rank is None:
            line = mpiexec.OPEN_MPI_LABEL.sub(rb"[\1] ", line, count=1)
        statuses = mpiexec.EXIT_CODES.match(line) if rank is None else None
        if statuses is None and world.statuses and rank is None:
            statuses = mpiexec.MORE_EXIT_CODES.match(line)  # the next host's, on a line of its own
        if statuses is not None:  # mpiexec's own report: read, not shown
            world.statuses += [int(s) for s in re.findall(rb"\d+", re.sub(
                rb"\[[^\]]*\]", b" ", statuses[1]))]
            return
        if rank is None and (bad := mpiexec.MPICH_PID.match(line)):
            world.first_pid = world.first_pid or int(bad[1])
        if rank is None and mpiexec.MPICH_SAID.match(line):
            return
        if rank is None and is_err and not world.statuses:
            _open_mpi_report(world, line)
        if rank is None and is_err:
            label = _LABEL.match(line)
            aborted = mpiexec.MPI_ABORT.match(line[label.end():] if label else line)
            if aborted is not None:  # said once, in the summary
                world.aborted = (int(aborted[2]), int(aborted[1]))
                return
        if is_err and _said_to_us(world, line, rank):
            return
        _write(sys.stderr if is_err else sys.stdout, prefix + line + b"\n")
        if is_err:
            _keep(world, line, rank)

    pending = b""
    while chunk := await stream.read(1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            emit(line)
    if pending:  # a last line without its newline
        emit(pending)


def _open_mpi_report(world: _World, line: bytes) -> None:
    """Read Open MPI's word on the first rank that failed into ``world.statuses``, as
    Hydra's wait statuses (the failed rank's alone: the others are not said)."""
    named = mpiexec.OPEN_MPI_NAME.match(line) or mpiexec.OPEN_MPI_SIGNALLED.search(line)
    if named is not None:
        world.open_mpi_failed = int(named[1])
    if world.open_mpi_failed is None:
        return
    if (code := mpiexec.OPEN_MPI_CODE.match(line)) is not None:
        world.statuses = [0] * world.open_mpi_failed + [int(code[1]) << 8]
    elif (signal_number := mpiexec.OPEN_MPI_SIGNAL.search(line)) is not None:
        world.statuses = [0] * world.open_mpi_failed + [int(signal_number[1])]


def _said_to_us(world: _World, line: bytes, rank: int | None) -> bool:
    """Take a rank's line to the launcher (see ``status.to_launcher``); return whether it was
    one (it is not shown)."""
    from asyncomm._observe import status

    through_mpiexec = rank is None  # (ranks started here are children: their exits are seen)
    if rank is None and (label := _LABEL.match(line)) is not None:
        rank, line = int(label[1]), line[label.end():]
    text = line.decode(errors="replace").strip()
    if rank is None or not text.startswith((status.FAILED_AT, status.SERVES_AT)):
        return False
    with contextlib.suppress(ValueError):
        if text.startswith(status.FAILED_AT):
            world.failed_at.setdefault(rank, float(text[len(status.FAILED_AT):]))
        else:
            world_label, address, *pid = text[len(status.SERVES_AT):].split()
            world.serves[rank] = (world_label, address)
            world.pids.update({int(p): rank for p in pid})
            if through_mpiexec and address.startswith("127."):  # a process of this host
                for p in pid:
                    _see_end(world, int(p), rank)
    return True


def _see_end(world: _World, pid: int, rank: int) -> None:
    """Note in ``world.ended_at`` when process ``pid`` (of ``rank``) ends (where Linux tells
    a process that is not the parent: ``pidfd_open``)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return
    loop = asyncio.get_running_loop()

    def ended() -> None:
        loop.remove_reader(fd)
        os.close(fd)
        world.ended_at.setdefault(rank, time.monotonic())

    loop.add_reader(fd, ended)


def _keep(world: _World, line: bytes, rank: int | None) -> None:
    """Remember a stderr line of ``rank``, reading the rank from its label when None."""
    if rank is None:
        world.tails[-1].append(line.decode(errors="replace"))  # all ranks, labels and all
        label = _LABEL.match(line)
        if label is None:
            return
        rank, line = int(label[1]), line[label.end() :]
    text = _RANK_PREFIX.sub("", line.decode(errors="replace").rstrip("\r"), count=1)
    world.tails[rank].append(text)
    if text.startswith(_TRACEBACK) and rank not in world.tracebacks:
        world.tracebacks.append(rank)


def _write(sink: TextIO, data: bytes) -> None:
    """Write one line to ``sink`` now, as bytes when it has a binary buffer."""
    with contextlib.suppress(OSError, ValueError):  # a closed pipe must not stop the ranks
        if hasattr(sink, "buffer"):
            sink.buffer.write(data)
            sink.buffer.flush()
        else:  # a replaced stream, e.g. a caller capturing output
            sink.write(data.decode(errors="replace"))
            sink.flush()


def _kill(procs: list[_Process], signum: int) -> None:
    """Send ``signum`` to the process group of every process still running."""
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signum)


def _how(code: int) -> str:
    """Describe an exit code as asyncio reports it (negative: killed by that signal)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def _error(tail: deque[str]) -> str:
    """Return ``": Kind: message"`` from the last traceback in ``tail`` ("" if there is none;
    no C++ source locations): the traceback went by with the rank's output, the summary
    names it once."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
    if not starts:
        return ""
    for line in lines[starts[-1] + 1:]:
        if line.strip() and not line[0].isspace():
            return f": {plain(line.strip())}"
    return ""


def _say(summary: str) -> None:
    """Print the launcher's one-line summary of how the world ended."""
    sys.stderr.write(f"asyncomm run: {summary}\n")
    sys.stderr.flush()
