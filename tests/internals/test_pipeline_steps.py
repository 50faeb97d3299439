"""Pipeline steps that fail or change shape, and a pipeline closed with its communicator.

Internals on purpose: the pipeline's point-to-point communicator (to send what a failed
step's posted receives wait for, which gloo cannot cancel, and to see it closed with the
communicator the pipeline was made on), its tags, and its failure notices (to send a stale
one)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_exec import BATCH, MICROBATCHES, WIDTH, batches, build, reference
from torch import nn

from asyncomm import Comm, CommClosedError, RemoteError, pipeline
from asyncomm.testing import World


async def check_fixed_shapes(comm: Comm) -> None:
    """Messages keep their first step's shapes, or the sender raises; or any shape, on channels."""
    schedule = pipeline.get("gpipe", comm.size, 2)
    width, gen = WIDTH, torch.Generator().manual_seed(5)  # the same data on every rank
    x = [torch.randn(rows, width, generator=gen, dtype=torch.float64) for rows in (4, 6)]
    y = [torch.randn(rows, 3, generator=gen, dtype=torch.float64) for rows in (4, 6)]
    # fixed_shapes=False: a second step of another batch size works, equal to one process
    model = build(2)
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(model, 2), nn.functional.mse_loss,
                             fixed_shapes=False)
    for step in range(2):
        loss = await pipe.step(x[step], y[step])
        ref = build(2)
        want = torch.stack([nn.functional.mse_loss(ref(xm), ym)
                            for xm, ym in zip(x[step].chunk(2), y[step].chunk(2), strict=True)])
        if pipe.last_stage:
            assert loss == pytest.approx(want.mean().item())
    await pipe.close()
    with pytest.raises(RuntimeError, match="is closed"):
        await pipe.step(x[0], y[0])
    # fixed_shapes (the default): step 2's first send raises on rank 0, before sending
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(build(2), 2), nn.functional.mse_loss)
    await pipe.step(x[0], y[0])
    assert pipe._p2p is not None  # from step 2 on, point-to-point operations
    if comm.rank == 0:
        with pytest.raises(ValueError, match=r"rank 0: pipeline 'gpipe' action #\d+ "
                           r"\(SEND_F0@s0\): the output of stage 0 for microbatch 0 is \(3, 6\) "
                           r"torch.float64, in the first step it was \(2, 6\).*fixed_shapes"):
            await pipe.step(x[1], y[1])
        with pytest.raises(RuntimeError, match="an earlier step failed"):
            await pipe.step(x[0], y[0])
    else:  # rank 1 never joins step 2: free rank 0's receives posted for it
        for mb in range(2):
            await pipe._p2p.send(torch.zeros(2, width, dtype=torch.float64), 0,
                                 pipe._offset(1, 1, mb))
    await pipe.close()


def test_fixed_shapes(world2: World) -> None:
    world2.run(check_fixed_shapes)


class Faulty(nn.Module):
    """A stage that raises in its forward when told to."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom")
        out: torch.Tensor = self.inner(x)
        return out


async def _free(comm: Comm, pipe: pipeline.Pipeline, direction: int) -> None:
    """Send what a failed step's posted receives on the peer wait for (gloo cannot cancel them)."""
    assert pipe._p2p is not None
    rows = BATCH // MICROBATCHES
    for mb in range(MICROBATCHES):
        await pipe._p2p.send(torch.zeros(rows, WIDTH, dtype=torch.float64), 1 - comm.rank,
                             pipe._offset(direction, direction, mb))


async def check_failure_told(comm: Comm) -> None:
    """A step that raises on rank 0 makes rank 1's step raise RemoteError, not wait.

    The comm's timeout is far off: without the notice, rank 1 would wait for it.
    Rank 1 is in its step when the notice comes, or starts it after. The second
    pipeline on the same tags gets a notice of the first before its steps: it is
    not stopped by it.
    """
    schedule = pipeline.get("gpipe", comm.size, MICROBATCHES)
    data = batches(2)
    _, want = reference(2, data)
    signals = comm.channel(77)
    for in_step in (True, False):
        stages = pipeline.split(build(2), 2)
        faulty = Faulty(stages[0])
        pipe = pipeline.Pipeline(comm, schedule, [faulty, stages[1]], nn.functional.mse_loss)
        if comm.rank == 0 and not in_step:  # a notice of the pipeline given up just before
            stale = {"generation": pipe._generation - 1, "error": "stale", "traceback": ""}
            assert pipe._notices is not None
            await pipe._notices.send(stale, 1)
        for (x, y), loss in zip(data, want, strict=True):  # step 1 channels, step 2 p2p
            got = await pipe.step(x, y)
            if pipe.last_stage:
                assert got == pytest.approx(loss)
        if comm.rank == 0:  # fails before sending anything
            faulty.fail = True
            with pytest.raises(RuntimeError, match="boom"):
                await pipe.step(*data[0])
            if not in_step:  # sent after the notice, on the same link: it comes after it
                await signals.send("told", 1)
            await signals.recv(1)  # rank 1 gave up: now free the receives it posted
            await _free(comm, pipe, 0)
        else:
            if not in_step:
                await signals.recv(0)
            with pytest.raises(RemoteError, match=r"rank 1: pipeline 'gpipe' step 3: rank 0 "
                               r"failed: RuntimeError: boom") as caught:
                await pipe.step(*data[0])
            assert caught.value.rank == 0 and "boom" in caught.value.remote_traceback
            await signals.send("raised", 0)
            await _free(comm, pipe, 1)  # the gradients rank 0 posted receives for
        with pytest.raises(RuntimeError, match="an earlier step failed"):
            await pipe.step(*data[0])
        await pipe.close()


def test_failure_told(world2: World) -> None:
    world2.run(check_failure_told)


async def check_comm_close_closes_pipeline(comm: Comm) -> None:
    """``comm.close()`` closes a pipeline made on it (its own communicator too)."""
    schedule = pipeline.get("1f1b", comm.size, MICROBATCHES)
    data = batches(2)
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(build(2), 2),
                             nn.functional.mse_loss)
    for x, y in data:  # step 2 runs on the pipeline's own communicator
        await pipe.step(x if pipe.first else None, y if pipe.last_stage else None)
    await comm.close()
    assert pipe._p2p is not None and pipe._p2p.closed  # its own communicator too
    with pytest.raises(CommClosedError):
        await pipe.step(*data[0])


def test_comm_close_closes_the_pipeline(world2: World) -> None:
    world2.run(check_comm_close_closes_pipeline)
