"""Run a pipeline schedule on real ranks: ``loss = await Pipeline(...).step(x, y)``.

docs/pipelines.md ("Running a schedule") says in full how a step runs, how its messages
travel, what a failure does and how the loss is scaled; the notes keep what the code needs.

Note on how a step runs
-----------------------
Each rank executes its own action list in order, unchecked: ``validate`` (in ``__init__``)
has made sure that every action finds what it needs. Every receive of the step is posted
when it starts (the router buffers what arrives anyway) and awaited only by the F or B that
needs its tensor; sends are awaited at the step's end (their tensors are never written
again). Passes run through ``asyncomm.compute``, or on the loop thread itself (``_inline``)
once nothing needs the loop to move the messages: from the second step on, on a backend
whose operations progress on their own threads (gloo, nccl); on MPI, from the step after
one whose every send was done when issued, and not with ``grad_sync`` (its reductions need
the polls). A send found pending hands the step's later passes back to the compute thread.

Note on messages
----------------
In the first step messages travel on channels of ``comm``, one per (direction, stage
boundary, microbatch), from ``tag_base`` up: ``3 * n_stages * n_microbatches`` virtual tags
(the third direction is ``forward``'s). A channel delivers in order per sender, so step
k+1's message on a tag never passes step k's. From the second step on (``fixed_shapes``),
each is one point-to-point send into a receive of its first step's shape and dtype, posted
at the step's start on the pipeline's own communicator (made at the start of the first
step), tag = the channel's offset from ``tag_base``. A boundary inside one rank hands the
tensor over locally.

Note on failure
---------------
A rank whose step (or ``forward``) raises once started tells every other rank on one more
channel (``tag_base + 3 * n_stages * n_microbatches``); every step watches that channel and
stops with ``RemoteError`` (what it posted stays posted), as does the next step of a rank
that had finished its own. A notice names the pipeline it comes from (the how-manieth made
on ``comm`` with this ``tag_base``, counted alike on every rank), so one from a pipeline
given up does not stop its successor. Later steps of a failed pipeline raise
``RuntimeError``: its messages may still arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import traceback
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from asyncomm._backends.split_backward import torch_split
from asyncomm._core.errors import CommError, RemoteError
from asyncomm._overlap.compute import compute, run_here
from asyncomm.pipeline._passes import (
    Slot,
    StepStats,
    input_gradient,
    weight_gradient,
    whole_backward,
)
from asyncomm.pipeline._schedule import Action, Op, Schedule
from asyncomm.pipeline._simulate import validate

if TYPE_CHECKING:
    from asyncomm._comm import Comm
    from asyncomm._messaging.channels import Channel

T = TypeVar("T")

#: First channel tag of a pipeline's messages (far above the tags people pick by hand).
DEFAULT_TAG_BASE = 1 << 48

_FORWARD, _BACKWARD, _EVAL, _NOTICES = 0, 1, 2, 3  # message directions (notices: one tag)
_NOTICE_S = 5.0  # how long a failing rank tries to tell each other rank (see the note)
_Heard = CommError | tuple[int, dict[str, Any]]  # a failure told: see ``_notice``
# pipelines made so far per communicator and tag_base: every rank numbers its pipelines alike
_generations: weakref.WeakKeyDictionary[Comm, dict[int, int]] = weakref.WeakKeyDictionary()


class Incoming:
    """A point-to-point receive posted when a step starts: awaiting it gives its tensor.

    Awaited straight from its handle (no task per receive). Like a posted receive, it
    cannot be taken back (``cancel`` does nothing): its handle keeps the buffer.
    """

    __slots__ = ("_buffer", "_handle")

    def __init__(self, handle: Any, buffer: torch.Tensor) -> None:
        self._handle, self._buffer = handle, buffer

    def cancel(self) -> bool:
        return False

    def __await__(self) -> Any:
        yield from self._handle.__await__()
        return self._buffer


# a step's receives, by (direction, stage, microbatch)
Inbox = dict[tuple[int, int, int], "asyncio.Future[torch.Tensor] | Incoming"]


class GradSyncLike(Protocol):
    """What the executor needs of a data-parallel gradient synchroniser (``GradSync``)."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """Return a context in which backward passes do not start gradient reduction."""

    def wait(self) -> Awaitable[Any]:
        """Return an awaitable that is done once every gradient is reduced."""


class Pipeline:
    """Run ``schedule`` on this rank's stages of a model, one ``step`` per batch.

    Every rank of ``comm`` makes one with the same schedule and calls
    ``step`` the same number of times.

    Args:
        comm: the ranks of the pipeline (``schedule.n_ranks`` of them); with
            data parallelism, this replica's pipeline group.
        schedule: the actions of every rank (``asyncomm.pipeline.get(...)``).
        stages: the stage modules: either every stage in order (``split``'s
            list; this rank keeps its own) or a mapping from global stage
            index to module holding exactly ``schedule.stages_of(comm.rank)``.
            A stage takes one tensor and returns one tensor.
        loss_fn: ``loss_fn(output, target)`` on the last stage's output, a
            scalar tensor (a mean over the microbatch for batch-exact gradients).
        grad_sync: optional data-parallel gradient synchroniser (``GradSync``):
            every backward but the last of each stage on this rank runs inside
            its ``no_sync()``, and ``step`` awaits its ``wait()`` at the end.
        tag_base: first channel tag used; pipelines sharing ``comm`` need
            ranges that do not overlap (each uses ``3 * n_stages *
            n_microbatches + 1`` tags).
        fixed_shapes: after the first step, send each activation and gradient as one
            point-to-point operation into a buffer of its first-step shape and dtype
            (much faster on gloo); a message that then differs raises ``ValueError``
            on its sender, before sending, and ``RemoteError`` on the rank waiting
            for it. ``False``: every message travels on a channel, of any shape.

    Raises:
        ScheduleError: ``schedule`` is broken (``validate``), before anything is sent.
        ValueError, TypeError: the schedule does not fit ``comm``, or the stages do
            not fit the schedule.
    """

    def __init__(self, comm: Comm, schedule: Schedule,
                 stages: Sequence[nn.Module] | Mapping[int, nn.Module],
                 loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], *,
                 grad_sync: GradSyncLike | None = None,
                 tag_base: int = DEFAULT_TAG_BASE, fixed_shapes: bool = True) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"rank {comm.rank}: Pipeline: schedule must be a Schedule, "
                            f"not {type(schedule).__name__}")
        if schedule.n_ranks != comm.size:
            raise ValueError(f"rank {comm.rank}: Pipeline: schedule {schedule.name!r} is for "
                             f"{schedule.n_ranks} ranks, the communicator has {comm.size}")
        if not callable(loss_fn):
            raise TypeError(f"rank {comm.rank}: Pipeline: loss_fn must be callable")
        if isinstance(tag_base, bool) or not isinstance(tag_base, int) or tag_base < 0:
            raise ValueError(f"rank {comm.rank}: Pipeline: tag_base must be an int >= 0, "
                             f"not {tag_base!r}")
        if not isinstance(fixed_shapes, bool):
            raise TypeError(f"rank {comm.rank}: Pipeline: fixed_shapes must be a bool, "
                            f"not {type(fixed_shapes).__name__}")
        validate(schedule)  # a broken schedule fails here, on every rank, not mid-step
        if fixed_shapes and 2 * schedule.n_stages * schedule.n_microbatches > comm.max_tag:
            raise ValueError(f"rank {comm.rank}: Pipeline: {schedule.n_stages} stages x "
                             f"{schedule.n_microbatches} microbatches need more tags than "
                             f"{comm.backend} has ({comm.max_tag}); use fixed_shapes=False")
        mine = schedule.stages_of(comm.rank)
        if isinstance(stages, Mapping):
            if sorted(stages) != sorted(mine):
                raise ValueError(f"rank {comm.rank}: Pipeline: stages {sorted(stages)} given, "
                                 f"schedule {schedule.name!r} puts stages {list(mine)} here")
        elif isinstance(stages, nn.Module) or len(stages) != schedule.n_stages:
            raise ValueError(f"rank {comm.rank}: Pipeline: give all {schedule.n_stages} "
                             "stages in order (or a mapping stage -> module)")
        modules = {s: stages[s] for s in mine}
        for s, module in modules.items():
            if not isinstance(module, nn.Module):
                raise TypeError(f"rank {comm.rank}: Pipeline: stage {s} is a "
                                f"{type(module).__name__}, not an nn.Module")
        self.comm = comm
        self.schedule = schedule
        self.stages: dict[int, nn.Module] = modules
        self.loss_fn = loss_fn
        self.grad_sync = grad_sync
        self.tag_base = tag_base
        self.fixed_shapes = fixed_shapes
        self.rank = comm.rank
        # (direction, boundary, microbatch) -> the shape and dtype of its first-step message
        self._shapes: dict[tuple[int, int, int], tuple[torch.Size, torch.dtype]] = {}
        self._group: Comm | None = None  # the pipeline's own communicator (first step on)
        self._p2p: Comm | None = None  # ... once its messages' shapes are known (step 2 on)
        self._inline = False  # passes run on the loop thread (see the note on a step)
        self._moved_alone = True  # the step's sends so far needed no loop (MPI: done at once)
        self._failed: str | None = None  # a step that raised: its messages may still come
        self._closed = False
        self._steps = 0  # steps started
        self._telling: asyncio.Future[None] | None = None  # a cancelled step's notice on its way
        self._heard: _Heard | None = None  # a notice the last step took as it ended
        made = _generations.setdefault(comm, {})
        self._generation = made.get(tag_base, 0)  # see the note on failure
        made[tag_base] = self._generation + 1
        # where failures are told (a world of one has nobody to tell)
        self._notices = comm.channel(self._tag(_NOTICES, 0, 0)) if comm.size > 1 else None
        self.actions: tuple[Action, ...] = schedule.actions[comm.rank]
        self.last: StepStats | None = None  # the latest step's times
        # The last pass of each stage that accumulates weight gradients (W where backwards
        # are split, else B) runs outside grad_sync's no_sync: it starts the reduction.
        self._split = schedule.splits_backward
        if self._split:
            torch_split()  # torch's own split found now, not in the first step's backward
        accumulates = Op.W if self._split else Op.B
        last_b = {a.stage: i for i, a in enumerate(self.actions) if a.op is accumulates}
        self._last_backward = frozenset(last_b.values())
        # what a split backward's W differentiates, per stage (B hands it to torch's split)
        self._trainable = {s: [p for p in m.parameters() if p.requires_grad]
                         for s, m in modules.items()}

    @property
    def first(self) -> bool:
        """Whether this rank hosts stage 0 (it needs the inputs)."""
        return 0 in self.stages

    @property
    def last_stage(self) -> bool:
        """Whether this rank hosts the last stage (it needs the targets, returns the loss)."""
        return self.schedule.n_stages - 1 in self.stages

    def parameters(self) -> list[nn.Parameter]:
        """Return the parameters of this rank's stages (for its optimizer)."""
        return [p for s in sorted(self.stages) for p in self.stages[s].parameters()]

    async def step(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
                   targets: Any = None) -> float | None:
        """Run one forward and backward of a batch through the pipeline.

        Gradients accumulate in the stage parameters (zero them between steps).

        Args:
            inputs: on the rank of stage 0: the batch (split along dim 0 into
                ``n_microbatches`` equal parts) or a list of microbatches;
                ignored elsewhere.
            targets: on the rank of the last stage: the batch's targets
                (split the same way) or a list; ignored elsewhere.

        Returns:
            On the last stage's rank the loss, the mean of the microbatch
            losses; ``None`` on the other ranks.

        Raises:
            ValueError: inputs or targets missing where needed, a batch that
                does not split into equal microbatches, or (``fixed_shapes``) a
                message whose shape or dtype differs from the first step's.
            RuntimeError: the pipeline is closed, or an earlier step of it raised.
            RemoteError: another rank's step raised (see the note on failure).
        """
        xs = self._microbatches(inputs, "inputs") if self.first else None
        ys = self._microbatches(targets, "targets") if self.last_stage else None
        self._check_usable()
        self._steps += 1
        if self.fixed_shapes and self._group is None:
            # Made here, before any rank can fail mid-step: a group left half made by a step
            # that a failure notice stopped would make the ranks disagree on later groups' names.
            self._group = await self.comm.group(range(self.comm.size))
        return await self._guarded(f"step {self._steps}", self._step(xs, ys))

    def _check_usable(self, closed_too: bool = True) -> None:
        if self._closed and closed_too:
            raise RuntimeError(f"rank {self.rank}: pipeline {self.schedule.name!r} is closed")
        if self._failed is not None:
            raise RuntimeError(f"rank {self.rank}: pipeline {self.schedule.name!r}: an earlier "
                               f"step failed ({self._failed}); its messages may still arrive "
                               "and would be taken for this step's: make a new Pipeline")

    async def _step(self, xs: list[Any] | None, ys: list[Any] | None) -> float | None:
        n = self.schedule.n_microbatches
        slots: dict[tuple[int, int], Slot] = {}
        inbox: Inbox = {}
        sends: list[Awaitable[None]] = []  # channel sends' tasks, point-to-point handles
        times = [0.0, 0.0]  # forward, backward compute seconds
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        self._moved_alone = self._p2p is not None  # (the first step's are channels')
        try:
            self._post_receives(inbox)
            for index, action in enumerate(self.actions):
                slot = slots.setdefault((action.stage, action.microbatch), Slot())
                op = action.op
                if op is Op.F:
                    await self._forward(index, action, slot, xs, ys, inbox, times, losses)
                elif op is Op.B:
                    await self._backward(index, action, slot, inbox, times, n)
                elif op is Op.W:
                    await self._weights(index, action, slot, times, n)
                elif op is Op.SEND_F:
                    self._send(index, action, _FORWARD, slot.to_send, inbox, sends)
                    slot.to_send = None
                elif op is Op.SEND_B:
                    self._send(index, action, _BACKWARD, slot.grad_input, inbox, sends)
                    slot.grad_input = None
                if slot.finished():
                    del slots[action.stage, action.microbatch]  # nothing left to do: free it
            for sent in sends:
                await sent
            if self.grad_sync is not None:
                await self.grad_sync.wait()
            if self.fixed_shapes and self._p2p is None:  # from the next step on
                self._p2p = self._group
            if self._p2p is not None:  # passes run here next step where nothing needs the loop
                self._inline = self._p2p.progresses_alone or (
                    self._moved_alone and self.grad_sync is None)
        finally:
            for fut in inbox.values():
                fut.cancel()  # a cancelled channel receive loses nothing
            for sent in sends:
                if isinstance(sent, asyncio.Task):
                    sent.cancel()  # a handle cannot be; nor need it: its buffer is kept
        end = time.perf_counter()
        self.last = StepStats(end - start, times[0] + times[1], times[0], times[1], start, end)
        if not losses:
            return None
        return float(torch.stack(losses).sum().item()) / n

    async def close(self) -> None:
        """Close the pipeline's own communicator; every rank calls it (idempotent).

        ``comm.close()`` closes it too; ``close`` lets a program that makes many
        pipelines on one ``comm`` free each as it is done with it.
        """
        self._closed = True
        if self._telling is not None:
            await asyncio.wait((self._telling,), timeout=_NOTICE_S)
        if self._group is not None:
            await self._group.close()

    async def forward(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None = None
                      ) -> torch.Tensor | None:
        """Run the batch forward only, without gradients (evaluation).

        Every rank calls it. Microbatches go stage by stage in microbatch
        order, whatever the schedule.

        Args:
            inputs: on the rank of stage 0, the batch (split along dim 0 into
                ``n_microbatches`` parts, equal or not) or a list of parts.

        Returns:
            On the last stage's rank, the outputs concatenated along dim 0;
            ``None`` elsewhere.

        Raises:
            ValueError, TypeError: ``inputs`` missing where needed, or not a batch.
            RuntimeError: an earlier step of this pipeline raised.
            RemoteError: another rank's ``forward`` raised (see the note on failure).
        """
        xs = self._microbatches(inputs, "inputs", exact=False) if self.first else None
        self._check_usable(closed_too=False)  # forward needs only ``comm``'s channels
        return await self._guarded("forward", self._forward_only(xs))

    async def _forward_only(self, xs: list[Any] | None) -> torch.Tensor | None:
        n = self.schedule.n_microbatches
        last = self.schedule.n_stages - 1
        sends: list[asyncio.Task[None]] = []
        outputs: list[torch.Tensor] = []
        local: dict[tuple[int, int], torch.Tensor] = {}  # boundaries inside this rank
        for stage in sorted(self.stages):
            module = self.stages[stage]
            for mb in range(n):
                if stage == 0:
                    assert xs is not None
                    x = xs[mb]
                elif (stage - 1, mb) in local:
                    x = local.pop((stage - 1, mb))
                else:
                    ch = self.comm.channel(self._tag(_EVAL, stage - 1, mb))
                    x = (await ch.recv(self.schedule.rank_of(stage - 1))).data

                def run(module: nn.Module = module, x: torch.Tensor = x,
                        stage: int = stage) -> torch.Tensor:
                    with torch.no_grad():
                        return self._check_output(module(x), stage)

                y = await compute(run, name=f"eval s{stage}")
                peer = self.schedule.rank_of(stage + 1) if stage < last else -1
                if stage == last:
                    outputs.append(y)
                elif peer == self.rank:
                    local[stage, mb] = y
                else:
                    ch = self.comm.channel(self._tag(_EVAL, stage, mb))
                    sends.append(asyncio.ensure_future(ch.send(y.contiguous(), peer)))
        if sends:
            await asyncio.gather(*sends)
        return torch.cat(outputs) if outputs else None

    async def _guarded(self, what: str, body: Coroutine[Any, Any, T]) -> T:
        """Run ``body``; stop it if another rank fails, and tell the others if it fails."""
        notices = self._notices
        if notices is None:
            return await body
        if self._heard is not None:  # told as the previous step ended: this one stops
            body.close()  # (named in the error: the failure is of the step it stops)
            error, self._heard = self._told(what, self._heard), None
            self._failed = _gist(error)
            raise error
        watch = asyncio.ensure_future(self._notice(notices))
        task = asyncio.ensure_future(body)
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                try:
                    return task.result()
                except BaseException as exc:
                    self._failed = _gist(exc)
                    await self._tell(notices, exc)
                    raise
            self._failed = _gist(error := self._told(what, watch.result()))
            task.cancel()  # what it posted stays posted: its buffers stay with the handles
            await asyncio.wait((task,))
            raise error
        except asyncio.CancelledError as exc:  # the caller gave up on this rank's step
            if self._failed is None:
                self._failed = "cancelled"
                self._telling = asyncio.ensure_future(self._tell(notices, exc))
            raise
        finally:
            watch.cancel()  # a cancelled channel receive loses nothing
            task.cancel()
            if self._failed is None and watch.done() and not watch.cancelled():
                self._heard = watch.result()  # taken as the step ended: kept for the next

    async def _notice(self, notices: Channel) -> _Heard:
        """The first failure another rank tells of (its rank, its notice), or the watch's error."""
        while True:
            try:
                msg = await notices.recv(timeout=math.inf)
            except CommError as exc:
                return exc
            if isinstance(msg.data, dict) and msg.data.get("generation") == self._generation:
                return msg.src, msg.data

    def _told(self, what: str, heard: _Heard) -> CommError:
        """The error that stops ``what`` (a step) for ``heard``, as ``_notice`` returned it."""
        if isinstance(heard, CommError):
            return heard
        src, notice = heard
        return RemoteError(f"rank {self.rank}: pipeline {self.schedule.name!r} {what}: rank "
                           f"{src} failed: {notice.get('error')}", src,
                           str(notice.get("traceback", "")))

    async def _tell(self, notices: Channel, exc: BaseException) -> None:
        """Tell every other rank that this rank's step failed, and how (best effort)."""
        notice = {"generation": self._generation, "error": _gist(exc),
                  "traceback": "".join(traceback.format_exception(exc))}
        await asyncio.gather(*(notices.send(notice, peer, timeout=_NOTICE_S)
                               for peer in range(self.comm.size) if peer != self.rank),
                             return_exceptions=True)

    def _what(self, index: int, action: Action) -> str:
        return f"rank {self.rank}: pipeline {self.schedule.name!r} action #{index} ({action})"

    def _offset(self, direction: int, boundary: int, microbatch: int) -> int:
        """The message's number: its point-to-point tag, its channel's offset from ``tag_base``."""
        sched = self.schedule
        return (direction * sched.n_stages + boundary) * sched.n_microbatches + microbatch

    def _tag(self, direction: int, boundary: int, microbatch: int) -> int:
        """The channel of ``direction`` across the boundary after stage ``boundary``."""
        return self.tag_base + self._offset(direction, boundary, microbatch)

    def _microbatches(self, given: Any, what: str, exact: bool = True) -> list[Any]:
        n = self.schedule.n_microbatches
        if given is None:
            raise ValueError(f"rank {self.rank}: Pipeline: {what} are needed on this rank "
                             "(it hosts the " + ("first" if what == "inputs" else "last")
                             + " stage)")
        if isinstance(given, torch.Tensor):
            if given.dim() == 0 or (exact and given.shape[0] % n):
                raise ValueError(f"rank {self.rank}: Pipeline: {what} of shape "
                                 f"{tuple(given.shape)} do not split into {n} equal "
                                 "microbatches along dim 0")
            return list(torch.tensor_split(given, n))
        if isinstance(given, (list, tuple)):
            if len(given) != n:
                raise ValueError(f"rank {self.rank}: Pipeline: {len(given)} {what} given, the "
                                 f"schedule has {n} microbatches")
            return list(given)
        raise TypeError(f"rank {self.rank}: Pipeline: {what} must be a tensor or a list of "
                        f"{n} microbatches, not {type(given).__name__}")

    def _post_receives(self, inbox: Inbox) -> None:
        """Post every receive of this rank's list; a local hand-over waits for its send."""
        loop = asyncio.get_running_loop()
        for action in self.actions:
            if action.op not in (Op.RECV_F, Op.RECV_B):
                continue
            forward = action.op is Op.RECV_F
            sender = action.stage - 1 if forward else action.stage + 1
            key = (_FORWARD if forward else _BACKWARD, sender, action.microbatch)
            peer = self.schedule.rank_of(sender)
            if peer == self.rank:
                inbox[key] = loop.create_future()
            elif self._p2p is not None:
                shape, dtype = self._shapes[key]
                buffer = torch.empty(shape, dtype=dtype)
                inbox[key] = Incoming(self._p2p.recv(buffer, peer, self._offset(*key)), buffer)
            else:
                inbox[key] = asyncio.ensure_future(self._receive(key, peer))

    async def _receive(self, key: tuple[int, int, int], peer: int) -> torch.Tensor:
        msg = await self.comm.channel(self._tag(*key)).recv(peer)
        data = msg.data
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"rank {self.rank}: pipeline {self.schedule.name!r}: message "
                            f"{key} from rank {peer} is a {type(data).__name__}, not a tensor")
        self._shapes[key] = (data.shape, data.dtype)
        return data

    def _send(self, index: int, action: Action, direction: int, tensor: torch.Tensor | None,
              inbox: Inbox, sends: list[Awaitable[None]]) -> None:
        assert tensor is not None  # (see the note on how a step runs)
        dst_stage = action.stage + 1 if direction == _FORWARD else action.stage - 1
        peer = self.schedule.rank_of(dst_stage)
        key = (direction, action.stage, action.microbatch)
        if peer == self.rank:
            fut = inbox[key]
            assert isinstance(fut, asyncio.Future)  # a local hand-over's
            fut.set_result(tensor)
            return
        if self._p2p is None:
            self._shapes[key] = (tensor.shape, tensor.dtype)
            channel = self.comm.channel(self._tag(*key))
            sends.append(asyncio.ensure_future(channel.send(tensor.contiguous(), peer)))
            return
        shape, dtype = self._shapes[key]
        if tensor.shape != shape or tensor.dtype != dtype:
            what = "output" if direction == _FORWARD else "input gradient"
            raise ValueError(
                f"{self._what(index, action)}: the {what} of stage {action.stage} for "
                f"microbatch {action.microbatch} is {tuple(tensor.shape)} {tensor.dtype}, in "
                f"the first step it was {tuple(shape)} {dtype}: with fixed_shapes=True every "
                "message keeps its first step's shape and dtype (use Pipeline(..., "
                "fixed_shapes=False) for shapes that change)")
        sent = self._p2p.send(tensor.contiguous(), peer, self._offset(*key))
        if not sent.done() and not self._p2p.progresses_alone:
            self._moved_alone = self._inline = False  # the loop must move it: leave it free
        sends.append(sent)

    async def _forward(self, index: int, action: Action, slot: Slot, xs: list[Any] | None,
                       ys: list[Any] | None, inbox: Inbox, times: list[float],
                       losses: list[torch.Tensor]) -> None:
        stage, mb = action.stage, action.microbatch
        module = self.stages[stage]
        if stage == 0:
            assert xs is not None
            x = xs[mb]
        else:
            x = (await inbox[_FORWARD, stage - 1, mb]).detach()
            if x.is_floating_point() or x.is_complex():
                x.requires_grad_(True)
        target = ys[mb] if ys is not None and stage == self.schedule.n_stages - 1 else None
        last = stage == self.schedule.n_stages - 1

        def run() -> tuple[torch.Tensor, torch.Tensor | None, float]:
            begin = time.perf_counter()
            out = self._check_output(module(x), stage)
            loss = self.loss_fn(out, target) if last else None
            return out, loss, time.perf_counter() - begin

        out, loss, took = await self._pass(run, f"F{mb}@s{stage}")
        times[0] += took
        slot.inputs, slot.output = x, out
        if not last:
            slot.to_send = out.detach()
        if loss is not None:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"{self._what(index, action)}: loss_fn must return a scalar")
            slot.loss = loss
            losses.append(loss.detach())

    async def _backward(self, index: int, action: Action, slot: Slot, inbox: Inbox,
                        times: list[float], n: int) -> None:
        stage, mb = action.stage, action.microbatch
        grad = None
        if slot.loss is None:
            grad = await inbox[_BACKWARD, stage + 1, mb]
        if self._split:  # B: the input's gradient only; what W needs is kept
            grad_input, took = await self._pass(functools.partial(
                input_gradient, slot, grad, n, stage, self._trainable[stage],
                self.grad_sync is not None), f"B{mb}@s{stage}")
            slot.weights_pending = True
        else:
            with self._quiet(index):
                grad_input, took = await self._pass(functools.partial(
                    whole_backward, slot, grad, n, stage), f"B{mb}@s{stage}")
            slot.inputs = slot.output = slot.loss = None
        times[1] += took
        slot.grad_input = grad_input
        slot.backward_done = True

    async def _weights(self, index: int, action: Action, slot: Slot, times: list[float],
                       n: int) -> None:
        """W: the weights' gradients of a split backward, from what its B kept; then free it."""
        stage, mb = action.stage, action.microbatch
        with self._quiet(index):
            took = await self._pass(functools.partial(weight_gradient, slot, n,
                                                      self._trainable[stage]), f"W{mb}@s{stage}")
        times[1] += took
        slot.inputs = slot.output = slot.loss = slot.grad_output = slot.param_groups = None
        slot.weights_pending = False

    async def _pass(self, fn: Callable[[], T], name: str) -> T:
        """Run a stage's pass: on the compute thread, or here (see the note on a step)."""
        return run_here(fn, name) if self._inline else await compute(fn, name=name)

    def _quiet(self, index: int) -> AbstractContextManager[Any]:
        """``grad_sync.no_sync()`` but for the last pass of a stage that accumulates weights."""
        sync = self.grad_sync
        if sync is not None and index not in self._last_backward:
            return sync.no_sync()
        return contextlib.nullcontext()

    def _check_output(self, out: Any, stage: int) -> torch.Tensor:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"rank {self.rank}: pipeline stage {stage} returned a "
                            f"{type(out).__name__}; a stage must return one tensor")
        return out


def _gist(exc: BaseException) -> str:
    """An error in one line: its type and message."""
    return f"{type(exc).__name__}: {exc}"
