"""Debug mode (``ASYNCOMM_DEBUG=1``): ranks agree on every collective before it is issued.

A collective issued with different arguments on different ranks (another op, dtype, shape
or root at the same step) hangs, returns garbage or halts gloo in the process (a size
mismatch, which gloo raises on its own thread: see ``gloo_halt``). In debug mode each
collective first all-gathers a *fingerprint* (op, step, dtype, shape, root, reduction) on
the same communicator, and is issued only if every rank's agrees. If they differ, every
rank's handle fails with a ``MismatchError`` that names what each rank called, nothing is
issued, and later collectives on the communicator fail at once (the ranks are no longer in
step). Fingerprints and collectives alternate on the communicator, so a collective waits
for the one before it to be issued. Point-to-point operations are not checked.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncomm._core.backend import Backend
from asyncomm._core.errors import CommError, MismatchError
from asyncomm._core.handle import Handle

FINGERPRINT_BYTES = 256


def _t(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _op(op: Any) -> str:
    return str(op.value)


# What must agree, per collective: arguments that legitimately differ between ranks
# (gather's outputs, scatter's chunks, all_to_all's shapes) are left out.
_FINGERPRINTS: dict[str, Callable[[Sequence[Any]], list[str]]] = {
    "barrier": lambda a: [],
    "broadcast": lambda a: [_t(a[0]), f"src={a[1]}"],
    "all_reduce": lambda a: [_t(a[0]), _op(a[1])],
    "reduce": lambda a: [_t(a[0]), f"dst={a[1]}", _op(a[2])],
    "all_gather": lambda a: [_t(a[1])],
    "gather": lambda a: [_t(a[1]), f"dst={a[2]}"],
    "scatter": lambda a: [_t(a[0]), f"src={a[2]}"],
    "reduce_scatter": lambda a: [_t(a[0]), f"{len(a[1])} chunks", _op(a[2])],
    "all_to_all": lambda a: [f"{len(a[1])} x {str(a[1][0].dtype).removeprefix('torch.')}"],
}


def checked(op: str) -> bool:
    """Return whether ``op`` is a collective that debug mode checks."""
    return op in _FINGERPRINTS


class Checker:
    """Check each collective's fingerprint across the ranks of one communicator, in order."""

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop) -> None:
        self._backend = backend
        self._loop = loop
        self._steps = 0
        self._queue: collections.deque[tuple[Handle[Any], str, Callable[[], None]]] = (
            collections.deque())
        self._busy = False
        self._broken: MismatchError | None = None
        self._device = (torch.device("cuda", torch.cuda.current_device()) if backend.cuda
                        else None)

    def submit(self, handle: Handle[Any], op: str, args: Sequence[Any],
               start: Callable[[], None]) -> None:
        """Issue ``start()`` for ``handle`` once every rank's fingerprint of it agrees."""
        if self._broken is not None:
            handle._fail(MismatchError, self._broken)
            return
        self._steps += 1
        fingerprint = " ".join([op, *_FINGERPRINTS[op](args)])
        self._queue.append((handle, f"#{self._steps} {fingerprint}", start))
        self._next()

    def _next(self) -> None:
        if self._busy or not self._queue:
            return
        self._busy = True
        _, mine, _ = self._queue[0]
        backend, device = self._backend, self._device
        data = mine.encode()[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES, b"\0")
        sent = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        gathered = list(torch.empty((backend.size, FINGERPRINT_BYTES), dtype=torch.uint8,
                                    device=device).unbind(0))
        exchange: Handle[None] = Handle(self._loop,
                                        (backend.rank, "debug check", self._steps, None, None),
                                        None, (sent, gathered))
        exchange.add_done_callback(lambda done: self._compare(done, mine, gathered))
        backend.all_gather(exchange, gathered, sent)

    def _compare(self, exchange: Handle[None], mine: str, gathered: list[torch.Tensor]) -> None:
        handle, _, start = self._queue.popleft()
        self._busy = False
        try:
            exchange.result()
        except CommError as exc:
            handle._fail(type(exc), exc)
        else:
            calls = [bytes(t.cpu().numpy().tobytes()).rstrip(b"\0").decode(errors="replace")
                     for t in gathered]
            if any(call != mine for call in calls):
                error = self._mismatch(calls)
                handle._fail(MismatchError, error)
                self._fail_all(error)
                return
            start()
        self._next()

    def _mismatch(self, calls: list[str]) -> MismatchError:
        ranks: dict[str, list[int]] = {}
        for rank, call in enumerate(calls):
            ranks.setdefault(call, []).append(rank)
        sides = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {call}"
                          for call, r in ranks.items())
        return MismatchError(f"rank {self._backend.rank}: collectives differ between ranks "
                             f"({sides}); nothing was issued, and this communicator's "
                             f"collectives fail from now on")

    def _fail_all(self, error: MismatchError) -> None:
        self._broken = error
        queued, self._queue = self._queue, collections.deque()
        for handle, _, _ in queued:
            handle._fail(MismatchError, error)
