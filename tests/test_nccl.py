"""The nccl backend on CUDA tensors; skipped on machines without a GPU."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from asyncomm.testing import run_script

# nccl takes one rank per GPU: two ranks with different data where there are two GPUs,
# else one (every collective is then the identity, but every path still runs).
GPUS = torch.cuda.device_count()
RANKS = min(GPUS, 2)
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")

SCRIPT = """
import asyncio, torch, asyncomm

async def main(comm):
    assert comm.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.full((1 << 20,), float(comm.rank + 1), device=device)
    await comm.all_reduce(t)
    torch.cuda.current_stream().synchronize()
    assert t[0].item() == sum(range(1, comm.size + 1)), t[0].item()
    handles = [comm.all_reduce(torch.ones(10, device=device), "avg") for _ in range(8)]
    for result in await asyncio.gather(*handles):
        assert result.sum().item() == 10.0
    gathered = await comm.all_gather(torch.tensor([comm.rank], device=device))
    assert [g.item() for g in gathered] == list(range(comm.size))
    b = torch.arange(4.0, device=device) if comm.rank == 0 else torch.zeros(4, device=device)
    await comm.broadcast(b, 0)
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    if comm.size > 1:
        got = torch.zeros(3, device=device)
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        await asyncio.gather(comm.send(torch.full((3,), float(comm.rank), device=device), right),
                             comm.recv(got, left))
        assert got.tolist() == [float(left)] * 3
    ch = comm.channel(3)  # channels move CUDA tensors through the host
    # A message sent just before a barrier leaves before the barrier blocks anything.
    if comm.rank == 0:
        await ch.send("before the barrier", 1 % comm.size)
    if comm.rank == 1 % comm.size:
        assert (await ch.recv(0)).data == "before the barrier"
    await comm.barrier()
    await ch.send(torch.full((2,), 7.0, device=device), (comm.rank + 1) % comm.size)
    got = (await ch.recv((comm.rank - 1) % comm.size)).data
    assert got.device.type == "cpu" and got.tolist() == [7.0, 7.0], got
    try:
        comm.all_reduce(torch.ones(1))
    except TypeError:
        pass
    else:
        raise AssertionError("a CPU tensor on nccl must raise TypeError")
    assert await comm.all_gather_object(comm.rank) == list(range(comm.size))
    print("nccl ok", comm.rank, flush=True)

asyncomm.run(main, backend="nccl")
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocking", ["0", "1"])  # 1: every nccl wait() blocks the host
def test_nccl_world(tmp_path: Path, blocking: str) -> None:
    proc = run_script(SCRIPT, tmp_path, RANKS, "nccl", timeout=240,  # below pytest's own
                      env={"TORCH_NCCL_BLOCKING_WAIT": blocking})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("nccl ok") == RANKS


@pytest.mark.timeout(300)
def test_more_ranks_than_gpus_is_a_clear_error(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_script(SCRIPT, tmp_path, GPUS + 1, "nccl", timeout=240)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"local rank {GPUS}, and {GPUS} GPU(s) are visible" in out, out
    assert time.monotonic() - started < 120, "the other ranks were not stopped at once"


GLOO_CUDA = """
import asyncio, torch, asyncomm

class Summer(asyncomm.Actor):
    @asyncomm.endpoint
    async def total(self, t):
        return t.sum()

async def main(comm):
    assert comm.backend == "gloo"
    peer = 1 - comm.rank
    ch = comm.channel(5)
    # Tensors of every path: inline (small), out of band (large: the data lane on gloo),
    # not contiguous, bf16, and inside a structure; each sent from CUDA memory.
    sent = [torch.arange(8.0, device="cuda") + comm.rank,
            torch.full((1 << 20,), float(comm.rank + 3), device="cuda"),
            torch.arange(64.0, device="cuda").reshape(8, 8).t(),
            torch.ones(3, dtype=torch.bfloat16, device="cuda"),
            {"w": torch.full((3 << 18,), 2.0, device="cuda"), "n": comm.rank}]
    for _ in range(3):
        for obj in sent:
            await ch.send(obj, peer)
        for obj in sent:
            got = (await ch.recv(peer)).data
            if isinstance(obj, dict):
                assert got["n"] == peer and got["w"].device.type == "cpu"
                assert torch.equal(got["w"], obj["w"].cpu())
                continue
            want = obj.cpu()
            if obj.numel() == 1 << 20:
                want = torch.full_like(want, float(peer + 3))
            elif obj.numel() == 8:
                want = torch.arange(8.0) + peer
            assert got.device.type == "cpu" and got.dtype == obj.dtype, got
            assert torch.equal(got, want), (got, want)
    # An actor's call carries CUDA tensors too (its answer a CPU tensor).
    comm.serve(Summer(), name="summer")
    await comm.barrier()  # served on both ranks before either calls
    answer = await comm.actor(peer, "summer").total(torch.ones(1 << 18, device="cuda"))
    assert answer.item() == float(1 << 18), answer
    await comm.barrier()
    for call in (lambda: comm.all_reduce(torch.ones(1, device="cuda")),
                 lambda: comm.send(torch.ones(1, device="cuda"), peer)):
        try:
            call()
        except TypeError:
            continue
        raise AssertionError("gloo must refuse a CUDA tensor with a TypeError")
    print("gloo cuda ok", comm.rank, flush=True)

asyncomm.run(main)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lane", [{}, {"ASYNCOMM_LANE_DIRECT": "0"}, {"ASYNCOMM_LANE_SHM": "0"}],
                         ids=["direct", "ring", "socket"])  # how the data lane moves bytes
def test_gloo_channels_carry_cuda_tensors_through_the_host(tmp_path: Path,
                                                         lane: dict[str, str]) -> None:
    proc = run_script(GLOO_CUDA, tmp_path, 2, "gloo", timeout=240, env=lane)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("gloo cuda ok") == 2
