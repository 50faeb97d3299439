"""``asyncomm bench gradsync``: GradSync beside DDP, and when ``asyncomm.compute`` helps.

Two sections, each alternating its variants step by step (``harness.alternate`` with one
timed call per round) on the same ranks, model (``WIDTHS``) and data: ``step``, a
data-parallel training step under ``local`` (no communication: the floor), ``ddp`` (gloo
only), ``gradsync``, ``gradsync+compute`` (backward through ``asyncomm.compute``) and
``gradsync buckets`` (``shared_memory=False``: buckets all-reduced under backward where the
ranks share a host too), with the exposed communication (step minus the local step; for
GradSync also the end of backward to the averaged gradients); and ``compute``, an
all-reduce issued before a forward run on the loop or through ``compute``, beside each
alone. docs/benchmarks.md ("GradSync and compute") has the rest.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import asyncomm
from asyncomm._comm import Comm
from asyncomm._tools.bench.harness import MIB, Record, Timed, alternate, size_text

WIDTHS = (1024,) * 9  # eight 1024x1024 Linear layers: 32 MiB of float32
QUICK_WIDTHS = (512,) * 9  # 8 MiB
BATCH = 64
ALLREDUCE_BYTES = 16 * MIB
STEP_TARGET = 0.95  # GradSync step time / DDP's: at least 5% shorter


class MLP(nn.Module):
    """Linear layers with ReLU between them: ``widths[0]`` in, ``widths[-1]`` out."""

    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(widths)):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(a, b))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


async def _steps(comm: Comm, widths: Sequence[int], steps: int, prime: int) -> list[Record]:
    """Time one training step of each variant; return rank 0's records (``[]`` elsewhere)."""
    torch.manual_seed(0)
    base = MLP(widths)
    x = torch.randn(BATCH, widths[0], generator=torch.Generator().manual_seed(comm.rank))
    y = torch.randn(BATCH, widths[-1], generator=torch.Generator().manual_seed(100 + comm.rank))
    params = sum(p.numel() * p.element_size() for p in base.parameters())

    def loss_of(model: nn.Module) -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    local = base
    # Each GradSync variant trains a model of its own: one whose gradients were made on the
    # compute thread would have them freed and made again on the loop thread every other
    # step (each thread allocates from its own malloc arena, so those are fresh pages).
    models, syncs = {}, {}
    # "buckets": all-reduced under backward even where every rank is on one host (the
    # others sum through shared memory there)
    shared = {"gradsync": True, "gradsync+compute": True, "gradsync buckets": False}
    for name, shared_memory in shared.items():
        models[name] = MLP(widths)
        models[name].load_state_dict(base.state_dict())
        syncs[name] = asyncomm.GradSync(models[name], comm, shared_memory=shared_memory)
    waits: dict[str, list[float]] = {name: [] for name in models}

    async def local_step() -> None:
        local.zero_grad(set_to_none=True)
        loss_of(local).backward()  # type: ignore[no-untyped-call]

    def gradsync_step(name: str, offload: bool) -> Callable[[], Any]:
        model, sync = models[name], syncs[name]

        async def step() -> None:
            model.zero_grad(set_to_none=True)
            loss = loss_of(model)
            if offload:
                await asyncomm.compute(loss.backward)
            else:
                loss.backward()  # type: ignore[no-untyped-call]
            start = time.perf_counter()
            await sync.wait()
            waits[name].append(time.perf_counter() - start)

        return step

    variants = {"local": Timed(local_step, False)}
    if comm.backend == "gloo":  # DDP runs on torch's process groups only
        twin = MLP(widths)
        twin.load_state_dict(base.state_dict())
        ddp = nn.parallel.DistributedDataParallel(twin)

        async def ddp_step() -> None:
            ddp.zero_grad(set_to_none=True)
            # DDP waits for its last all-reduce inside backward
            loss_of(ddp).backward()  # type: ignore[no-untyped-call]

        variants["ddp"] = Timed(ddp_step, False)
    for name in shared:  # only "gradsync+compute" runs its backward through compute
        variants[name] = Timed(gradsync_step(name, name == "gradsync+compute"), False)
    samples = await alternate(comm, variants, steps, 0, 1, prime)
    for sync in syncs.values():
        sync.close()
    if comm.rank != 0:
        return []
    ms = {name: _median_ms(s) for name, s in samples.items()}
    records = []
    for name in variants:
        records.append({
            "bench": "gradsync", "op": "step", "variant": name, "size": params,
            "ms": ms[name], "exposed_ms": ms[name] - ms["local"],
            "wait_ms": _median_ms(waits[name]) if name in waits else None,
            "ratio_ddp": ms[name] / ms["ddp"] if "ddp" in ms else None,
            "target": f"<= {STEP_TARGET:g}" if name == "gradsync" and "ddp" in ms else None,
            "steps": steps, "samples_ms": [s * 1e3 for s in samples[name]],
        })
    return records


async def _compute(comm: Comm, widths: Sequence[int], nbytes: int, steps: int,
                   prime: int) -> list[Record]:
    """Time an all-reduce issued before a forward pass on the loop or through compute."""
    torch.manual_seed(0)
    model = MLP(widths).requires_grad_(False)
    x = torch.randn(BATCH, widths[0])
    t = torch.zeros(nbytes // 4)

    async def allreduce() -> None:
        await comm.all_reduce(t)

    async def forward() -> None:
        model(x)

    async def on_loop() -> None:
        handle = comm.all_reduce(t)
        model(x)  # holds the loop: completions wait until the forward is done
        await handle

    async def offloaded() -> None:
        handle = comm.all_reduce(t)
        await asyncomm.compute(model, x)
        await handle

    variants = {name: Timed(fn, False) for name, fn in (
        ("allreduce alone", allreduce), ("forward alone", forward),
        ("loop", on_loop), ("compute", offloaded))}
    samples = await alternate(comm, variants, steps, 0, 1, prime)
    if comm.rank != 0:
        return []
    ms = {name: _median_ms(s) for name, s in samples.items()}
    apart = ms["allreduce alone"] + ms["forward alone"]
    return [{"bench": "gradsync", "op": "compute", "variant": name, "size": nbytes,
             "ms": ms[name], "ratio_apart": ms[name] / apart, "steps": steps,
             "samples_ms": [s * 1e3 for s in samples[name]]} for name in variants]


async def measure(comm: Comm, rounds: int, quick: bool, widths: Sequence[int] | None = None,
                  nbytes: int = ALLREDUCE_BYTES) -> list[Record]:
    """Run both sections; return rank 0's records (``[]`` elsewhere).

    ``widths`` and ``nbytes`` (the all-reduce of the compute section) shrink it for tests.
    """
    widths = widths or (QUICK_WIDTHS if quick else WIDTHS)
    steps, prime = rounds * (2 if quick else 8), 1 if quick else 3
    torch.set_num_threads(1)  # two ranks share the cores: one intra-op thread each
    records = await _steps(comm, widths, steps, prime)
    return records + await _compute(comm, widths, nbytes, steps, prime)


def table(records: Sequence[Record]) -> list[str]:
    """The lines of both sections (after the header line)."""
    m = records[0]
    steps = [r for r in records if r["op"] == "step"]
    lines = [f"gradsync: median of {m['steps']} steps, alternated step by step; MLP of "
             f"{m['size'] / MIB:.0f} MiB, batch {BATCH}; exposed = step - local step; "
             "wait = end of backward to grads averaged",
             f"{'variant':<18}{'step ms':>9}{'exposed ms':>12}{'wait ms':>9}{'vs ddp':>8}"
             "  target"]
    for r in steps:
        target = "" if r["target"] is None else (
            f"{r['target']}: {'met' if r['ratio_ddp'] <= STEP_TARGET else 'MISSED'}")
        wait = "" if r["wait_ms"] is None else f"{r['wait_ms']:.1f}"
        ratio = "" if r["ratio_ddp"] is None else f"{r['ratio_ddp']:.2f}"
        lines.append(f"{r['variant']:<18}{r['ms']:>9.1f}{r['exposed_ms']:>12.1f}{wait:>9}"
                     f"{ratio:>8}  {target}".rstrip())
    computes = [r for r in records if r["op"] == "compute"]
    if computes:
        lines += [f"compute: a {size_text(computes[0]['size'])} all-reduce issued before a forward "
                  f"pass (batch {BATCH}); vs apart = time / (all-reduce alone + forward "
                  "alone)",
                  f"{'variant':<18}{'ms':>9}{'vs apart':>10}"]
        lines += [f"{r['variant']:<18}{r['ms']:>9.1f}{r['ratio_apart']:>10.2f}"
                  for r in computes]
    return lines
