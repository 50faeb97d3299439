"""Start-up of a torch world: a rank that fails to join says so, and the others stop waiting.

Note on failing fast
--------------------
Joining a gloo group blocks in torch until every rank has connected to every other; a rank that
cannot (a wrong interface, a refused connection) raises, while its peers -- on other hosts, where no
launcher sees the failure -- would wait for it until the group's timeout. So each joining step runs
on a daemon thread (a thread blocked in gloo's connect cannot be interrupted, and must not keep the
process from exiting), a rank whose step fails appends a line saying why to the rendezvous store's
key ``failed``, and every rank that waits looks for that key every ``POLL_S``, from a daemon thread
and on a store client of its own (the joining thread's client may be blocked in a wait; a store that
stops answering holds nobody up): once it is there, the wait ends with ``PeerFailedError`` naming
the failed ranks and their reasons.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncomm._backends.gloo_p2p import FOREVER
from asyncomm._core.env import LaunchEnv
from asyncomm._core.errors import CommError, CommTimeoutError, PeerFailedError

T = TypeVar("T")

POLL_S = 0.2  # how often a waiting rank looks for a peer's failure
_FAILED = "failed"


def announce(store: Any, rank: int, why: str) -> None:
    """Tell the other ranks (through ``store``) that ``rank`` failed to join, and why."""
    line = why.replace("\n", " ").replace("\t", " ")
    with contextlib.suppress(Exception):  # the store itself may be what failed
        store.append(_FAILED, f"{rank}\t{line}\n")


def failures(store: Any) -> dict[int, str]:
    """Return the ranks that announced a failure, with their reasons (asks without waiting)."""
    if not store.check([_FAILED]):
        return {}
    found = {}
    for line in store.get(_FAILED).decode(errors="replace").splitlines():
        rank, _, why = line.partition("\t")
        if rank.isdigit():
            found[int(rank)] = why
    return found


_MINE = re.compile(r"^rank \d+: ")  # how an error of asyncomm's starts: the rank is said anyway


def _said(failed: dict[int, str]) -> str:
    """Word the failures of ``failed`` ranks, ranks that said the same thing together."""
    by_reason: dict[str, list[int]] = {}
    for rank, why in sorted(failed.items()):
        by_reason.setdefault(why, []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                     f"failed to join: {why}" for why, ranks in by_reason.items())


def on_daemon(step: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run ``step`` on a daemon thread; return the loop's future of its result.

    Whoever awaits the future may give up on it (see the note on failing fast).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # (given up on)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def body() -> None:
        try:
            value, error = step(), None
        except BaseException as exc:  # handed to the loop
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=body, name=name, daemon=True).start()
    return future


def _ignored(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: not reported as never retrieved


STORE_GRACE_S = 2.0  # beyond the store's own timeout, for it to say why first


_stores: dict[tuple[str, int, int, int], Any] = {}  # per world this process joined
_store_lock = threading.Lock()


async def base_store(env: LaunchEnv, timeout: float) -> Any:
    """Return this process's rendezvous store, made once and reused by every init.

    torch's store client bounds its wait for a connection, not for the answer to its first question:
    a port some other program listens on (a squatted ``MASTER_PORT``) would hold a rank until that
    program lets go. And torch says a port taken when this rank hosts the store in its own words
    only. Both are worded here.

    Raises:
        CommTimeoutError: no store answered within ``timeout``.
        CommError: the store's port is taken (this rank hosts it).
    """
    rank, host, port = env.rank, env.master_addr, env.master_port
    key = (host, port, rank, env.size)
    with _store_lock:
        store = _stores.get(key)
    if store is not None:
        return store
    if env.size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
    else:
        made = on_daemon(functools.partial(
            dist.TCPStore, host, port, env.size,  # type: ignore[attr-defined]
            is_master=env.hosts_store, timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False), "asyncomm-store")
        try:
            store = await asyncio.wait_for(asyncio.shield(made), timeout + STORE_GRACE_S)
        except asyncio.TimeoutError:
            made.add_done_callback(_ignored)  # it may fail later still: nobody waits for it
            raise CommTimeoutError(
                f"rank {rank}: init: the rendezvous store at {host}:{port} did not answer "
                f"within {timeout:g} s: is MASTER_PORT another program's?") from None
        except Exception as exc:
            if env.hosts_store and ("EADDRINUSE" in str(exc)
                                    or "address already in use" in str(exc)):
                raise CommError(f"rank {rank}: init: cannot host the rendezvous store on port "
                                f"{port} of {host}: it is taken (MASTER_PORT; another job or "
                                "program has it)") from exc
            raise
    with _store_lock:
        return _stores.setdefault(key, store)


class Watch:
    """Run joining steps of one rank, failing fast when a peer announces a failure."""

    def __init__(self, rank: int, store: Any, host: str, port: int, prefix: str,
                 timeout: float) -> None:
        self.rank = rank
        self.store = store  # the joining steps' store (prefixed)
        self._host, self._port, self._prefix = host, port, prefix
        self._timeout = timeout
        self._own: Any = None  # the watcher's own client, made on first use

    async def run(self, step: Callable[[], T]) -> T:
        """Run ``step`` on a daemon thread; raise as soon as a peer announces a failure.

        A failure of ``step`` itself is announced and re-raised (see the note on failing fast).
        """
        finished = threading.Event()

        def announced() -> T:
            try:
                return step()
            except BaseException as exc:  # raised on the loop, by the future
                said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                announce(self.store, self.rank, _MINE.sub("", said, count=1)[:500])
                raise
            finally:
                finished.set()

        def watch() -> dict[int, str]:
            while not finished.wait(POLL_S):
                others = {r: why for r, why in self._failures().items() if r != self.rank}
                if others:
                    return others
            return {}  # (the step ended)

        done = on_daemon(announced, "asyncomm-init")
        failed = on_daemon(watch, "asyncomm-init-watch")
        try:
            await asyncio.wait((done, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.set()
        if done.done() or not failed.result():
            return await done
        raise PeerFailedError(f"rank {self.rank}: init: {_said(failed.result())}")

    def _failures(self) -> dict[int, str]:
        try:
            if self._own is None:
                client = dist.TCPStore(  # type: ignore[attr-defined]
                    self._host, self._port, is_master=False,
                    timeout=datetime.timedelta(seconds=min(self._timeout, 10.0)))
                self._own = dist.PrefixStore(self._prefix, client)  # type: ignore[attr-defined]
            return failures(self._own)
        except Exception:  # no store to ask: the launcher will tell
            return {}


SHRINK_POLL_S = 0.05  # how often a survivor looks for the others' word (see ``agree``)


def agree(store: Any, key: str, rank: int, size: int, failed: Callable[[], Sequence[int]],
          timeout: float) -> list[int]:
    """Agree with the other survivors of a group of ``size`` on which ranks are alive.

    Note on shrinking
    -----------------
    Each survivor writes, under ``key``, the ranks it knows have failed, then waits until every rank
    has either written or been named failed by one that has. It writes again whenever it learns of
    another failure (``failed()`` grows): a rank that fails after the others began to wait is named
    by them, or they would wait for it to the deadline. The first to see every rank accounted for
    writes its answer (the ranks that wrote, less those named failed) with ``compare_set``, so that
    all take the same one even where their views differ in the meantime; the rest read it.

    Raises:
        CommTimeoutError: within ``timeout``, some rank neither wrote nor was named failed.
    """
    deadline = time.monotonic() + timeout
    written: list[int] | None = None
    while True:
        known = sorted(failed())
        if known != written:
            store.set(f"{key}/{rank}", json.dumps(known))
            written = known
        said = {r: json.loads(store.get(f"{key}/{r}")) for r in range(size)
                if store.check([f"{key}/{r}"])}
        gone = {int(r) for named in said.values() for r in named}
        missing = [r for r in range(size) if r not in said and r not in gone]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"rank {rank}: shrink timed out after {timeout:g} s: ranks "
                                   f"{missing} neither joined it nor are known to have failed")
        time.sleep(SHRINK_POLL_S)
    alive = json.dumps([r for r in sorted(said) if r not in gone])
    decided: list[int] = json.loads(store.compare_set(f"{key}/decided", "", alive))
    return decided


def make_group(members: list[int], backend: str, label: str,
                timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Create the process group of ``members`` (global ranks) named ``label``; members only.

    Note on names
    -------------
    ``dist.new_group`` names a group either by a counter every rank of the world must advance
    together, or (``use_local_synchronization``) by a hash that also counts the groups this process
    already has -- which differs between ranks that belong to different groups. asyncomm names its
    groups itself, after the parent and how many groups it split off, which every member agrees on.
    """
    c10d = dist.distributed_c10d
    try:
        pg, _ = c10d._new_process_group_helper(
            len(members), members.index(dist.get_rank()), members, backend,
            c10d._get_default_store(), c10d.GroupName(label), timeout=timeout)
    except (AttributeError, TypeError):  # a torch without that helper: its own naming
        made = dist.new_group(members, backend=backend, timeout=timeout,
                              use_local_synchronization=True)
        assert isinstance(made, dist.ProcessGroup)
        return made
    c10d._world.pg_group_ranks[pg] = {g: r for r, g in enumerate(members)}
    assert isinstance(pg, dist.ProcessGroup)
    return pg


def no_deadline(pg: dist.ProcessGroup, name: str) -> None:
    """Leave deadlines to asyncomm: gloo's own, once the group is made, never passes.

    gloo fails a collective still running at the group's timeout and closes every connection of the
    group with it. asyncomm's deadline (the same number) would race it, and lose the error that says
    what the other ranks were doing (see ``_status``); a collective given up on stays in flight
    instead, as a receive does, until it completes or the communicator closes. nccl keeps its own:
    its watchdog acts on it.
    """
    if name == "gloo":  # (raised by a torch without the call: gloo's deadline stays)
        with contextlib.suppress(AttributeError, RuntimeError):
            pg._get_backend(torch.device("cpu"))._set_default_timeout(FOREVER)
