"""Actors: objects served on one rank whose endpoints any rank can call, over channels.

Note on the protocol
--------------------
Requests and replies travel on two channels of asyncomm's own (tags above every user
channel), with the default codec. Their mailboxes hand each message over as it arrives (a
listener): a request goes straight to its actor's inbox, a reply straight to its call's
future, so a call costs the hops of a channel round trip and no more. A request is ``[call
id, actor, method, wants reply, kwargs or None, *args]`` (flat: a list level less to encode
and decode); a reply is ``[call id, ok, result]`` or ``[call id, ok=False, [type name,
message, traceback]]``. A caller and an actor about to wait spin for what they wait for a
while first (``Link.spin_until``): an answer within microseconds then costs no loop turn.
Each rank sends its requests to one destination in call order (calls and tells alike), and
each actor handles one request at a time, in arrival order.

A call to an actor its rank does not serve (yet) fails at once (``RemoteError``). A tell
cannot fail back and may come before its actor is served: it is kept for that actor, at
most ``_UNSERVED`` per name; one dropped beyond that, and those never served by the close,
are reported, not lost silently. A call to a rank that closed fails with
``CommClosedError`` once its end of stream arrives; to a rank that died, with
``PeerFailedError`` once the router knows (the reply loop probes the ranks it has calls in
flight to, see the note on dead peers in ``router``), or where the link cannot tell, with
``CommTimeoutError`` at the call's deadline.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import inspect
import itertools
import math
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch

from asyncomm._core import tags
from asyncomm._core.errors import (
    CommClosedError,
    CommError,
    CommTimeoutError,
    PeerFailedError,
    ProtocolError,
    RemoteError,
)
from asyncomm._core.wire import Codec
from asyncomm._messaging.channels import Channel
from asyncomm._messaging.mailbox import Encoded, Entry, Message
from asyncomm._messaging.router import Router

F = TypeVar("F", bound=Callable[..., Any])

_ENDPOINT = "__asyncomm_endpoint__"
_POLL_S = 0.25  # how often a caller's wait looks for ranks that closed, and expired calls
_TIMER_S = 2.0  # calls with a timeout this short or shorter get a timer of their own
_Outgoing = tuple[int, int, Encoded]  # channel tag, call id, encoded message
Posted = tuple[int, str, str, int, "asyncio.Future[Any]"]  # rank, actor, method, call id, reply


def endpoint(method: F) -> F:
    """Mark a method of an ``Actor`` as callable from other ranks (a decorator).

    Args:
        method: the method (``async def`` or plain); its arguments and result travel as
            channel messages of the default codec.

    Returns:
        ``method`` itself, marked.
    """
    setattr(method, _ENDPOINT, True)
    return method


_UNSERVED = 1024  # tells kept for an actor not served yet, per name (see the note)
# results that are never awaitable (``inspect.isawaitable`` costs as much as a small message)
_NOT_AWAITABLE = frozenset({type(None), bool, int, float, str, bytes, list, tuple, dict,
                            torch.Tensor})


class Actor:
    """Base class of objects served with ``comm.serve(actor, name)``.

    Only methods marked ``@asyncomm.endpoint`` can be called remotely; they
    may be ``async def`` or plain. An actor handles one call at a time.
    """


class Host:
    """This rank's actors and the calls it has in flight, for one communicator."""

    def __init__(self, router: Router, rank: int, timeout: float) -> None:
        self.rank = rank
        self._router = router
        self._timeout = timeout
        self.instrument = router.instrument  # (its recording, if any: calls are traced then)
        self._requests = Channel(router, tags.ACTOR_REQUEST, Codec.DEFAULT, math.inf)
        self._replies = Channel(router, tags.ACTOR_REPLY, Codec.DEFAULT, math.inf)
        self._actors: dict[str, _Inbox] = {}
        self._workers: list[asyncio.Task[None]] = []
        self._calls: dict[int, tuple[int, asyncio.Future[Any], str, str]] = {}
        self._since: dict[int, float] = {}  # when each parked call began (inf: stall said)
        # calls with a deadline too far for a timer of their own, a heap of
        # (deadline, call id, timeout): the reply loop expires them (``_expire_calls``)
        self._deadlines: list[tuple[float, int, float]] = []
        self._ids = itertools.count()
        self._outboxes: dict[int, asyncio.Queue[_Outgoing | None]] = {}
        self._backlog: dict[int, int] = {}  # messages queued in an outbox, not sent yet
        self._unserved: dict[str, collections.deque[Message]] = {}  # tells before their actor
        # per actor, the endpoint it awaits now: (method, caller, since); a peer asking what
        # this rank does is told (a call that hangs in it is otherwise nothing in flight)
        self.running: dict[str, tuple[str, int, float]] = {}
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._requests.listen(self._on_request)
        self._replies.listen(self._on_reply)
        self._tasks = [loop.create_task(self._serve_requests()),
                       loop.create_task(self._serve_replies())]
        router.on_dead.append(self.fail_calls)
        self._spin_until = router.link.spin_until

    # -- hosting -----------------------------------------------------------------

    def serve(self, actor: Actor, name: str) -> None:
        """Serve ``actor`` under ``name`` on this rank."""
        if not isinstance(actor, Actor):
            raise TypeError(f"rank {self.rank}: serve: {type(actor).__name__} is not an "
                            "asyncomm.Actor")
        if not isinstance(name, str) or not name:
            raise ValueError(f"rank {self.rank}: serve: name must be a non-empty str")
        if name in self._actors:
            raise ValueError(f"rank {self.rank}: serve: an actor named {name!r} is served here")
        inbox = _Inbox()
        for message in self._unserved.pop(name, ()):  # tells that came first, in order
            inbox.put(message)
        self._actors[name] = inbox
        self._workers.append(asyncio.get_running_loop().create_task(self._run(actor, name,
                                                                             inbox)))

    async def _serve_requests(self) -> None:
        while True:
            try:
                # the listener takes the requests; what comes here is an error or the end
                async for message in self._requests:
                    self._route(message)
                return
            except PeerFailedError:  # a rank died (mid-frame, perhaps): over once all have
                if self._requests.over():
                    return
            except ProtocolError as exc:  # a frame refused on arrival: said, and on
                self._refused(exc)

    def _route(self, message: Message) -> None:
        name = message.data[1]
        inbox = self._actors.get(name)
        if inbox is not None:
            inbox.put(message)
        elif message.data[3]:  # a call: its caller learns at once
            self._answer(message, False, ["LookupError",
                                          f"no actor named {name!r} on rank {self.rank}", ""])
        else:  # a tell may come before its actor is served: kept for it (see the note)
            held = self._unserved.setdefault(name, collections.deque())
            if len(held) >= _UNSERVED:
                lost = held.popleft()
                self._loop.call_exception_handler({"message": (
                    f"asyncomm: rank {self.rank}: a tell to {name}.{lost.data[2]} from rank "
                    f"{lost.src} was dropped: {_UNSERVED} are kept for an actor not served")})
            held.append(message)

    def _on_request(self, entry: Entry) -> None:
        """The requests' listener: route each to its actor as it arrives."""
        try:
            self._route(self._requests.opened(entry))
        except Exception as exc:  # a malformed message: say so, and go on with the next
            self._refused(exc, entry.src)

    def _on_reply(self, frame: Entry) -> None:
        """The replies' listener: settle each call as its reply arrives."""
        try:
            self._settle(*self._replies.opened(frame)[2])
        except Exception as exc:
            self._refused(exc, frame.src)

    def _refused(self, exc: Exception, src: int | None = None) -> None:
        """Say that an actor message was refused (its error names its sender where the
        sender is not given)."""
        sender = "" if src is None else f" from rank {src}"
        self._loop.call_exception_handler({
            "message": f"asyncomm: rank {self.rank}: an actor message{sender} was refused",
            "exception": exc})

    async def _run(self, actor: Actor, name: str, inbox: _Inbox) -> None:
        endpoints: dict[str, Callable[..., Any]] = {}  # the bound endpoints found so far
        items, answer = inbox.items, self._answer
        while True:
            # its next request may be microseconds away: send its answers, then spin first
            if not items:
                self._router.link.flush()
                if not self._spin_until(inbox.nonempty):
                    self._router.link.expect()  # it parks: the poller watches closely
            message = items.popleft() if items else await inbox.get()
            data = message[2]
            method, kwargs, args = data[2], data[4], data[5:]
            try:
                target = endpoints.get(method)
                if target is None:
                    target = getattr(actor, method, None)
                    if target is None or not getattr(target, _ENDPOINT, False):
                        raise AttributeError(f"{type(actor).__name__} has no endpoint "
                                             f"{method!r}")
                    endpoints[method] = target
                result = target(*args, **kwargs) if kwargs else target(*args)
                if type(result) not in _NOT_AWAITABLE and inspect.isawaitable(result):
                    self.running[name] = (method, message[0], time.monotonic())
                    try:
                        result = await result
                    finally:
                        del self.running[name]
            except Exception as exc:
                self._answer(message, False, [type(exc).__name__, str(exc),
                                              traceback.format_exc()])
            else:
                answer(message, True, result)

    def _answer(self, request: Message, ok: bool, result: Any) -> None:
        data = request[2]
        if data[3]:  # it wants a reply
            src, reply = request[0], [data[0], ok, result]
            try:
                if self._backlog.get(src) or not self._replies.post(reply, src):  # (``_post``)
                    self._queue(src, self._replies, reply)
            except TypeError as exc:  # a result the default codec cannot carry
                self._post(src, self._replies, [data[0], False, ["TypeError", str(exc), ""]])

    # -- calling -------------------------------------------------------------------

    def call(self, rank: int, name: str, method: str, args: tuple[Any, ...],
             kwargs: dict[str, Any], timeout: float | None) -> Awaitable[Any]:
        """Call ``name.method(*args, **kwargs)`` on ``rank``; the awaitable gives its result."""
        called = self._call(rank, name, method, args, kwargs, timeout)
        if self.instrument.recording is None:
            return called  # no layer between
        return self.instrument.traced(called, "actor_call", 0, rank, None, f"{name}.{method}")

    async def _call(self, rank: int, name: str, method: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any], timeout: float | None) -> Any:
        *_, call_id, future = self.request(rank, name, method, args, kwargs)
        self._router.link.flush()  # the request leaves now: its answer may be quick
        if self._spin_until(future.done):  # an answer within microseconds: no loop turn, no timer
            del self._calls[call_id]
            ok, result = future.result()
        else:
            self._router.link.expect()  # it parks: the poller watches closely
            ok, result = await self._answer_of(call_id, future, timeout)
        return self._result(rank, name, method, ok, result)

    def request(self, rank: int, name: str, method: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Posted:
        """Post a call of ``name.method`` to ``rank`` (sent at the next flush); its reply
        settles the future of the ``(rank, name, method, call id, future)`` returned."""
        self.check_open(rank, name, method)
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._calls[call_id] = (rank, future, name, method)
        self._post(rank, self._requests, [call_id, name, method, True, kwargs or None, *args])
        return rank, name, method, call_id, future

    async def results_of(self, posted: list[Posted], timeout: float | None) -> list[Any]:
        """Send the calls ``request`` posted; their results, in order (the first error
        raised). As ``_call`` waits: a spin first, parked then."""
        self._router.link.flush()
        futures = [future for *_, future in posted]
        if self._spin_until(lambda: all(future.done() for future in futures)):
            for *_, call_id, _ in posted:
                del self._calls[call_id]
            return [self._result(r, n, m, *future.result()) for r, n, m, _, future in posted]
        self._router.link.expect()
        return list(await asyncio.gather(*(self.result_of(p, timeout) for p in posted)))

    def flush(self) -> None:
        """Send the calls posted so far now."""
        self._router.link.flush()

    async def result_of(self, posted: Posted, timeout: float | None) -> Any:
        """The result of a call ``request`` posted and sent (its error, where it failed)."""
        rank, name, method, call_id, future = posted
        return self._result(rank, name, method, *await self._answer_of(call_id, future, timeout))

    def in_flight(self) -> list[int]:
        """The rank of each of this rank's calls whose reply has not come (still in flight)."""
        return [pending[0] for pending in self._calls.values() if not pending[1].done()]

    def on_dead(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(rank)`` for each rank found gone from now on."""
        if callback not in self._router.on_dead:
            self._router.on_dead.append(callback)

    @staticmethod
    def _result(rank: int, name: str, method: str, ok: bool, result: Any) -> Any:
        """A call's result; ``RemoteError`` where the endpoint raised."""
        if not ok:
            kind, text, remote_tb = result
            raise RemoteError(f"rank {rank}: {name}.{method} raised {kind}: {text}", rank,
                              remote_tb)
        return result

    async def _answer_of(self, call_id: int, future: asyncio.Future[Any],
                         timeout: float | None) -> Any:
        """Wait for call ``call_id``'s reply (up to its deadline); forget the call then."""
        limit = self._timeout if timeout is None else timeout
        timer = None
        self._since[call_id] = time.monotonic()
        if limit <= _TIMER_S:
            timer = self._loop.call_later(limit, self._expire, call_id, limit)
        elif limit != math.inf:  # the reply loop expires it (a timer costs as much as a message)
            heapq.heappush(self._deadlines, (time.monotonic() + limit, call_id, limit))
        try:
            return await future  # no task between the reply's arrival and this
        finally:
            if timer is not None:
                timer.cancel()
            self._calls.pop(call_id, None)
            self._since.pop(call_id, None)

    def tell(self, rank: int, name: str, method: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        """Send ``name.method(*args, **kwargs)`` to ``rank`` without waiting for a reply."""
        self.check_open(rank, name, method)
        self._post(rank, self._requests, [next(self._ids), name, method, False, kwargs or None,
                                          *args])

    def check_open(self, rank: int, name: str, method: str) -> None:
        if rank in self._router.dead or rank in self._router.told:
            raise self._router.gone(f"call {name}.{method} on rank {rank}", rank)
        if rank in self._requests._box.ended or rank in self._replies._box.ended:
            raise CommClosedError(f"rank {self.rank}: call {name}.{method}: rank {rank} "
                                  "closed its communicator")

    def _post(self, rank: int, channel: Channel, message: list[Any]) -> None:
        """Queue ``message`` for ``rank``: one sender per destination keeps call order.

        Raises ``TypeError`` at once if the default codec cannot carry it (it is encoded as
        it is queued, for the link by ``Channel.post`` or here for this rank's sender).
        """
        if not self._backlog.get(rank) and channel.post(message, rank):
            return  # the common case: sent now (with the loop iteration's other messages)
        self._queue(rank, channel, message)

    def _queue(self, rank: int, channel: Channel, message: list[Any]) -> None:
        """``_post``'s other case: ``message`` queued for this rank's sender to ``rank``."""
        frame = self._router.encode(channel.tag, message, Codec.DEFAULT)
        outbox = self._outboxes.get(rank)
        if outbox is None:
            outbox = self._outboxes[rank] = asyncio.Queue()
            self._tasks.append(self._loop.create_task(self._send(rank, outbox)))
        self._backlog[rank] = self._backlog.get(rank, 0) + 1
        outbox.put_nowait((channel.tag, message[0], frame))

    async def _send(self, rank: int, outbox: asyncio.Queue[_Outgoing | None]) -> None:
        while (item := await outbox.get()) is not None:
            tag, call_id, frame = item
            try:
                await self._router.send(frame, tag, rank)
            except CommError as exc:  # a local failure, not the endpoint's
                pending = self._calls.get(call_id)
                if pending is not None and not pending[1].done():
                    what = f"call {pending[2]}.{pending[3]} on rank {rank}"
                    error = (self._router.gone(what, rank)
                             if rank in self._router.dead else exc)  # worded like a call's
                    pending[1].set_exception(error)
            finally:
                self._backlog[rank] -= 1

    async def _serve_replies(self) -> None:
        waited = 0.0
        while True:
            try:
                message = await self._replies.recv(timeout=_POLL_S)
            except CommTimeoutError:
                self._fail_closed()
                self._expire_calls()
                self._warn_stalled()
                waited += _POLL_S
                if waited >= self._router.probe_s:  # no reply for a while: are the callees there?
                    waited = 0.0
                    self._router.check_peers({pending[0] for pending in self._calls.values()})
                continue
            except ProtocolError as exc:  # a frame refused on arrival: said, and on
                self._refused(exc)
                continue
            except (CommClosedError, PeerFailedError):  # a rank died (mid-frame, perhaps)
                self._fail_closed()
                for rank in self._router.dead:
                    self.fail_calls(rank)
                if self._replies.over():
                    return
                continue
            waited = 0.0
            call_id, ok, result = message.data
            self._settle(call_id, ok, result)
            self._fail_closed()

    def _expire_calls(self) -> None:
        """Expire the calls whose deadline (kept in ``_deadlines``) has passed."""
        now, deadlines = time.monotonic(), self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, call_id, timeout = heapq.heappop(deadlines)
            self._expire(call_id, timeout)
        if len(deadlines) > 4096:  # calls long over: drop them
            deadlines[:] = [entry for entry in deadlines if entry[1] in self._calls]
            heapq.heapify(deadlines)

    def _warn_stalled(self) -> None:
        """Warn, once each, of calls parked for ``stall_s`` or longer (see ``Router``)."""
        stall_s, now = self._router.stall_s, time.monotonic()
        for call_id, since in self._since.items():
            if stall_s and now - since >= stall_s and call_id in self._calls:
                rank, _, name, method = self._calls[call_id]
                self._router.warn_stalled(f"rank {self.rank}: call {name}.{method} on rank "
                                          f"{rank}", now - since, [rank])
                self._since[call_id] = math.inf

    def _expire(self, call_id: int, timeout: float) -> None:
        """Fail call ``call_id``, if still in flight: its ``timeout`` passed (the error says
        what the callee was doing)."""
        pending = self._calls.get(call_id)
        if pending is not None and not pending[1].done():
            rank, future, name, method = pending

            async def fail() -> None:
                error = await self._router.timed_out(f"call {name}.{method} on rank {rank}",
                                                     timeout, [rank])
                if not future.done():
                    future.set_exception(error)

            self._router.aside(fail())

    def fail_calls(self, rank: int) -> None:
        """``rank`` is gone, or said it failed: fail the calls in flight to it."""
        for callee, future, name, method in self._calls.values():
            if callee == rank and not future.done():
                future.set_exception(self._router.gone(f"call {name}.{method} on rank {rank}",
                                                       rank))

    def _settle(self, call_id: int, ok: bool, result: Any) -> None:
        pending = self._calls.get(call_id)
        if pending is not None and not pending[1].done():
            pending[1].set_result((ok, result))

    def _fail_closed(self) -> None:
        ended = self._replies._box.ended | self._requests._box.ended
        for rank, future, name, method in self._calls.values():
            if rank in ended and not future.done():
                if rank in self._router.told:  # it closed because it failed: say that
                    future.set_exception(self._router.gone(f"call {name}.{method} on rank "
                                                           f"{rank}", rank))
                else:
                    future.set_exception(CommClosedError(
                        f"rank {self.rank}: rank {rank} closed its communicator with a call "
                        "to it in flight"))

    async def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (tells too), tell every rank this one is gone, stop serving."""
        senders = self._tasks[2:]
        for outbox in self._outboxes.values():
            outbox.put_nowait(None)
        if senders and timeout > 0:
            await asyncio.wait(senders, timeout=timeout)
        await self._requests.close()
        await self._replies.close()
        for task in [*self._tasks, *self._workers]:
            task.cancel()
        for name, held in self._unserved.items():  # said, not lost silently
            self._loop.call_exception_handler({"message": (
                f"asyncomm: rank {self.rank}: {len(held)} tell(s) to actor {name!r} were "
                "dropped at close: it was never served here")})
        self._unserved.clear()
        for _, future, _, _ in self._calls.values():
            if not future.done():
                future.set_exception(CommClosedError(f"rank {self.rank}: the communicator "
                                                     "was closed with this call in flight"))


class _Inbox:
    """An actor's requests in arrival order, and the actor's wait for the next one."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[Message] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None  # the actor's, while it waits

    def put(self, message: Message) -> None:
        self.items.append(message)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def nonempty(self) -> bool:
        return bool(self.items)

    async def get(self) -> Message:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


class ActorRef:
    """A handle on the actor ``name`` served on ``rank``: ``await ref.method(...)``."""

    def __init__(self, host: Host, rank: int, name: str) -> None:
        self._host, self.rank, self.name = host, rank, name

    def __repr__(self) -> str:
        return f"<ActorRef {self.name!r} on rank {self.rank}>"

    def __getattr__(self, method: str) -> EndpointRef:
        if method.startswith("_"):
            raise AttributeError(method)
        endpoint = EndpointRef(self._host, self.rank, self.name, method)
        setattr(self, method, endpoint)  # kept: the next call finds it without this
        return endpoint


class EndpointRef:
    """One endpoint of a remote actor: call it (and await), or ``tell`` it."""

    def __init__(self, host: Host, rank: int, name: str, method: str) -> None:
        self._host, self._rank, self._name, self._method = host, rank, name, method

    def __call__(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Call the endpoint; resolves to its result (``RemoteError`` if it raised)."""
        return self._host.call(self._rank, self._name, self._method, args, kwargs, timeout)

    def tell(self, *args: Any, **kwargs: Any) -> None:
        """Send a one-way call: no result, no error back; ordered with other calls."""
        self._host.tell(self._rank, self._name, self._method, args, kwargs)
