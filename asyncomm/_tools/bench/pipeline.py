"""``asyncomm bench pipeline``: the pipeline executor against torch's, and against theory.

Two measurements, each rank running its stages (docs/benchmarks.md, "Pipeline"): ``vs
torch`` (gloo only), a training step of the same MLP under ``torch.distributed.pipelining``
(``TORCH_SCHEDULES``) and under ``Pipeline``, alternated round by round, a step's time the
slowest rank's; and ``bubble``, stages of fixed cost (``FixedCost``) under every schedule,
measured as the simulator defines it, ``1 - sum(busy) / (ranks x makespan)``, from every
rank's ``Pipeline.last`` (the ranks share a host, so their ``perf_counter`` readings
compare), against ``simulate(schedule).bubble``.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from torch import nn

from asyncomm import pipeline
from asyncomm._comm import Comm
from asyncomm._tools.bench.harness import Record

# asyncomm's schedule -> torch.distributed.pipelining's counterpart (for zbh1: torch's
# interleaved zero-bubble schedule with one stage per rank, the same F/B/W split)
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "zbh1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
_TORCH_MULTI = ("zbh1", "zbv")  # torch's schedules that take a list of stages
BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1", "zbv")
BUBBLE_TARGET = 1.15


class _Sleeps(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` forward and ``backward_s`` backward (GIL released)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        if forward_s:  # time.sleep(0) is not free: it gives up the GIL and the core
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedCost(nn.Module):
    """A stage of fixed cost: forward ``t``; backward ``t`` to its input and ``t`` to its weight.

    The two backward paths are apart (the input's through one node, the weight's through
    another), so a split backward's B costs ``t`` and its W ``t``, a whole one ``2 t``.
    Stage 0's input must require grad for its B to cost ``t`` too.
    """

    def __init__(self, t: float, width: int) -> None:
        super().__init__()
        self.t = t
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        through: torch.Tensor = _Sleeps.apply(x, self.t, self.t)  # type: ignore[no-untyped-call]
        weight: torch.Tensor = _Sleeps.apply(self.bias, 0.0, self.t)  # type: ignore[no-untyped-call]
        return through + weight


async def _timed(comm: Comm, step: Callable[[], Awaitable[Any]], steps: int) -> float:
    """Seconds per step of ``steps`` steps after a warm-up step, the slowest rank's."""
    await step()
    await comm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        await step()
    per_step = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    await comm.all_reduce(per_step, "max")
    return float(per_step.item())


def _torch_step(name: str, modules: dict[int, nn.Module], n_stages: int,
                n_microbatches: int, x: torch.Tensor, y: torch.Tensor
                ) -> Callable[[], Awaitable[None]]:
    """One step of torch.distributed.pipelining on this rank's stages (blocking calls)."""
    from torch.distributed import pipelining

    stages = [pipelining.PipelineStage(module, s, n_stages, torch.device("cpu"))
              for s, module in sorted(modules.items())]
    kind = getattr(pipelining, TORCH_SCHEDULES[name])
    schedule = kind(stages if name in _TORCH_MULTI else stages[0], n_microbatches,
                    loss_fn=nn.functional.mse_loss)
    first, last = 0 in modules, n_stages - 1 in modules

    async def step() -> None:
        for module in modules.values():
            module.zero_grad()
        # the first stage takes the input; the last the target, and a list for the losses
        schedule.step(*([x] if first else []), target=y if last else None,
                      losses=[] if last else None)

    return step


def _ours_step(comm: Comm, schedule: pipeline.Schedule, modules: dict[int, nn.Module],
               x: torch.Tensor, y: torch.Tensor
               ) -> tuple[Callable[[], Awaitable[None]], pipeline.Pipeline]:
    pipe = pipeline.Pipeline(comm, schedule, modules, nn.functional.mse_loss)

    async def step() -> None:
        for module in modules.values():
            module.zero_grad()
        await pipe.step(x if pipe.first else None, y if pipe.last_stage else None)

    return step, pipe


async def versus_torch(comm: Comm, width: int, batch: int, n_microbatches: int,
                       rounds: int, steps: int) -> list[Record]:
    """Step times of torch's pipelining and asyncomm's, alternated round by round."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=gen)
    y = torch.randn(batch, width, generator=gen)
    records = []
    for name in TORCH_SCHEDULES:
        schedule = pipeline.get(name, comm.size, n_microbatches)
        torch.manual_seed(0)  # the same model on every rank
        model = [nn.Sequential(nn.Linear(width, width), nn.Tanh())
                 for _ in range(schedule.n_stages)]
        mine: dict[int, nn.Module] = {s: model[s] for s in schedule.stages_of(comm.rank)}
        ours, pipe = _ours_step(comm, schedule, copy.deepcopy(mine), x, y)
        theirs = _torch_step(name, copy.deepcopy(mine), schedule.n_stages, n_microbatches,
                             x, y)
        variants = {"torch": theirs, "asyncomm": ours}
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            for variant, step in variants.items():
                samples[variant].append(await _timed(comm, step, steps))
        await pipe.close()
        ms = {v: 1e3 * statistics.median(s) for v, s in samples.items()}
        records.append({
            "test": "vs_torch", "schedule": name, "width": width, "batch": batch,
            "microbatches": n_microbatches, "steps": steps, "torch_ms": ms["torch"],
            "asyncomm_ms": ms["asyncomm"], "ratio": ms["asyncomm"] / ms["torch"],
            "target": 1.0, "samples_ms": {v: [1e3 * t for t in s] for v, s in samples.items()},
        })
    return records


async def bubble(comm: Comm, t: float, n_microbatches: int, steps: int) -> list[Record]:
    """Measured bubble of fixed-cost stages under every schedule, beside the simulator's."""
    width = 16
    records = []
    for name in BUBBLE_SCHEDULES:
        kw = {"stages_per_rank": 2} if name == "interleaved" else {}
        schedule = pipeline.get(name, comm.size, n_microbatches, **kw)
        stages = [FixedCost(t, width) for _ in range(schedule.n_stages)]
        pipe = pipeline.Pipeline(comm, schedule, stages, lambda out, _: out.sum())
        x = torch.zeros(n_microbatches, width, requires_grad=True)  # stage 0's B costs t too
        measured = []
        for step in range(steps + 1):
            await comm.barrier()
            await pipe.step(x if pipe.first else None, x if pipe.last_stage else None)
            assert pipe.last is not None
            busy = torch.tensor([pipe.last.busy_s], dtype=torch.float64)
            ends = torch.tensor([-pipe.last.start, pipe.last.end], dtype=torch.float64)
            await comm.all_reduce(busy)
            await comm.all_reduce(ends, "max")
            if step:  # the first is a warm-up
                makespan = ends[0].item() + ends[1].item()
                measured.append(1.0 - busy.item() / (comm.size * makespan))
        await pipe.close()
        theory = pipeline.simulate(schedule).bubble  # F = B = W = 1: a whole backward 2
        value = statistics.median(measured)
        records.append({
            "test": "bubble", "schedule": name, "stages": schedule.n_stages,
            "microbatches": n_microbatches, "f_ms": 1e3 * t, "b_ms": 2e3 * t, "steps": steps,
            "measured": value, "theory": theory, "ratio": value / theory,
            "target": BUBBLE_TARGET, "samples": measured,
        })
    return records


def table(records: Sequence[Record]) -> list[str]:
    """The lines of both sections (after the header line)."""
    m = records[0]
    lines: list[str] = []
    torch_rows = [r for r in records if r["test"] == "vs_torch"]
    if torch_rows:
        r0 = torch_rows[0]
        lines.append(f"pipeline vs torch.distributed.pipelining: MLP width {r0['width']}, "
                     f"batch {r0['batch']} in {r0['microbatches']} microbatches, median of "
                     f"{m['rounds']} rounds of {r0['steps']} steps")
        lines.append(f"{'schedule':<10}{'torch ms':>10}{'asyncomm ms':>13}{'ratio':>8}  target")
        for r in torch_rows:
            met = "met" if r["ratio"] <= r["target"] else "MISSED"
            lines.append(f"{r['schedule']:<10}{r['torch_ms']:>10.2f}{r['asyncomm_ms']:>13.2f}"
                         f"{r['ratio']:>8.2f}  <= {r['target']:g}: {met}")
    bubble_rows = [r for r in records if r["test"] == "bubble"]
    if bubble_rows:
        r0 = bubble_rows[0]
        lines.append(f"bubble: fixed-cost stages, F {r0['f_ms']:g} ms, B {r0['b_ms']:g} ms, "
                     f"{r0['microbatches']} microbatches, median of {r0['steps']} steps")
        lines.append(f"{'schedule':<12}{'stages':>7}{'measured':>10}{'theory':>8}{'ratio':>8}"
                     "  target")
        for r in bubble_rows:
            met = "met" if r["ratio"] <= r["target"] else "MISSED"
            lines.append(f"{r['schedule']:<12}{r['stages']:>7}{r['measured']:>10.3f}"
                         f"{r['theory']:>8.3f}{r['ratio']:>8.2f}  <= {r['target']:g}: {met}")
    return lines


async def measure(comm: Comm, rounds: int, quick: bool) -> list[Record]:
    """Run both sections (torch's pipelining on gloo only); return rank 0's records."""
    width, batch, mbs = (256, 32, 4) if quick else (1024, 128, 8)
    steps = 3 if quick else 10
    t = 0.01 if quick else 0.05  # long enough that a message's latency is small beside it
    found = []
    torch.set_num_threads(1)  # two ranks share the cores: one intra-op thread each
    if comm.backend == "gloo":
        found += await versus_torch(comm, width, batch, mbs, rounds, steps)
    found += await bubble(comm, t, 2 * comm.size, steps)
    return [{"bench": "pipeline", **r} for r in found] if comm.rank == 0 else []
