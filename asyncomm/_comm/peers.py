"""``Peers``: what a communicator knows of its peers, and says of itself.

The part of ``Comm`` that answers a peer asking what this rank is doing
(``_status``), asks the peers in turn when an operation times out or stalls,
and acts on failures: a peer found gone, or a notice that one failed (see
``status``' note on failure notices), fails what needs it; this rank's own
failure is told to the others.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

from asyncomm._core.backend import Backend
from asyncomm._core.errors import CommError, MismatchError, PeerFailedError, describe, gist
from asyncomm._core.handle import Deadlines, Handle
from asyncomm._messaging.actors import Host
from asyncomm._messaging.router import Router
from asyncomm._observe import status
from asyncomm._observe.checks import Checker, checked

# A rank that failed, said so or was killed, may have done its part of what waits on it
# (a barrier it passed, its bytes already sent): that completes first, what is still
# pending this long after the notice fails.
_TOLD_S = 0.25


# gloo says that a connection closed, not whose: the failure it reports waits this long for
# the notice that names the failed rank and how it ended, then probes the peers it needs.
# (Long enough for a launcher on a loaded machine to send it.)
_NAMING_S = 2.0


def _tensor_of(handle: Handle[Any]) -> str:
    """Return `` (this rank's tensor: <shape>)`` for an error, or "" if it has none."""
    shape = status.shape(handle._keep)
    return f" (this rank's tensor: {shape})" if shape else ""


class Peers:
    """Mixed into ``Comm``: its peers' state and failures (see the module's note)."""

    _rank: int
    _backend: Backend
    _own: Backend
    _loop: asyncio.AbstractEventLoop
    _router: Router
    _host: Host
    _deadlines: Deadlines
    _checker: Checker | None
    _closed: bool
    _label: str
    _world_ranks: list[int]
    _addresses: list[str]
    _failed: set[int]  # ranks known to have failed
    _timed_out: collections.deque[tuple[tuple[Any, ...], float]]
    _seq: int
    _last_op: str
    _last_tensor: object

    def _status(self) -> dict[str, Any]:
        """Return this rank's state of the communicator, for a peer that asks."""
        pending = self._deadlines.pending()
        now = time.monotonic()
        return {"state": "closed" if self._closed else "open",
                "pending": [[*h._what[1:], now - issued, status.shape(h._keep)]
                            for h, issued in pending[:8]],
                "more": max(0, len(pending) - 8),
                "timed_out": [[*what[1:], now - when] for what, when in self._timed_out],
                "last": [self._last_op, self._seq, status.shape(self._last_tensor)],
                "running": [[name, method, caller, now - since] for name, (method, caller, since)
                            in self._host.running.items()]}

    async def _peers_say(self, peers: Sequence[int]) -> str:
        """Return what ``peers`` are doing on this communicator, asked without it."""
        async def one(peer: int) -> tuple[int, str]:
            known = self._router.known(peer)
            if known is not None:
                return peer, known
            address = self._addresses[self._world_ranks[peer]] if self._addresses else None
            state = None if address is None else await status.ask(address, self._label)
            return peer, status.word(state)

        return status.summary(await asyncio.gather(*(one(p) for p in peers)))

    def _expired(self, handle: Handle[Any], timeout: float) -> None:
        """A deadline passed: fail ``handle``, with the peers' state if it is a collective."""
        self._timed_out.append((handle._what, time.monotonic()))
        if self._backend.size == 1 or self._closed or not checked(handle.op):
            handle._expire(timeout)
            return

        async def explain() -> None:
            said = await self._peers_say(self._router.others(None))
            hint = "" if self._checker is not None else (
                " If the ranks' collectives differ, rerun with ASYNCOMM_DEBUG=1: every "
                "collective is then checked across ranks first (fingerprints).")
            handle._expire(timeout, f"{_tensor_of(handle)}. Meanwhile {said}.{hint}")

        self._router.aside(explain())

    def _check_peers(self, waiting: list[Handle[Any]]) -> None:
        """Operations have waited ``PROBE_S``: are the peers they need still there?

        A dead peer is probed as the channels' are (see the router's note on
        dead peers); ``_peer_died`` then fails what needs it. Only where the
        backend can tell (gloo): under MPI a dead rank ends the job.
        """
        others = self._router.others
        self._router.check_peers({peer for handle in waiting for peer in others(handle.peer)})

    def _peer_died(self, peer: int, cause: BaseException | None = None) -> None:
        """``peer`` is gone, or said it failed (``cause``): fail what needs it, pending a
        moment later (its part may be in: a barrier's), and later."""
        cause = self._router.dead[peer] if cause is None else cause
        self._failed.add(peer)
        lost = PeerFailedError(f"rank {peer} is gone: {cause}")
        for backend in (self._backend, self._own):
            if backend.lost is None:
                backend.lost = lost
        if peer not in self._router.dead:  # (the router fails calls to the dead)
            self._router.said_failed(peer, cause, _TOLD_S)
            self._loop.call_later(_TOLD_S, self._host.fail_calls, peer)
        self._loop.call_later(_TOLD_S, self._fail_needing, peer, cause)

    def _halted(self, error: CommError) -> None:
        """The backend halted (``Backend.on_halt``): fail what is pending with ``error`` and
        the peers' state (what they were doing shows what differed), and later operations at
        once."""
        if all(isinstance(b.lost, MismatchError) for b in (self._backend, self._own)):
            return  # (told by the twin too)
        self._backend.lost = self._own.lost = error
        pending = [handle for handle, _ in self._deadlines.pending()]

        async def explain() -> None:
            said = await self._peers_say(self._router.others(None))
            for handle in pending:
                handle._abandon(type(error),
                                type(error)(f"{error}{_tensor_of(handle)}. Meanwhile {said}"))

        self._router.aside(explain())

    def _held(self, handle: Handle[Any], error: CommError) -> None:
        """The backend failed ``handle`` because a peer is gone, without saying which: fail it
        naming the failed rank it needs, if one is known already, or once one is (a notice, or
        a probe: ``_fail_needing`` finds it still pending); else as the backend said it."""
        router = self._router
        needs = router.others(handle.peer)
        known = next((p for p in needs if p in router.dead or p in router.told), None)
        if known is not None:
            self._name(handle, known, router.dead.get(known) or router.told[known])
            return

        def said_as_is() -> None:
            if not handle.done():
                handle._settle(2, error)

        def probe() -> None:  # no notice came (no launcher to send one)
            if not handle.done():
                router.check_peers(needs)  # (a dead peer's probe fails at once)
                self._loop.call_later(2 * _TOLD_S, said_as_is)

        self._loop.call_later(_NAMING_S, probe)

    @staticmethod
    def _name(handle: Handle[Any], peer: int, cause: BaseException) -> None:
        error = PeerFailedError(f"rank {peer} failed ({gist(cause)})")
        error.__cause__ = cause
        handle._abandon(PeerFailedError, error)

    def _fail_needing(self, peer: int, cause: BaseException) -> None:
        for handle, _ in self._deadlines.pending():
            needs = self._router.others(handle.peer)
            if peer in needs and (handle.peer is not None or handle.op != "recv"
                                  or all(p in self._router.dead or p == peer for p in needs)):
                self._name(handle, peer, cause)

    def _told(self, world: str, rank: int, what: str, gone: bool) -> None:
        """A notice (see ``status``): a process ``gone`` is news to the router, not a leaver."""
        if self._label.split(".")[0] == world and rank in self._world_ranks:
            peer, cause = self._world_ranks.index(rank), PeerFailedError(what)
            if gone:  # (closing too: its goodbye won't come)
                if not self._loop.is_closed():
                    self._router.failed(peer, cause)
            elif not self._closed:  # (else it still says its goodbye)
                self._peer_died(peer, cause)

    async def _tell(self, what: str) -> None:
        """This rank failed (now), having done ``what``: tell the launcher and every other
        rank of the world, once; return once each has heard (or not)."""
        world, me = self._label.split(".")[0], self._world_ranks[self._rank]
        if (world, me) not in status.failed:
            when = time.time()
            status.failed.add((world, me))
            status.to_launcher(f"{status.FAILED_AT}{when:.6f}")
            await status.tell([a for r, a in enumerate(self._addresses) if r != me], world,
                              me, what, when)

    def _stalled(self, stalled: list[tuple[Handle[Any], float]]) -> None:
        """Warn, once each, of operations pending for ``ASYNCOMM_STALL_S`` or longer."""
        router = self._router
        for handle, waited in stalled:
            router.warn_stalled(describe(*handle._what), waited, router.others(handle.peer))
