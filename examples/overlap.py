"""Hide gradient averaging under backward: GradSync bucket sizes beside one flat all-reduce and DDP.

Every rank trains the same MLP (24 layers of 448x448: 18.4 MiB of float32 parameters,
each weight under the 1 MiB from which GradSync reduces a gradient alone, so that the
bucket size decides the layout) on batches of its own, data-parallel: after each
backward, gradients are averaged over the ranks, then every rank takes the same SGD
step. The averaging is done five ways, each for ``STEPS`` steps from the same starting
weights:

- ``bucket 1 MB``, ``bucket 5 MB``, ``bucket 25 MB``: ``asyncomm.GradSync`` all-reduces
  each bucket of gradients as soon as backward has filled it, so communication runs
  while the rest of backward computes; ``await sync.wait()`` waits for what is left
  (``shared_memory=False``: on one host GradSync would otherwise sum the gradients
  through shared memory after backward, which docs/overlap.md compares with DDP);
- ``flat``: backward first, then one all-reduce of all gradients flattened together
  (nothing overlaps);
- ``DDP``: torch's ``DistributedDataParallel`` at its default 25 MB buckets, its
  all-reduces put on the timeline by ``asyncomm.trace.ddp`` (gloo only: DDP runs on a
  torch process group).

Rank 0 prints, for each, the median step time and the exposed communication measured
two ways: from step times (the time from the end of backward until the averaged
gradients are in ``.grad``; DDP waits inside its backward, so it has none) and from the
trace (per step, communication that progressed with no compute under it: see
docs/tracing.md); and the steps each setting took in the trace. What it printed on
the development machine (``asyncomm run -n 2 examples/overlap.py``), and the picture it
draws, are in docs/overlap.md.

Smaller buckets start communicating sooner (and leave less to wait for after
backward) but pay more per-operation overhead; 25 MB is DDP's default, and the
first bucket holds 1 MB in every setting, as DDP's does. Forward and backward run
through ``asyncomm.compute`` (off the event loop, so the loop keeps completing and
issuing operations during backward: MPI's operations progress only when the loop
tests them); ``--on-loop`` runs them on the loop instead, recorded in the trace with
``asyncomm.trace.span``. Every rank is traced (``--trace DIR``, default
``overlap-trace``; under ``asyncomm run --trace`` the run's directory is used): rank 0
merges the ranks' files and draws ``DIR/timeline.png``, one step of GradSync at 25 MB
beside one of DDP (``asyncomm trace DIR --steps A:A --steps B:B`` draws any steps side
by side). ``--quick`` uses a smaller model and a few steps (a smoke test).

    asyncomm run -n 2 examples/overlap.py
    asyncomm run -n 2 --backend mpi examples/overlap.py --on-loop
"""

import argparse
import functools
import itertools
import os
import statistics
import time

import torch
from torch import nn

import asyncomm

WIDTHS, QUICK_WIDTHS = (448,) * 25, (256,) * 29  # 24 layers of 784 KiB; 28 of 256 KiB
BATCH, STEPS, LR = 64, 8, 0.01
SETTINGS = (1.0, 5.0, 25.0, "flat", "DDP")


def mlp(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)  # the same starting weights on every rank
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


async def flat_average(comm: asyncomm.Comm, model: nn.Module) -> None:
    """Average all gradients in one all-reduce of their concatenation."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    await comm.all_reduce(flat, "avg")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the loss of ``model`` on one batch."""
    return nn.functional.mse_loss(model(x), y)


async def train(comm: asyncomm.Comm, setting: float | str, widths: tuple[int, ...],
                steps: int, offload: bool) -> tuple[nn.Module, list[float], list[float], str]:
    """Train ``steps`` steps after one to warm up, each marked on the timeline; return the
    model, step times, exposed times (from the end of backward) and a label."""
    model = trained = mlp(widths)
    sync = None
    if setting == "DDP":
        trained = asyncomm.trace.ddp(nn.parallel.DistributedDataParallel(model))
    elif setting != "flat":
        # shared_memory=False: the all-reduces under backward are what this study is about
        # (on one host, GradSync's default sums through shared memory after backward)
        sync = asyncomm.GradSync(model, comm, bucket_mb=setting, shared_memory=False)
    g = torch.Generator().manual_seed(comm.rank)
    step_s, exposed_s = [], []
    for _ in range(steps + 1):  # the first step warms up
        x = torch.randn(BATCH, widths[0], generator=g)
        y = torch.randn(BATCH, widths[-1], generator=g)
        await comm.barrier()
        asyncomm.trace.step()
        start = time.perf_counter()
        if offload:
            loss = await asyncomm.compute(forward, trained, x, y)
            await asyncomm.compute(loss.backward, name="backward")
        else:
            with asyncomm.trace.span("forward"):
                loss = forward(trained, x, y)
            with asyncomm.trace.span("backward"):
                loss.backward()
        backward_done = time.perf_counter()
        if setting == "flat":
            await flat_average(comm, model)
        elif sync is not None:
            await sync.wait()
        averaged = time.perf_counter()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        step_s.append(time.perf_counter() - start)
        exposed_s.append(averaged - backward_done)
    if sync is None:
        label = "flat: 1 all-reduce" if setting == "flat" else "DDP: 25 MB buckets"
    else:
        label = f"bucket {setting:g} MB: {len(sync.buckets)} bucket(s)"
        sync.close()
    return model, step_s[1:], exposed_s[1:], label


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``, or the process's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, 3 steps")
    parser.add_argument("--on-loop", action="store_true",
                        help="run forward and backward on the event loop, not through "
                        "asyncomm.compute")
    parser.add_argument("--trace", metavar="DIR", default="overlap-trace",
                        help="trace every rank into DIR and draw DIR/timeline.png "
                        "(default overlap-trace; '' for none)")
    return parser.parse_args(argv)


def traced_exposed(directory: os.PathLike[str], ranges: list[range]) -> tuple[list[str], str]:
    """Rank 0's exposed communication per setting from the merged trace (median over the
    setting's steps), and the timeline's path: GradSync at 25 MB beside DDP, a step each."""
    merged = asyncomm.trace.merge(directory)
    per_step = asyncomm.trace.steps(merged)[0]
    def ms(r: range, figure: str) -> str:
        return f"{statistics.median(getattr(per_step[i], figure) for i in r) * 1e3:.1f} ms"

    lines = [f"trace, steps {r.start}-{r.stop - 1}: communication hidden {ms(r, 'hidden')}, "
             f"exposed {ms(r, 'exposed')}, stalled {ms(r, 'stalled')}" for r in ranges]
    # a step before its setting's last: the last one's window runs into the next setting
    shown = [(label, ranges[SETTINGS.index(setting)][-2]) for label, setting in
             (("GradSync, 25 MB buckets", 25.0), ("DDP", "DDP"))
             if SETTINGS.index(setting) < len(ranges)]
    png = asyncomm.trace.draw(merged, os.path.join(directory, "timeline.png"),
                              "one step of each (rank 0 and 1)",
                              [(f"{label}: step {index}",
                                asyncomm.trace.window(merged, index, index))
                               for label, index in shown])
    return lines, str(png)


async def main(comm: asyncomm.Comm, args: argparse.Namespace | None = None) -> None:
    args = options([]) if args is None else args
    if args.trace:
        asyncomm.trace.start(args.trace)
    # Ranks share this machine's cores: give each its part, not all of them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.size))
    widths, steps = (QUICK_WIDTHS, 3) if args.quick else (WIDTHS, STEPS)
    settings = [s for s in SETTINGS if s != "DDP" or comm.backend == "gloo"]
    checks, lines, ranges = [], [], []
    for setting in settings:
        first = len(ranges) * (steps + 1) + 1  # the warm-up step is left out
        ranges.append(range(first, first + steps))
        model, step_s, exposed_s, label = await train(comm, setting, widths, steps,
                                                      not args.on_loop)
        exposed = ("" if setting == "DDP" else
                   f", exposed communication {statistics.median(exposed_s) * 1e3:.1f} ms")
        lines.append(f"{label}, step {statistics.median(step_s) * 1e3:.1f} ms{exposed}")
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        checks.append(torch.stack([weights.sum(), weights.abs().sum()]))
    everyone = await comm.all_gather(torch.stack(checks))
    traced = None
    if args.trace:
        traced = asyncomm.trace.stop()  # writes this rank's file (where tracing went)
        await comm.barrier()  # every rank's file is written
    if comm.rank == 0:
        traces, png = ([], "") if traced is None else traced_exposed(traced.parent, ranges)
        for line, trace in itertools.zip_longest(lines, traces):
            print(line if trace is None else f"{line}\n  {trace}", flush=True)
        same = all(torch.equal(other, everyone[0]) for other in everyone)
        print(f"overlap: {len(settings)} settings, weights "
              f"{'identical' if same else 'DIFFERENT'} on all {comm.size} ranks", flush=True)
        assert same, "every rank must end with the same weights"
        if png:
            print(f"timeline: {png}", flush=True)


if __name__ == "__main__":
    asyncomm.run(functools.partial(main, args=options()))
