"""``GradSync``: average gradients over a communicator while backward still runs (DDP-style).

docs/overlap.md ("GradSync") describes buckets, hooks, ``wait()`` and unused parameters in
full; this note keeps what the code relies on.

Note on how a step goes
-----------------------
Buckets are filled walking the parameters in reverse order (backward produces the last
layers' gradients first), one dtype and device each; a gradient of 1 MiB or more is a
bucket of its own, all-reduced in place in its ``.grad``. A hook fires as each gradient is
accumulated, on the thread that runs backward, divides it by the number of ranks (in place,
or on its way into its bucket's flat buffer) and hands the bucket's turn to the event loop,
the only thread that may call the communicator. Buckets are all-reduced strictly in bucket
order, so every rank issues the same collectives in the same order whatever order its
gradients come in. With ``find_unused_parameters`` a forward hook finds the parameters the
output's graph does not reach (the first gradient hook puts them in), ``wait()`` puts in
those it could not foresee, and whether any rank used each parameter is summed in one more
small all-reduce.

Note on ranks of one host
-------------------------
Where every rank is on one host and the parameters are on the CPU, of one floating dtype,
the first synchronised ``wait()`` also makes a ``SharedSum`` (a collective, so every rank
does it at the same step); from the next step on, one bucket holds every gradient in this
rank's region of the shared memory, and ``wait()`` sums it there instead of all-reducing
buckets during backward (``shared_sum``'s note says why). The hooks, the unused-parameter
rules and ``wait()``'s result are the same either way; ``shared_memory=False`` keeps the
all-reduces (an overlap study wants them under backward).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from asyncomm._comm import Comm
from asyncomm._core.handle import Handle
from asyncomm._overlap.shared_sum import SharedSum, shared_sum

_MB = 1024 * 1024  # DDP's ``bucket_cap_mb`` counts mebibytes too
_FIRST_BUCKET_BYTES = _MB  # as DDP: a small first bucket starts communicating sooner
_ALONE_BYTES = _MB  # a gradient this large is all-reduced alone, in place: no copies


class _Bucket:
    """Some parameters whose gradients travel together in one collective.

    A bucket of one parameter is reduced in place, in the parameter's gradient
    (``flat`` is ``None``); a bucket of several copies them into one flat buffer.
    """

    __slots__ = ("fences", "flat", "handle", "in_place", "indices", "offsets", "pending",
                 "reduced", "shared")

    def __init__(self, indices: list[int], params: list[nn.Parameter],
                 shared: SharedSum | None = None) -> None:
        self.indices = indices  # into GradSync._params, in bucket order
        sizes = [params[i].numel() for i in indices]
        self.offsets = list(itertools.accumulate(sizes[:-1], initial=0))
        first = params[indices[0]]
        self.shared = shared  # summed through shared memory in wait(), not all-reduced
        self.flat: torch.Tensor | None = None
        if shared is not None:
            self.flat = shared.mine
        elif len(indices) > 1:
            self.flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        self.reduced = self.flat  # what this step all-reduces (alone: set by the hook)
        self.in_place = False  # alone, and ``reduced`` is the parameter's own .grad
        self.pending = len(indices)
        self.handle: Handle[torch.Tensor] | None = None
        self.fences: list[Any] = []  # CUDA events the all-reduce must wait for

    def view(self, position: int, param: nn.Parameter, averaged: bool = False) -> torch.Tensor:
        """The part of the flat buffer that holds the ``position``-th parameter's gradient
        (``averaged``: where the average is, after the bucket's reduction)."""
        flat = self.shared.total if averaged and self.shared is not None else self.flat
        assert flat is not None, "only a bucket of several parameters has a flat buffer"
        start = self.offsets[position]
        return flat[start:start + param.numel()].view_as(param)


def _fence(tensor: torch.Tensor) -> Any:
    """Mark the work queued so far on ``tensor``'s current CUDA stream (``None`` on CPU).

    A gradient copied into a bucket on a compute stream or an autograd thread's
    stream must be there before the all-reduce, which the loop thread issues on
    its own current stream.
    """
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # pragma: no cover
    event.record(torch.cuda.current_stream(tensor.device))  # pragma: no cover
    return event  # pragma: no cover


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output (nested in tuples, lists and dicts)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class GradSync:
    """Average the gradients of ``model`` over ``comm`` as backward produces them.

    Create it on every rank, on the same model structure, from the same
    starting parameters; then each step::

        loss.backward()               # or: await asyncomm.compute(loss.backward)
        await sync.wait()             # every .grad is now the average over the ranks
        optimizer.step()

    Gradients equal those of ``torch.nn.parallel.DistributedDataParallel`` on
    the same model, data and ranks. ``with sync.no_sync():`` accumulates
    gradients locally without communicating; the next synchronised step
    averages the accumulated gradients. One backward per synchronised step.

    Args:
        model: the module whose parameters (those that require grad) are averaged.
        comm: the communicator to average over; called on its event loop only.
        bucket_mb: bucket size in MiB (``25`` like DDP; the first bucket holds 1 MiB,
            as DDP's); a bucket is all-reduced as soon as every gradient in it is
            ready. A gradient of 1 MiB or more gets a bucket of its own, reduced in
            place in its ``.grad`` (so between backward and ``wait()`` that ``.grad``
            is in use). A tiny value gives one bucket per parameter.
        find_unused_parameters: let parameters get no gradient in a step (handled
            as DDP does). Without it, such a parameter makes ``wait()`` raise.
        shared_memory: where every rank is on one host and the parameters are on the
            CPU, of one floating dtype, sum the gradients through shared memory after
            backward from the second synchronised step on, instead of all-reducing
            buckets during it (``False``: always the all-reduces). A ``wait()`` that
            failed there leaves the ranks out of step: make a new ``GradSync``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``comm`` not a ``Comm``,
            ``bucket_mb`` not a number, ``find_unused_parameters`` or
            ``shared_memory`` not a bool, or the parameters' device or dtype is one
            ``comm`` cannot reduce.
        ValueError: ``model`` has no parameter that requires grad, or
            ``bucket_mb`` is not > 0.
    """

    def __init__(self, model: nn.Module, comm: Comm, bucket_mb: float = 25, *,
                 find_unused_parameters: bool = False, shared_memory: bool = True) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"GradSync: comm must be an asyncomm.Comm, not {type(comm).__name__}")
        what = f"rank {comm.rank}: GradSync"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{what}: model must be a torch.nn.Module, not {type(model).__name__}")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise TypeError(f"{what}: bucket_mb must be a number (MiB), "
                            f"not {type(bucket_mb).__name__}")
        if not (bucket_mb > 0 and math.isfinite(bucket_mb)):
            raise ValueError(f"{what}: bucket_mb must be > 0 and finite, got {bucket_mb}")
        for flag, value in (("find_unused_parameters", find_unused_parameters),
                            ("shared_memory", shared_memory)):
            if not isinstance(value, bool):
                raise TypeError(f"{what}: {flag} must be a bool, not {type(value).__name__}")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{what}: the model has no parameter that requires grad")
        self._comm = comm
        self._loop: asyncio.AbstractEventLoop = comm._loop
        self._what = what
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._find_unused = find_unused_parameters
        self._scale = 1.0 / comm.size
        self._use(self._assign(int(bucket_mb * _MB)))
        for bucket in self._buckets:
            first = self._params[bucket.indices[0]]
            comm._args.tensor(torch.empty(0, dtype=first.dtype, device=first.device), "GradSync",
                         f"the gradient of {self._names[bucket.indices[0]]}")
        dtypes = {p.dtype for p in self._params}
        # whether the first synchronised wait() tries to make a SharedSum (see the note)
        self._share = (shared_memory and comm.size > 1 and len(dtypes) == 1
                       and dtypes.pop().is_floating_point
                       and all(p.device.type == "cpu" for p in self._params))
        self._lock = threading.Lock()  # hooks may fire on several autograd threads at once
        self._syncing = True  # False inside no_sync()
        self._reset()
        self._hooks: list[Any] = [p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            self._make_hook(i)) for i, p in enumerate(self._params)]
        if find_unused_parameters:
            self._hooks.append(model.register_forward_hook(self._after_forward))

    def __repr__(self) -> str:
        return (f"<GradSync {len(self._params)} parameters in {len(self._buckets)} buckets "
                f"over {self._comm!r}>")

    def _use(self, buckets: list[_Bucket]) -> None:
        self._buckets = buckets
        self._where: list[tuple[int, int]] = [(0, 0)] * len(self._params)  # (bucket, position)
        for b, bucket in enumerate(buckets):
            for position, i in enumerate(bucket.indices):
                self._where[i] = (b, position)

    def _reset(self) -> None:
        """Start the next step (the first too: a step's state is set here); a bucket left in
        flight gets a fresh buffer."""
        with self._lock:
            for bucket in self._buckets:
                if bucket.handle is not None and not bucket.handle.done():
                    if bucket.flat is not None:  # the old one is still in use
                        bucket.flat = torch.zeros_like(bucket.flat)
                    elif bucket.in_place and bucket.reduced is not None:
                        param = self._params[bucket.indices[0]]  # its .grad is in use too
                        param.grad = bucket.reduced.clone()
                bucket.reduced = bucket.flat
                bucket.in_place = False
                bucket.handle = None
                bucket.pending = len(bucket.indices)
                bucket.fences.clear()
            self._ready = [False] * len(self._params)  # got its gradient this synchronised step
            self._used = [False] * len(self._params)  # since the last synchronised step
            self._next = 0  # the next bucket to issue
            self._issued: asyncio.Future[None] | None = None  # wait() waits for the last turns
            self._error: Exception | None = None  # an all-reduce that could not be issued
            self._reached: set[int] | None = None  # ids of the parameters forward reached
            self._foreseen: list[int] = []  # unused parameters the first hook puts in

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters' names, bucket by bucket, in the order buckets are all-reduced."""
        return [[self._names[i] for i in bucket.indices] for bucket in self._buckets]

    def _assign(self, cap: int) -> list[_Bucket]:
        """Split the parameters into buckets of about ``cap`` bytes, last parameters first.

        A bucket closes once it holds ``cap`` bytes or more (the first of each dtype and
        device at 1 MiB already, as DDP's); buckets are ordered by their last parameter,
        the one backward is expected to fill last (see the note on how a step goes).
        """
        closed: list[list[int]] = []
        open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
        started: set[tuple[torch.dtype, torch.device]] = set()  # closed a bucket already
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            if p.numel() * p.element_size() >= _ALONE_BYTES:
                closed.append([i])
                continue
            key = (p.dtype, p.device)
            indices, size = open_.get(key, ([], 0))
            indices.append(i)
            size += p.numel() * p.element_size()
            if size >= (cap if key in started else min(cap, _FIRST_BUCKET_BYTES)):
                closed.append(indices)
                started.add(key)
                open_.pop(key, None)
            else:
                open_[key] = (indices, size)
        closed += [indices for indices, _ in open_.values()]
        closed.sort(key=lambda indices: -indices[-1])  # in the order backward fills them
        return [_Bucket(indices, self._params) for indices in closed]

    # -- during forward and backward ---------------------------------------------------

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Find the parameters the autograd graph of ``output`` does not reach."""
        if not self._syncing or not torch.is_grad_enabled():
            return
        reached = self._reached if self._reached is not None else set()
        stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        reached.update(id(t) for t in _tensors(output) if t.grad_fn is None)
        seen: set[Any] = set()
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)  # an AccumulateGrad node: a leaf
            if variable is not None:
                reached.add(id(variable))
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
        with self._lock:  # several forwards in a step: a parameter any of them used is used
            self._reached = reached
            self._foreseen = [i for i, p in enumerate(self._params) if id(p) not in reached]

    def _make_hook(self, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._take(i, param.grad, hooked=True)
            if self._foreseen:
                with self._lock:
                    foreseen, self._foreseen = self._foreseen, []
                for j in foreseen:  # as DDP, at the first hook: their .grad, or zeros
                    if not self._ready[j]:
                        self._take(j, self._params[j].grad, hooked=False)

        return hook

    def _take(self, i: int, grad: torch.Tensor | None, hooked: bool) -> None:
        """Put the gradient of parameter ``i`` in its bucket (on whatever thread has it).

        ``hooked``: it came from backward (so the parameter was used), rather than
        from ``wait()`` standing in for a parameter that got none.
        """
        with self._lock:
            if hooked and grad is not None:
                self._used[i] = True
            if not self._syncing:
                return
            if self._ready[i]:
                raise RuntimeError(
                    f"{self._what}: parameter {self._names[i]} got a second gradient in one "
                    "step, or one after the model's forward did not reach it: call wait() "
                    "after each backward, accumulate inside no_sync(), and use parameters "
                    "only inside the model's forward")
            self._ready[i] = True
        b, position = self._where[i]
        bucket = self._buckets[b]
        if bucket.flat is None:
            view = self._alone(bucket, grad, hooked)
        else:
            view = bucket.view(position, self._params[i])
            if grad is None:
                view.zero_()
            else:
                torch.mul(grad, self._scale, out=view)  # divide on the way in, as DDP does
        fence = _fence(view)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._filled(b, fence)
        else:  # only the loop thread may call the communicator
            self._loop.call_soon_threadsafe(self._filled, b, fence)

    def _alone(self, bucket: _Bucket, grad: torch.Tensor | None, hooked: bool) -> torch.Tensor:
        """Choose what the bucket of one parameter all-reduces: its ``.grad`` itself if it can.

        A gradient that is not contiguous, or that ``wait()`` puts in for a parameter
        this rank did not use (a parameter no rank used must keep its ``.grad``), is
        reduced in a copy instead.
        """
        if hooked and grad is not None and grad.is_contiguous():
            bucket.reduced, bucket.in_place = grad.mul_(self._scale), True
        elif grad is None:
            param = self._params[bucket.indices[0]]
            bucket.reduced = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        else:
            bucket.reduced = torch.mul(grad, self._scale).contiguous()
        return bucket.reduced

    def _filled(self, b: int, fence: Any) -> None:
        """Count one more gradient of bucket ``b`` in; issue every bucket whose turn came."""
        bucket = self._buckets[b]
        if fence is not None:
            bucket.fences.append(fence)
        bucket.pending -= 1
        issued = self._issued
        try:
            while (self._error is None and self._next < len(self._buckets)
                   and self._buckets[self._next].pending == 0):
                self._issue(self._buckets[self._next])
                self._next += 1
        except Exception as exc:  # e.g. the communicator closed: wait() raises it
            self._error = exc
        if issued is not None and not issued.done():
            if self._error is not None:
                issued.set_exception(self._error)
            elif self._next == len(self._buckets):
                issued.set_result(None)

    def _issue(self, bucket: _Bucket) -> None:
        if bucket.shared is not None:
            return  # summed in wait(): every rank's collectives in the same order
        reduced = bucket.reduced
        assert reduced is not None, "a full bucket has its tensor"
        for fence in bucket.fences:  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(reduced.device).wait_event(fence)
        bucket.fences.clear()
        bucket.handle = self._comm.all_reduce(reduced)

    # -- after backward ----------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, inside the block."""
        with self._lock:
            was, self._syncing = self._syncing, False
        try:
            yield
        finally:
            with self._lock:
                self._syncing = was

    async def wait(self) -> None:
        """Return once every gradient is averaged over the ranks and written to ``.grad``.

        Call it on every rank after each synchronised backward (inside
        ``no_sync()`` it returns at once).

        Raises:
            RuntimeError: without ``find_unused_parameters``, some parameters got no
                gradient in this step (they are named).
            CommError: an all-reduce failed.
        """
        if not self._syncing:
            return
        try:
            with self._lock:
                missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self._find_unused:
                self._fail(missing)
            for i in missing:  # counted as DDP counts them: their .grad, or zeros
                self._take(i, self._params[i].grad, hooked=False)
            if self._error is not None:
                raise self._error
            if self._next < len(self._buckets):
                # Hooks that fired on another thread handed their buckets' turns to the
                # loop; those calls may still be queued behind this one.
                self._issued = self._loop.create_future()
                await self._issued
            used = None
            if self._find_unused:
                flags = torch.tensor(self._used, dtype=torch.int32)
                used = self._comm.all_reduce(flags.to(self._params[0].device))
            for bucket in self._buckets:
                if bucket.shared is not None:
                    await bucket.shared.sum()
                    continue
                assert bucket.handle is not None, "every bucket is issued by now"
                await bucket.handle
            anyone = [True] * len(self._params)
            if used is not None:
                anyone = (await used).cpu().bool().tolist()
            for bucket in self._buckets:
                self._unflatten(bucket, anyone)
        finally:
            self._reset()
        if self._share:  # the first synchronised step, on every rank (see the note)
            self._share = False
            total = sum(p.numel() for p in self._params)
            shared = await shared_sum(self._comm, total, self._params[0].dtype)
            if shared is not None:
                order = [i for bucket in self._buckets for i in bucket.indices]
                self._use([_Bucket(order, self._params, shared)])

    def _unflatten(self, bucket: _Bucket, anyone: list[bool]) -> None:
        """Copy the averages of ``bucket`` into ``.grad`` (of parameters some rank used)."""
        if bucket.flat is None:
            i, reduced = bucket.indices[0], bucket.reduced
            param = self._params[i]
            assert reduced is not None, "an issued bucket has its tensor"
            if bucket.in_place or not anyone[i]:
                return  # averaged where it lies; or used by no rank: left as it is
            if param.grad is None:
                param.grad = reduced
            else:
                param.grad.copy_(reduced)
            return
        for position, i in enumerate(bucket.indices):
            if not anyone[i]:
                continue  # used by no rank: DDP leaves its .grad as it is
            param = self._params[i]
            view = bucket.view(position, param, averaged=True)
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)

    def _fail(self, missing: list[int]) -> None:
        names = [self._names[i] for i in missing]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise RuntimeError(
            f"{self._what}: wait(): {len(names)} parameter(s) got no gradient in this step, "
            f"so their buckets were never all-reduced: {shown}. Parameters that do not take "
            "part in every step need GradSync(..., find_unused_parameters=True); "
            "parameters that never do can be frozen (requires_grad=False)")

    def close(self) -> None:
        """Remove the hooks from the model's parameters; the model trains alone again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
