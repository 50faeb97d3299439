"""The floor under a pipeline schedule's measured bubble, for measuring only.

Not part of asyncomm. Runs a schedule's action lists (``asyncomm.pipeline.get``: the
schedules are data) with no executor at all: every F, B and W sleeps 50 ms on the
rank's own thread (as the bench's fixed-cost stages do), activations and gradients
are 64-byte tensors sent with the raw backend's point-to-point operations, every
receive of a step posted when the step starts, sends waited for at its end; a
boundary inside one rank is a local hand-over. It prints the measured bubble
(``1 - sum(busy) / (ranks x makespan)``, the simulator's definition) against
``simulate(schedule).bubble``, the median of 10 steps after a warm-up.

    python -m torch.distributed.run --nproc-per-node 2 docs/prototypes/raw_pipeline.py gloo
    mpiexec -n 2 python docs/prototypes/raw_pipeline.py mpi

Optional further arguments: schedule names (default ``zbh1 zbv 1f1b``), and
``--autograd``: the stages are then the bench's own (``FixedCost``: an identity whose
forward sleeps 50 ms inside an autograd function, its input's backward 50 ms and its
weight's another 50), F a forward, B ``autograd.grad`` of the input (the graph kept), W
``autograd.grad`` of the weight, all on the rank's own thread: the executor's work with
no executor.
"""

import statistics
import sys
import time

import torch

from asyncomm import pipeline
from asyncomm.pipeline import Op

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "gloo"
AUTOGRAD = "--autograd" in sys.argv
NAMES = [a for a in sys.argv[2:] if not a.startswith("-")] or ["zbh1", "zbv", "1f1b"]
T = 0.05  # seconds each F, B and W sleeps
MICROBATCHES, STEPS = 4, 10

if BACKEND == "mpi":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def isend(t: torch.Tensor, dst: int, tag: int) -> object:
        return comm.Isend([t.numpy(), MPI.FLOAT], dst, tag)

    def irecv(t: torch.Tensor, src: int, tag: int) -> object:
        return comm.Irecv([t.numpy(), MPI.FLOAT], src, tag)

    def wait(request: object) -> None:
        request.Wait()  # type: ignore[attr-defined]

    def barrier() -> None:
        comm.Barrier()

    def slowest(values: list[float], op: str) -> list[float]:
        return [comm.allreduce(v, op=MPI.MAX if op == "max" else MPI.SUM) for v in values]
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def isend(t: torch.Tensor, dst: int, tag: int) -> object:
        return dist.isend(t, dst, tag=tag)

    def irecv(t: torch.Tensor, src: int, tag: int) -> object:
        return dist.irecv(t, src, tag=tag)

    def wait(request: object) -> None:
        request.wait()  # type: ignore[attr-defined]

    def barrier() -> None:
        dist.barrier()

    def slowest(values: list[float], op: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()


def tag(direction: int, stage: int, mb: int, n_stages: int) -> int:
    return (direction * n_stages + stage) * MICROBATCHES + mb


def step(schedule: pipeline.Schedule) -> tuple[float, float, float]:
    """One step of this rank's actions: (busy seconds, start, end)."""
    n = schedule.n_stages
    posted: dict[tuple[int, int, int], tuple[torch.Tensor, object]] = {}
    local: dict[tuple[int, int, int], torch.Tensor] = {}
    for action in schedule.actions[rank]:  # every receive of the step, posted first
        if action.op in (Op.RECV_F, Op.RECV_B):
            forward = action.op is Op.RECV_F
            peer_stage = action.stage - 1 if forward else action.stage + 1
            peer = schedule.rank_of(peer_stage)
            if peer != rank:
                key = (0 if forward else 1, min(action.stage, peer_stage), action.microbatch)
                buf = torch.empty(16)
                posted[key] = (buf, irecv(buf, peer, tag(*key, n)))
    sends, busy = [], 0.0
    kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (input, output)
    start = time.perf_counter()
    for action in schedule.actions[rank]:
        op = action.op
        if op in (Op.F, Op.B, Op.W):
            began = time.perf_counter()
            if not AUTOGRAD:
                time.sleep(T)
            elif op is Op.F:
                x = torch.zeros(1, 16, requires_grad=True)
                kept[action.stage, action.microbatch] = (x, STAGES[action.stage](x))
            elif op is Op.B:
                x, y = kept[action.stage, action.microbatch]
                torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
            else:
                x, y = kept.pop((action.stage, action.microbatch))
                torch.autograd.grad(y, STAGES[action.stage].bias, torch.ones_like(y))
            busy += time.perf_counter() - began
        elif op in (Op.SEND_F, Op.SEND_B):
            forward = op is Op.SEND_F
            peer_stage = action.stage + 1 if forward else action.stage - 1
            key = (0 if forward else 1, min(action.stage, peer_stage), action.microbatch)
            peer = schedule.rank_of(peer_stage)
            if peer == rank:
                local[key] = torch.ones(16)
            else:
                sends.append(isend(torch.ones(16), peer, tag(*key, n)))
        elif op in (Op.RECV_F, Op.RECV_B):
            forward = op is Op.RECV_F
            peer_stage = action.stage - 1 if forward else action.stage + 1
            key = (0 if forward else 1, min(action.stage, peer_stage), action.microbatch)
            if key in posted:
                wait(posted.pop(key)[1])
            else:
                local.pop(key)
    for request in sends:
        wait(request)
    return busy, start, time.perf_counter()


for name in NAMES:
    schedule = pipeline.get(name, size, MICROBATCHES)
    if AUTOGRAD:
        from asyncomm._tools.bench.pipeline import FixedCost

        STAGES = [FixedCost(T, 16) for _ in range(schedule.n_stages)]
    measured = []
    for i in range(STEPS + 1):
        barrier()
        busy, start, end = step(schedule)
        total_busy, = slowest([busy], "sum")
        first, last = slowest([-start, end], "max")
        if i:  # the first is a warm-up
            measured.append(1.0 - total_busy / (size * (first + last)))
    theory = pipeline.simulate(schedule).bubble
    if rank == 0:
        value = statistics.median(measured)
        print(f"{BACKEND}{' autograd' if AUTOGRAD else ''} {name:5s} measured {value:.3f} "
              f"theory {theory:.3f} ratio {value / theory:.2f}", flush=True)
