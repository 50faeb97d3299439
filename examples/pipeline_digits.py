"""Pipeline-parallel training of an MLP on scikit-learn's digits (8x8 images, bundled).

The model (64 -> 128 -> 128 -> 128 -> 10, ReLU) is cut into one stage per rank
(``pipeline.split``) and trained with a pipeline schedule (1F1B by default):
each batch of 64 images is split into 4 microbatches of 16 that flow through the
stages, forwards one way and gradients back. Rank 0 feeds the images, the last
rank holds the labels and the loss; every rank steps its own optimizer on its
own stage. Then the test images go through the pipeline forward only, and the
last rank prints the test accuracy, the throughput, and the bubble: the
fraction of each step a rank spent not computing, measured, beside the
simulator's figure for the same schedule (forward 1, backward 2).

    asyncomm run -n 2 examples/pipeline_digits.py
    asyncomm run -n 4 --backend mpi examples/pipeline_digits.py
    asyncomm run -n 2 examples/pipeline_digits.py --schedule interleaved   # 2 stages per rank
    asyncomm run -n 2 examples/pipeline_digits.py --schedule zbh1          # zero bubble
    asyncomm run -n 2 examples/pipeline_digits.py --schedule zbv           # ZB-V: 2 per rank
"""

import argparse
import functools
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import asyncomm
from asyncomm import pipeline

BATCH, MICROBATCHES, HIDDEN = 64, 4, 128


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits split 80/20 the same way on every rank, standardised by the training set."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y)
    mean, scale = x_train.mean(axis=0), x_train.std(axis=0) + 1.0  # + 1: blank pixels
    return (torch.tensor((x_train - mean) / scale, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor((x_test - mean) / scale, dtype=torch.float32), torch.tensor(y_test))


def model() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank: each keeps its own stages
    return nn.Sequential(
        nn.Linear(64, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``, or the process's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=sorted(pipeline.SCHEDULES), default="1f1b")
    parser.add_argument("--epochs", type=int, default=10)
    return parser.parse_args(argv)


async def main(comm: asyncomm.Comm, args: argparse.Namespace | None = None) -> None:
    args = options([]) if args is None else args
    kw = {"stages_per_rank": 2} if args.schedule == "interleaved" else {}
    schedule = pipeline.get(args.schedule, comm.size, MICROBATCHES, **kw)
    pipe = pipeline.Pipeline(comm, schedule, pipeline.split(model(), schedule.n_stages),
                             nn.functional.cross_entropy)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=2e-3)
    x_train, y_train, x_test, y_test = data()
    order = torch.Generator().manual_seed(1)
    busy = wall = 0.0
    samples, loss = 0, None
    start = time.perf_counter()
    for _ in range(args.epochs):
        perm = torch.randperm(len(x_train), generator=order)  # the same on every rank
        for i in range(0, len(perm) - BATCH + 1, BATCH):  # whole batches only
            batch = perm[i:i + BATCH]
            optimizer.zero_grad()
            loss = await pipe.step(x_train[batch] if pipe.first else None,
                                   y_train[batch] if pipe.last_stage else None)
            optimizer.step()
            assert pipe.last is not None
            busy, wall = busy + pipe.last.busy_s, wall + pipe.last.wall_s
            samples += BATCH
    elapsed = time.perf_counter() - start
    logits = await pipe.forward(x_test if pipe.first else None)
    await pipe.close()
    bubbles = await comm.all_gather_object(1.0 - busy / wall)
    if pipe.last_stage:
        assert logits is not None and loss is not None
        accuracy = (logits.argmax(dim=1) == y_test).float().mean().item()
        theory = pipeline.simulate(schedule).bubble
        print(f"{schedule.name}: {schedule.n_stages} stages on {comm.size} ranks, "
              f"{MICROBATCHES} microbatches of {BATCH // MICROBATCHES}, {args.epochs} epochs, "
              f"last loss {loss:.4f}")
        print(f"test accuracy: {accuracy:.4f}")
        print(f"throughput: {samples / elapsed:.0f} samples/s")
        print(f"bubble: {sum(bubbles) / len(bubbles):.2f} measured (per rank "
              f"{' '.join(f'{b:.2f}' for b in bubbles)}), {theory:.2f} in theory")


if __name__ == "__main__":
    asyncomm.run(functools.partial(main, args=options()))
