"""Actor meshes: one actor per hosting rank, called as a whole (``comm.spawn``).

Note on calling a mesh
----------------------
A mesh is a name and a list of ranks over the actors' ``Host``: it holds no
connection of its own. A call to several members posts every request first
(``Host.request``, once each member is checked to be there, before any is sent),
sends them together (one flush: one message per member in the same loop
iteration), then waits for the replies, so N members cost one round trip, not
N. Members that died fail their calls as any actor call to them does; a
mesh's failure handler (``on_failure``) is called once per member the router
learns is gone (a probe, a broken link, or a launcher's notice).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from asyncomm._messaging.actors import ActorRef, Host, Posted

FailureHandler = Callable[[int, BaseException], object]


class Mesh:
    """The members of one spawned actor, on ``ranks``: ``await mesh.method.call(...)``."""

    def __init__(self, host: Host, name: str, ranks: Sequence[int],
                 dead: dict[int, BaseException]) -> None:
        self._host, self.name, self.ranks = host, name, list(ranks)
        self._dead = dead  # the router's: ranks known gone, and why
        self._handlers: list[FailureHandler] = []
        self._told: set[int] = set()

    def __repr__(self) -> str:
        return f"<Mesh {self.name!r} on ranks {self.ranks}>"

    def __len__(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks

    def __iter__(self) -> Any:
        return iter(self.ranks)

    def __getitem__(self, rank: int) -> ActorRef:
        """A reference to the member on ``rank``, as ``comm.actor(rank, name)``."""
        if rank not in self.ranks:
            raise ValueError(f"rank {self._host.rank}: mesh {self.name!r} has no member on "
                             f"rank {rank!r} (its ranks: {self.ranks})")
        return ActorRef(self._host, rank, self.name)

    def __getattr__(self, method: str) -> MeshEndpoint:
        if method.startswith("_"):
            raise AttributeError(method)
        return MeshEndpoint(self, method)

    def slice(self, ranks: Iterable[int]) -> Mesh:
        """Return the mesh of the members on ``ranks``, in ascending order.

        Args:
            ranks: members of this mesh.

        Raises:
            ValueError: ``ranks`` is empty or names a rank that is not a member.
        """
        chosen = sorted(set(ranks))
        strangers = [r for r in chosen if r not in self.ranks]
        if not chosen or strangers:
            raise ValueError(f"rank {self._host.rank}: slice of mesh {self.name!r}: "
                             + (f"ranks {strangers} are not members (its ranks: {self.ranks})"
                                if strangers else "no ranks given"))
        return self._sub(chosen)

    def alive(self) -> Mesh:
        """The mesh of the members not known to have failed."""
        return self._sub([r for r in self.ranks if r not in self._dead])

    def _sub(self, ranks: list[int]) -> Mesh:
        sub = Mesh(self._host, self.name, ranks, self._dead)
        sub._handlers, sub._told = self._handlers, self._told  # one supervision per mesh
        return sub

    def on_failure(self, handler: FailureHandler) -> None:
        """Call ``handler(rank, cause)`` once for each member found gone (see the note).

        Args:
            handler: runs on the event loop, as the news arrives, with the member's rank
                and the error that says how it went. An exception it raises ends the
                program under ``asyncomm.run``, as if ``main`` had raised it (elsewhere
                the loop's exception handler reports it).
        """
        self._handlers.append(handler)
        self._host.on_dead(self._supervise)
        for rank in [r for r in self.ranks if r in self._dead]:  # news from before
            self._supervise(rank)

    def _supervise(self, rank: int) -> None:
        if rank not in self.ranks or rank in self._told:
            return
        self._told.add(rank)
        for handler in self._handlers:
            try:
                handler(rank, self._dead[rank])
            except Exception as exc:  # ends the program (``asyncomm.run``; see ``on_failure``)
                asyncio.get_running_loop().call_exception_handler({
                    "message": f"asyncomm: rank {self._host.rank}: mesh {self.name!r}: the "
                               f"failure handler raised for rank {rank}", "exception": exc,
                    "asyncomm_fatal": True})


class MeshEndpoint:
    """One endpoint of every member of a mesh (see the note on calling a mesh)."""

    def __init__(self, mesh: Mesh, method: str) -> None:
        self._mesh, self._method = mesh, method

    def _post(self, ranks: Sequence[int], args: tuple[Any, ...], kwargs: dict[str, Any],
              tell: bool = False) -> list[Posted]:
        """Post a call (or a ``tell``) to each of ``ranks``; the calls ``Host.request`` posted."""
        host, name, method = self._mesh._host, self._mesh.name, self._method
        for rank in ranks:  # before anything is sent: a dead or closed member fails the call
            host.check_open(rank, name, method)
        post: Callable[..., Any] = host.tell if tell else host.request
        return [post(rank, name, method, args, kwargs) for rank in ranks]

    async def call(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call every member; a list of their results, in ``mesh.ranks`` order."""
        return await self._mesh._host.results_of(self._post(self._mesh.ranks, args, kwargs),
                                                 timeout)

    async def call_one(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call the mesh's only member (``ValueError`` if it has more or none)."""
        if len(self._mesh.ranks) != 1:
            raise ValueError(f"rank {self._mesh._host.rank}: {self._mesh.name}.{self._method}"
                             f".call_one: the mesh has {len(self._mesh.ranks)} members, not 1")
        return (await self.call(*args, timeout=timeout, **kwargs))[0]

    async def choose(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call one member: the live one with the fewest of this rank's calls in flight."""
        host, mesh = self._mesh._host, self._mesh
        candidates = [r for r in mesh.ranks if r not in mesh._dead] or mesh.ranks
        busy = collections.Counter(host.in_flight())
        rank = min(candidates, key=lambda r: (busy[r], r))
        return (await host.results_of(self._post([rank], args, kwargs), timeout))[0]

    async def stream(self, *args: Any, timeout: float | None = None, **kwargs: Any
                     ) -> AsyncIterator[tuple[int, Any]]:
        """Call every member; yield ``(rank, result)`` as each completes."""
        host = self._mesh._host

        async def one(call: Any) -> tuple[int, Any]:
            return call[0], await host.result_of(call, timeout)

        posted = self._post(self._mesh.ranks, args, kwargs)
        host.flush()
        tasks = [asyncio.ensure_future(one(call)) for call in posted]
        try:
            for finished in asyncio.as_completed(tasks):
                yield await finished
        finally:
            for task in tasks:  # a consumer that stops early leaves none behind
                task.cancel()

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Tell every member (no result, no error back)."""
        self._post(self._mesh.ranks, args, kwargs, tell=True)
