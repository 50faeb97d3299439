"""``GradSync``: gradients averaged in backward equal DDP's (gloo) or the local average (MPI).

Internals on purpose: the checks read its buckets, to see each bucket's all-reduce issued
during backward in bucket order, reduced in place, or summed through shared memory; and they
take shared memory away to see it fall back. The bench's ``gradsync`` section runs here
too, on a pooled world."""

from __future__ import annotations

import asyncio
import copy
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

import asyncomm
from asyncomm import Comm, GradSync
from asyncomm._overlap import shared_sum as _shared_sum
from asyncomm._tools import bench
from asyncomm._tools.bench import gradsync as _bench_gradsync
from asyncomm.testing import World, run_script

# (bucket_mb, backward on the loop thread or through asyncomm.compute): one bucket per
# parameter, a few parameters per bucket, everything in one bucket.
CONFIGS = [(1e-9, "loop"), (1e-9, "compute"), (0.0004, "compute"), (0.0004, "loop"),
           (25.0, "loop"), (25.0, "compute")]
# Per step, which ranks run the ``extra`` branch: (inside no_sync, in the synchronised step).
# Step 1: used by rank 0 only; step 2: only by rank 1, and only while accumulating; step 3:
# by no rank (its .grad stays None, as with DDP).
EXTRA = [((), (0,)), ((1,), ()), ((), ())]


class Net(nn.Module):
    def __init__(self, branches: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)
        self.extra = nn.Linear(8, 3) if branches else None
        self.dead = nn.Linear(8, 3) if branches else None  # in no step on any rank

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        y = self.frozen(self.head(h))
        if extra:
            assert self.extra is not None
            y = y + self.extra(h)
        return y


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def loss_of(model: nn.Module, rank: int, step: int, micro: int, extra: bool) -> torch.Tensor:
    x, y = batch(rank, step, micro)
    return nn.functional.mse_loss(model(x, extra=extra), y)


def local_average(model: nn.Module, size: int, step: int, unused: bool, accumulate: bool
                  ) -> dict[str, torch.Tensor | None]:
    """DDP's result computed alone: every rank's accumulated gradients, averaged.

    A parameter no rank used keeps no gradient; one that some rank used counts as zeros on
    the ranks that did not.
    """
    per_rank = []
    for rank in range(size):
        mine = copy.deepcopy(model)
        for micro in range(2 if accumulate else 1):
            uses = EXTRA[step][micro] if unused else ()
            loss_of(mine, rank, step, micro, rank in uses).backward()
        per_rank.append(dict(mine.named_parameters()))
    average: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        grads = [params[name].grad for params in per_rank]
        if all(g is None for g in grads):
            average[name] = None
        else:
            total = sum(torch.zeros_like(p) if g is None else g / size for g in grads)
            assert isinstance(total, torch.Tensor)
            average[name] = total
    return average


def assert_same_grads(ours: nn.Module, expected: dict[str, torch.Tensor | None],
                      what: str) -> None:
    for name, p in ours.named_parameters():
        want = expected[name]
        if want is None or p.grad is None:
            assert p.grad is None and want is None, f"{what}: {name}: {p.grad} vs {want}"
        else:
            assert torch.allclose(p.grad, want, rtol=1e-5, atol=1e-7), (
                f"{what}: {name}: max diff {(p.grad - want).abs().max().item()}")


def sgd(model: nn.Module) -> None:
    """One plain SGD step, then forget the gradients (torch.optim's first step costs seconds)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.5 * p.grad)
    model.zero_grad(set_to_none=True)


async def backward(loss: torch.Tensor, where: str) -> None:
    if where == "loop":
        loss.backward()
    else:
        await asyncomm.compute(loss.backward)


async def check_gradients_match(comm: Comm, unused: bool, shared: bool) -> None:
    for bucket_mb, where in CONFIGS:
        torch.manual_seed(0)  # the same starting parameters on every rank
        model = Net(branches=unused)
        reference = copy.deepcopy(model)
        sync = GradSync(model, comm, bucket_mb, find_unused_parameters=unused,
                        shared_memory=shared)
        if bucket_mb < 1e-6:
            assert len(sync.buckets) == len(list(model.parameters())) - 2  # frozen: none
        ddp = None
        if comm.backend == "gloo":
            ddp = nn.parallel.DistributedDataParallel(reference, find_unused_parameters=unused)
        for step in range(3):
            what = f"rank {comm.rank}, bucket_mb={bucket_mb}, backward on {where}, step {step}"
            uses = EXTRA[step] if unused else ((), ())
            accumulate = unused or step == 1
            if accumulate:  # a micro-batch first, without communication
                with sync.no_sync():
                    await backward(loss_of(model, comm.rank, step, 0, comm.rank in uses[0]),
                                   where)
                    await sync.wait()  # nothing to do inside no_sync
                if ddp is not None:
                    with ddp.no_sync():
                        loss_of(ddp, comm.rank, step, 0, comm.rank in uses[0]).backward()
            micro = 1 if accumulate else 0
            await backward(loss_of(model, comm.rank, step, micro, comm.rank in uses[1]), where)
            # Every bucket went during backward, in bucket order (unused parameters too: the
            # forward hook found them); from the second step on, the ranks of this one host
            # sum every gradient through shared memory in wait() instead.
            if shared and step > 0:
                assert [b.shared is not None for b in sync._buckets] == [True], what
            else:
                seqs = [b.handle.seq for b in sync._buckets if b.handle is not None]
                assert len(seqs) == len(sync.buckets) and seqs == sorted(seqs), what
            await sync.wait()
            if ddp is not None:
                loss_of(ddp, comm.rank, step, micro, comm.rank in uses[1]).backward()
                expected = {n: p.grad for n, p in reference.named_parameters()}
            else:
                expected = local_average(reference, comm.size, step, unused, accumulate)
                for name, p in reference.named_parameters():
                    p.grad = expected[name]
            assert_same_grads(model, expected, what)
            if unused:
                assert model.dead is not None and model.dead.weight.grad is None, what
            for m in (model, reference):
                sgd(m)
        sync.close()


@pytest.mark.parametrize("shared", [True, False], ids=["one-host", "all-reduce"])
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "unused-and-no_sync"])
def test_gradients_equal_ddp(world: World, unused: bool, shared: bool) -> None:
    world.run(check_gradients_match, unused, shared)


async def check_unused_parameter_is_named(comm: Comm) -> None:
    model = Net(branches=True)
    with pytest.raises(TypeError, match="Comm"):
        GradSync(model, "comm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GradSync(object(), comm)  # type: ignore[arg-type]
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="bucket_mb"):
            GradSync(model, comm, bad)
    with pytest.raises(TypeError, match="bucket_mb"):
        GradSync(model, comm, "25")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="find_unused_parameters"):
        GradSync(model, comm, find_unused_parameters=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shared_memory"):
        GradSync(model, comm, shared_memory=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no parameter"):
        GradSync(nn.Linear(2, 2).requires_grad_(False), comm)

    # Buckets: last parameters first; the first closes at 1 MiB, the others at bucket_mb;
    # a gradient of 1 MiB or more goes alone.
    small, big = (nn.Linear(256, 256) for _ in range(10)), nn.Linear(512, 512)  # 1 MiB weight
    layers = nn.Sequential(*itertools.islice(small, 6), big, *small)
    sync = GradSync(layers, comm, bucket_mb=1.5)
    assert sync.buckets == [[f"{i}.{w}" for i in (10, 9, 8, 7) for w in ("bias", "weight")],
                            ["6.weight"],
                            ["6.bias"] + [f"{i}.{w}" for i in range(5, -1, -1)
                                          for w in ("bias", "weight")]]
    sync.close()
    # A bucket of one parameter is averaged in place, in its .grad: no copy.
    torch.manual_seed(0)
    lone, twin = nn.Linear(512, 512), nn.Linear(512, 512)
    twin.load_state_dict(lone.state_dict())
    sync = GradSync(lone, comm, shared_memory=False)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(comm.rank))
    lone(x).mean().backward()
    assert sync.buckets == [["bias"], ["weight"]]
    weight = sync._buckets[1]
    assert weight.handle is not None and weight.reduced is lone.weight.grad
    await sync.wait()
    xs = [torch.randn(4, 512, generator=torch.Generator().manual_seed(r))
          for r in range(comm.size)]
    twin(torch.cat(xs)).mean().backward()
    assert_same_grads(lone, {n: p.grad for n, p in twin.named_parameters()}, "in place")
    # A wait given up while that all-reduce is in flight: .grad becomes a copy (the
    # handle keeps the buffer it reduces into), and the next step is whole again.
    lone.zero_grad()
    go = comm.channel(91)
    if comm.rank == 0:
        lone(x).mean().backward()
        inflight, handle = lone.weight.grad, sync._buckets[1].handle
        assert handle is not None
        with pytest.raises(asyncio.TimeoutError):  # the others have not run their backward
            await asyncio.wait_for(sync.wait(), 0.2)
        assert not handle.done() and lone.weight.grad is not None
        assert lone.weight.grad.data_ptr() != inflight.data_ptr()
        torch.testing.assert_close(lone.weight.grad, inflight)  # a copy, not yet averaged
        for peer in range(1, comm.size):
            await go.send("go", peer)
        await handle
    else:
        await go.recv(0)
        lone(x).mean().backward()
        await sync.wait()  # the all-reduces rank 0 gave up waiting for
    lone.zero_grad()
    twin.zero_grad()
    lone(x).mean().backward()
    await sync.wait()
    twin(torch.cat(xs)).mean().backward()
    assert_same_grads(lone, {n: p.grad for n, p in twin.named_parameters()}, "after giving up")
    sync.close()

    torch.manual_seed(0)
    sync = GradSync(model, comm, bucket_mb=1e-9)  # extra and dead are unused
    loss_of(model, comm.rank, 0, 0, extra=False).backward()
    with pytest.raises(RuntimeError, match=r"rank \d: GradSync.*4 parameter\(s\).*extra\.weight"
                       r".*dead\.bias.*find_unused_parameters=True"):
        await sync.wait()
    # The step is over: the next one, with every parameter used, works.
    model.zero_grad(set_to_none=True)
    sync.close()
    # find_unused_parameters without the forward hook (forward called directly): wait()
    # puts the unused parameters in. The same data on every rank: the average is local.
    torch.manual_seed(0)
    model = Net(branches=True)
    alone = copy.deepcopy(model)
    sync = GradSync(model, comm, bucket_mb=1e-9, find_unused_parameters=True)
    x, y = batch(0, 0, 0)
    nn.functional.mse_loss(model.forward(x), y).backward()
    assert not all(b.handle is not None for b in sync._buckets)  # some wait for wait()
    await sync.wait()
    nn.functional.mse_loss(alone(x), y).backward()
    assert_same_grads(model, {n: p.grad for n, p in alone.named_parameters()}, "direct")
    assert model.extra is not None and model.extra.weight.grad is None
    sync.close()

    plain = Net(branches=False)
    sync = GradSync(plain, comm)
    loss = loss_of(plain, comm.rank, 0, 0, extra=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient"):
        loss.backward()
    await sync.wait()  # the first backward's buckets, issued on every rank
    sync.close()


def test_bad_arguments_and_unused_parameters_raise(world: World) -> None:
    world.run(check_unused_parameter_is_named)


async def check_without_shared_memory(comm: Comm) -> list[bool]:
    # Where the ranks cannot share memory (rank 0 cannot make the file; or one rank cannot
    # map it), every rank goes on all-reducing buckets, with the same result.
    made = []
    for case in ("no file", "rank 1 cannot map"):
        saved = _shared_sum._FOLDER, _shared_sum._map
        if case == "no file" and comm.rank == 0:
            _shared_sum._FOLDER = "/nonexistent-asyncomm-test"
        if case == "rank 1 cannot map" and comm.rank == 1:
            _shared_sum._map = lambda *args: None
        try:
            torch.manual_seed(0)
            model = Net(branches=False)
            reference = copy.deepcopy(model)
            sync = GradSync(model, comm, 1e-9)
            for step in range(2):
                loss_of(model, comm.rank, step, 0, False).backward()
                await sync.wait()
                expected = local_average(reference, comm.size, step, False, False)
                assert_same_grads(model, expected, f"{case}, step {step}")
                for name, p in reference.named_parameters():
                    p.grad = expected[name]
                for m in (model, reference):
                    sgd(m)
            made.append(any(b.shared is not None for b in sync._buckets))
            sync.close()
        finally:
            _shared_sum._FOLDER, _shared_sum._map = saved
    return made


def test_ranks_that_cannot_share_memory_all_reduce(world: World) -> None:
    assert world.run(check_without_shared_memory) == [[False, False]] * world.size


async def check_bench_runs(comm: Comm) -> list[dict[str, object]]:
    threads = torch.get_num_threads()
    try:  # a tiny model and all-reduce, one round: the code runs, the records are whole
        return await _bench_gradsync.measure(comm, 1, True, widths=(16,) * 4, nbytes=4096)
    finally:  # the bench sets it for its ranks; this world serves other tests
        torch.set_num_threads(threads)


def test_bench_records_and_table(world: World) -> None:
    records = world.run(check_bench_runs)[0]
    steps = {r["variant"]: r for r in records if r["op"] == "step"}
    expected = ["local", "gradsync", "gradsync+compute", "gradsync buckets"]
    if world.backend == "gloo":
        expected.insert(1, "ddp")
    assert list(steps) == expected
    assert [r["variant"] for r in records if r["op"] == "compute"] == [
        "allreduce alone", "forward alone", "loop", "compute"]
    for r in records:
        assert r["ms"] > 0 and len(r["samples_ms"]) == r["steps"] == 2, r
    meta = {"backend": world.backend, "ranks": 3, "loop": "asyncio", "torch": "2",
            "mpi4py": None, "python": "3", "mpi_library": None, "rounds": 1}
    lines = bench.table([{**meta, **r} for r in records]).splitlines()
    gradsync = next(line for line in lines if line.startswith("gradsync "))
    if world.backend == "gloo":
        assert steps["gradsync"]["ratio_ddp"] == pytest.approx(
            steps["gradsync"]["ms"] / steps["ddp"]["ms"])
        assert gradsync.endswith(("<= 0.95: met", "<= 0.95: MISSED")), gradsync
    else:
        assert steps["gradsync"]["ratio_ddp"] is None and "<=" not in gradsync
    assert lines[-1].startswith("compute ")


NCCL_SCRIPT = """
import copy, torch, asyncomm
from torch import nn

async def main(comm):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(device)
    plain = copy.deepcopy(model)
    sync = asyncomm.GradSync(model, comm, bucket_mb=0.005)
    for step, where in enumerate(("loop", "compute")):
        # Each rank its own batch: the averaged gradient is the mean of every rank's.
        batches = [torch.randn(8, 32, device=device,
                               generator=torch.Generator(device).manual_seed(10 * step + r))
                   for r in range(comm.size)]
        loss = model(batches[comm.rank]).square().mean()
        if where == "loop":
            loss.backward()
        else:
            await asyncomm.compute(loss.backward)
        await sync.wait()
        for x in batches:  # the reference: every rank's gradient, summed, then averaged
            plain(x).square().mean().backward()
        torch.cuda.synchronize()
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.allclose(a.grad, b.grad / comm.size, rtol=1e-5, atol=1e-7), where
            a.grad = b.grad = None
    print("gradsync nccl ok", comm.rank, flush=True)

asyncomm.run(main, backend="nccl")
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_nccl_gradients(tmp_path: Path) -> None:
    ranks = min(torch.cuda.device_count(), 2)  # nccl: one rank per GPU (one: still every path)
    done = run_script(NCCL_SCRIPT, tmp_path, ranks, "nccl", timeout=240)  # below pytest's own
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("gradsync nccl ok") == ranks
