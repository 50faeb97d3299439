"""One step's actions, run on a thread of their own, and what they share with the loop.

Note on why a thread runs the actions
-------------------------------------
A rank's actions are a fixed sequence: compute, send, wait for a tensor, compute. Run
from a coroutine, every compute was a hop to the compute thread and back, and every
arrival a wake-up of the step's task before its compute could be handed on: 0.2 ms
and more per action on a small host, which was most of what a zero-bubble schedule
left of its bubble. So the sequence runs on a thread (the *driver*), start to end,
computes one after the other, as a program written against the backend would:

- From the second step on (fixed shapes), on a backend whose threads may message
  themselves (``Comm.thread_messages``: MPI), the driver sends from its own thread
  (``Comm.post_send``) and blocks on the receives the loop posted at the step's start
  (``Comm.post_recv``): no handle and no loop hop between a message and the compute
  that needs it. It waits for its sends when its list is done.
- Otherwise (gloo, and every first step, whose messages travel on channels), the
  driver hands a send to the loop (``call_soon_threadsafe``) and goes on; a receive
  hands its tensor to the driver from its completion callback, in the loop iteration
  it completes in. On gloo that measured as fast as posting from the driver (ZB-V's
  bubble 1.19-1.22x theory against 1.17-1.21x), and posted gloo operations left
  pending by a failed step made a later group's creation hang in tests.

The driver stops when the step does: a failure (its own, a receive's, a send that
could not be issued) or the step's cancellation (another rank failed) wakes it with
the error when it waits on the loop, or cancels the receive it blocks on where the
backend can (MPI; under gloo the wait ends with the message, which the failed peer
may never send, or with the communicator's close); a stopped step issues no more
sends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asyncomm._core.backend import Posted

Key = tuple[int, int, int]  # (direction, boundary, microbatch)


class StepStopped(Exception):
    """The step this driver runs for has ended (cancelled, or failed elsewhere)."""


class StepRun:
    """What one step's driver thread and its loop share.

    The loop posts receives and delivers them (``arrive``); the driver takes them
    (``take``), hands sends to the loop (``issue``) and adds up its compute times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sends: list[Awaitable[None]] = []  # issued on the loop: tasks or handles
        self.receives: list[asyncio.Future[Any]] = []  # channel receives' tasks (step 1)
        self.local: dict[Key, torch.Tensor] = {}  # hand-overs between stages of this rank
        self.posted: set[Key] = set()  # every receive of this rank's list, local ones too
        self.sent: list[Posted] = []  # point-to-point sends the driver issued (it waits)
        self.receives_posted: list[Posted] = []  # ... and receives the loop posted for it
        self.times = [0.0, 0.0]  # forward, backward compute seconds (the driver's)
        self.losses: list[torch.Tensor] = []
        self._cond = threading.Condition()
        self._arrived: dict[Key, Callable[[], torch.Tensor]] = {}
        self._error: BaseException | None = None

    # -- the loop's side -----------------------------------------------------------

    def arrive(self, key: Key, get: Callable[[], torch.Tensor]) -> None:
        """A receive ended: ``get()`` returns its tensor or raises its error."""
        with self._cond:
            self._arrived[key] = get
            self._cond.notify()

    def stop(self, error: BaseException) -> None:
        """End the step: the driver raises ``error`` at its next wait or action."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify()

    @property
    def error(self) -> BaseException | None:
        """Why the step stopped (``None`` while it runs)."""
        return self._error

    # -- the driver's side ---------------------------------------------------------

    def take(self, key: Key) -> torch.Tensor:
        """Wait for the receive of ``key`` (posted by the loop) and return its tensor."""
        with self._cond:
            while key not in self._arrived and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            get = self._arrived.pop(key)
        tensor = get()
        self.check()  # the step may have stopped while the receive waited
        return tensor

    def check(self) -> None:
        """Raise why the step stopped, if it has."""
        if self._error is not None:
            raise self._error

    def issue(self, send: Callable[..., None], *args: Any) -> None:
        """Have the loop call ``send(*args)`` (it issues a send), unless the step stops first."""
        self.loop.call_soon_threadsafe(self._issue, send, args)

    def _issue(self, send: Callable[..., None], args: tuple[Any, ...]) -> None:
        if self._error is not None:
            return
        try:
            send(*args)
        except BaseException as exc:  # e.g. the communicator closed: the step fails with it
            self.stop(exc)
