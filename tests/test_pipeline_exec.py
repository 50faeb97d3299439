"""The pipeline executor: loss and gradients equal single-process training, every schedule.

Each check builds the same seeded model on every rank, runs the pipeline over real ranks
(two steps of different batches, so gradients accumulate and step 2's messages must not mix
with step 1's), and compares the loss on the last stage's rank and every parameter's
gradient on every rank with the whole model trained in one process on the same
microbatches. One world run per backend and size checks every schedule.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from torch import nn

from asyncomm import Comm, GradSync, RemoteError, pipeline
from asyncomm.testing import World

WIDTH, MICROBATCHES, BATCH = 6, 4, 8


def build(n_stages: int) -> nn.Sequential:
    """The model: ``n_stages`` blocks (Linear, Tanh), the last a Linear alone; float64."""
    torch.manual_seed(1234)
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                               for _ in range(n_stages - 1)]
    blocks.append(nn.Linear(WIDTH, 3))
    return nn.Sequential(*blocks).double()


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64),
             torch.randn(BATCH, 3, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def reference(n_stages: int, data: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[nn.Sequential, list[float]]:
    """Train the whole model in one process on the same microbatches (mean loss)."""
    model = build(n_stages)
    losses = []
    for x, y in data:
        parts = [nn.functional.mse_loss(model(xm), ym)
                 for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)]
        loss = torch.stack(parts).mean()
        loss.backward()
        losses.append(loss.item())
    return model, losses


async def run_pipeline(comm: Comm, schedule: pipeline.Schedule,
                       data: list[tuple[torch.Tensor, torch.Tensor]], dp: Comm | None = None
                       ) -> tuple[pipeline.Pipeline, list[float | None]]:
    """Run ``data`` through a pipeline on ``comm``; ``dp``: average its gradients with GradSync."""
    model = build(schedule.n_stages)
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(model, schedule.n_stages),
                             nn.functional.mse_loss)
    if dp is not None:  # over this rank's stages: it needs their parameters
        pipe.grad_sync = GradSync(nn.ModuleList(pipe.stages.values()), dp, bucket_mb=1e-4)
    losses = []
    for x, y in data:
        losses.append(await pipe.step(x if pipe.first else None, y if pipe.last_stage else None))
    await pipe.close()  # its communicator: the pooled world makes many pipelines
    return pipe, losses


def assert_matches(pipe: pipeline.Pipeline, losses: list[float | None], ref: nn.Sequential,
                   ref_losses: list[float]) -> None:
    what = f"rank {pipe.rank} {pipe.schedule.name}"
    if pipe.last_stage:
        assert losses == pytest.approx(ref_losses, rel=1e-10), what
    else:
        assert losses == [None] * len(ref_losses), what
    ref_stages = pipeline.split(ref, pipe.schedule.n_stages)
    for s, module in pipe.stages.items():
        mine, theirs = list(module.named_parameters()), list(ref_stages[s].named_parameters())
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        for (name, p), (_, q) in zip(mine, theirs, strict=True):
            assert p.grad is not None, f"{what} stage {s} {name}: no gradient"
            torch.testing.assert_close(p.grad, q.grad, msg=f"{what} stage {s} {name}")
    stats = pipe.last
    assert stats is not None and stats.wall_s > 0 and 0 <= stats.busy_s <= stats.wall_s
    assert 0.0 <= stats.bubble < 1.0


async def check_schedules(comm: Comm) -> None:
    data = batches(2)
    cases = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"stages_per_rank": 2}),
             ("zbh1", {}), ("zbv", {})]
    for name, kw in cases:
        schedule = pipeline.get(name, comm.size, MICROBATCHES, **kw)
        pipe, losses = await run_pipeline(comm, schedule, data)
        ref, ref_losses = reference(schedule.n_stages, data)
        assert_matches(pipe, losses, ref, ref_losses)
        # evaluation: the forward alone gives the model's output on the last stage's rank
        out = await pipe.forward(data[0][0] if pipe.first else None)
        if pipe.last_stage:
            assert out is not None
            with torch.no_grad():
                torch.testing.assert_close(out, ref(data[0][0]))
        else:
            assert out is None


async def check_bad_arguments(comm: Comm) -> None:
    schedule = pipeline.get("gpipe", comm.size, MICROBATCHES)
    stages = pipeline.split(build(comm.size), comm.size)
    with pytest.raises(ValueError, match="is for 3 ranks"):
        pipeline.Pipeline(comm, pipeline.get("gpipe", 3, 2), stages, nn.functional.mse_loss)
    other = (comm.rank + 1) % comm.size
    with pytest.raises(ValueError, match=rf"stages \[{other}\] given, schedule 'gpipe' puts "
                       rf"stages \[{comm.rank}\] here"):
        pipeline.Pipeline(comm, schedule, {other: stages[other]}, nn.functional.mse_loss)
    broken = pipeline.Schedule("broken", comm.size, comm.size, MICROBATCHES,
                               (schedule.actions[0][1:], *schedule.actions[1:]))
    with pytest.raises(pipeline.ScheduleError, match="rank 0"):
        pipeline.Pipeline(comm, broken, stages, nn.functional.mse_loss)
    pipe = pipeline.Pipeline(comm, schedule, stages, nn.functional.mse_loss)
    if pipe.first:
        with pytest.raises(ValueError, match="inputs are needed"):
            await pipe.step(None, torch.zeros(BATCH, 3))
        with pytest.raises(ValueError, match="equal microbatches"):
            await pipe.step(torch.zeros(BATCH + 1, WIDTH, dtype=torch.float64), None)
    else:
        with pytest.raises(ValueError, match="targets are needed"):
            await pipe.step(None, None)
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        pipeline.split(nn.Linear(2, 2), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sizes"):
        pipeline.split(build(2), 2, sizes=[1, 2])


async def check_local_stages(comm: Comm) -> None:
    """A pipeline of one rank hands tensors over locally (here each rank alone)."""
    alone = [await comm.group([r]) for r in range(comm.size)][comm.rank]
    assert alone is not None
    data = batches(2, seed=comm.rank)
    schedule = pipeline.get("interleaved", 1, MICROBATCHES, stages_per_rank=3)
    pipe, losses = await run_pipeline(alone, schedule, data)
    ref, ref_losses = reference(schedule.n_stages, data)
    assert_matches(pipe, losses, ref, ref_losses)


async def check_with_data_parallel(comm: Comm) -> None:
    """2 stages x 2 replicas: pipelines [0, 1] and [2, 3], data-parallel groups [0, 2], [1, 3].

    The replicas' gradients are averaged by a GradSync the pipeline drives: each
    stage's backward passes run inside ``no_sync()`` but its last (GradSync allows
    one backward per synchronised step), and ``wait()`` ends the step.
    """
    pipes = [await comm.group(ranks) for ranks in ([0, 1], [2, 3])]
    replicas = [await comm.group(ranks) for ranks in ([0, 2], [1, 3])]
    pp = pipes[comm.rank // 2]
    dp = replicas[comm.rank % 2]
    assert pp is not None and dp is not None
    data = batches(4)  # replica r trains on batches r and r + 2
    mine = data[comm.rank // 2::2]
    for name in ("1f1b", "interleaved", "zbh1", "zbv"):
        schedule = pipeline.get(name, 2, MICROBATCHES)
        pipe, losses = await run_pipeline(pp, schedule, mine, dp)
        # one process on the union: each step's batch is both replicas' batches, the
        # loss their mean
        ref = build(schedule.n_stages)
        for step in range(2):
            both = [data[step], data[step + 2]]
            parts = [nn.functional.mse_loss(ref(xm), ym) for x, y in both
                     for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES),
                                       strict=True)]
            torch.stack(parts).mean().backward()
        ref_stages = pipeline.split(ref, schedule.n_stages)
        for s, module in pipe.stages.items():
            for p, q in zip(module.parameters(), ref_stages[s].parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, msg=f"rank {comm.rank} {name} s{s}")
        if pipe.last_stage:
            assert all(loss is not None for loss in losses)


def test_every_schedule_matches_one_process_2_ranks(world2: World) -> None:
    world2.run(check_schedules)
    world2.run(check_bad_arguments)
    world2.run(check_local_stages)


def test_every_schedule_matches_one_process_4_ranks(world4: World) -> None:
    world4.run(check_schedules)


def test_pipeline_times_data_parallel(world4: World) -> None:
    world4.run(check_with_data_parallel)


class Announcing(nn.Module):
    """A stage that tells the loop when its forward has run."""

    def __init__(self, inner: nn.Module, ran: asyncio.Event) -> None:
        super().__init__()
        self.inner, self.ran = inner, ran
        self.loop = asyncio.get_running_loop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.loop.call_soon_threadsafe(self.ran.set)  # compute may run it on a thread
        out: torch.Tensor = self.inner(x)
        return out


async def check_cancel_told(comm: Comm) -> None:
    """A step cancelled on rank 0 mid-way makes rank 1's step raise RemoteError, not wait.

    Rank 0 cancels its step once its first forward has run (rank 1 is then waiting
    for activations or gradients that will not come, its comm's timeout far off).
    """
    schedule = pipeline.get("gpipe", comm.size, MICROBATCHES)
    (x, y), = batches(1)
    stages = pipeline.split(build(2), 2)
    ran = asyncio.Event()
    stages[0] = Announcing(stages[0], ran)
    pipe = pipeline.Pipeline(comm, schedule, stages, nn.functional.mse_loss)
    signals = comm.channel(77)
    if comm.rank == 0:
        step = asyncio.ensure_future(pipe.step(x, None))
        await ran.wait()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        await signals.recv(1)
    else:
        with pytest.raises(RemoteError, match=r"rank 1: pipeline 'gpipe' step 1: rank 0 "
                           r"failed: CancelledError") as caught:
            await pipe.step(None, y)
        assert caught.value.rank == 0
        await signals.send("raised", 0)
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        await pipe.step(x, y)
    await pipe.close()


class _FailsBackward(torch.autograd.Function):
    """Identity forward; its backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward boom")


class FailingBackward(nn.Module):
    """A stage whose backward raises."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _FailsBackward.apply(self.inner(x))  # type: ignore[no-untyped-call]
        return out


async def check_groups_agree_after_a_failed_first_step(comm: Comm, times: int) -> None:
    """Rank 0's first step fails in its backwards, after rank 1 has all it needs: rank 1
    ends its own step while rank 0's notice comes. Its next step hears of rank 0, and the
    ranks still agree on the groups they make later (the pipeline's own group was made at
    the end of the first step, where the notice could stop it on rank 1 alone: then the
    next group hung). Repeated: a notice taken just as rank 1's step ended was lost (its
    next step waited for rank 0 for good), about once in ten."""
    schedule = pipeline.get("gpipe", comm.size, MICROBATCHES)
    (x, y), = batches(1)
    for _ in range(times):
        stages = pipeline.split(build(2), 2)
        stages[0] = FailingBackward(stages[0])
        pipe = pipeline.Pipeline(comm, schedule, stages, nn.functional.mse_loss)
        try:
            await pipe.step(x if pipe.first else None, y if pipe.last_stage else None)
        except (RuntimeError, RemoteError):
            pass
        if comm.rank == 1:  # rank 1 may have finished its step: its next one hears of rank 0
            with pytest.raises((RemoteError, RuntimeError)):
                await asyncio.wait_for(pipe.step(None, y), 10)
        await pipe.close()
        group = await asyncio.wait_for(comm.group(range(comm.size)), 30)
        assert group is not None
        await group.close()


def test_cancel_told(world2: World) -> None:
    world2.run(check_cancel_told)


def test_groups_agree_after_a_failed_first_step(world2: World) -> None:
    world2.run(check_groups_agree_after_a_failed_first_step, 12)


class Where(nn.Module):
    """An identity stage that notes the thread each forward and backward runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.threads: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return x * self.scale


async def check_where_passes_run(comm: Comm, width: int) -> list[list[str]]:
    schedule = pipeline.get("1f1b", comm.size, 2)
    stages = [Where() for _ in range(comm.size)]
    pipe = pipeline.Pipeline(comm, schedule, stages, lambda out, _: out.sum())
    x = torch.ones(2, width)
    seen = []
    for _ in range(3):
        await pipe.step(x if pipe.first else None, x if pipe.last_stage else None)
        mine = stages[comm.rank]
        seen.append(sorted(set(mine.threads)))
        mine.threads.clear()
    await pipe.close()
    return seen


def test_passes_leave_the_loop_only_where_messages_need_it(world2: World) -> None:
    # The first step's messages are channel frames (the loop moves them); from the second,
    # gloo's point-to-point operations progress on gloo's threads; MPI's only when polled,
    # unless they went eagerly (these are small), which the second step finds out.
    loop, thread = ["MainThread"], ["asyncomm-compute_0"]
    for steps in world2.run(check_where_passes_run, 3):
        assert steps == ([thread, loop, loop] if world2.backend == "gloo"
                         else [thread, thread, loop]), steps
    # 1 MiB messages: no MPI sends them eagerly, so there the loop stays free
    for steps in world2.run(check_where_passes_run, 1 << 18):
        assert steps == ([thread, loop, loop] if world2.backend == "gloo"
                         else [thread, thread, thread]), steps
