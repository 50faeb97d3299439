"""What a persistent MPI request saves on a small message, for measuring only.

Not part of asyncomm. Run with ``mpiexec -n 2 python docs/prototypes/persistent_requests.py``
(mpi4py, torch). With mpi4py alone, no event loop, it prints per round:

- an 8-byte ping-pong leg: blocking ``Send``/``Recv``; ``Isend``/``Irecv`` tested until
  done; a kept ``Send_init``/``Recv_init`` started and tested until done;
- an 8-byte all-reduce: blocking ``Allreduce``; ``Iallreduce`` tested until done; a
  kept ``Allreduce_init`` started and tested; the same staged through a buffer of its
  own (copied in and out, as a request kept for every rank alike would need).

asyncomm's quick sends and receives start kept requests (see the note on persistent
requests in ``_backends/mpi_kept.py``; figures in docs/benchmarks.md, "What these say").
"""

import time

import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, N = comm.Get_rank(), 50000
peer = 1 - rank
t = torch.zeros(2)
buf = [t.numpy(), MPI.FLOAT]
stage = bytearray(8)
staged, mine = memoryview(stage), MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)
kept_send, kept_recv = comm.Send_init(buf, peer, 7), comm.Recv_init(buf, peer, 7)
kept_sum = comm.Allreduce_init(MPI.IN_PLACE, buf, MPI.SUM)
kept_staged = comm.Allreduce_init(MPI.IN_PLACE, [stage, MPI.FLOAT], MPI.SUM)


def done(request: MPI.Request) -> None:
    while not request.Test():
        pass


def leg(send: object, recv: object) -> None:
    first, second = (send, recv) if rank == 0 else (recv, send)
    first()  # type: ignore[operator]
    second()  # type: ignore[operator]


def started(request: MPI.Request) -> None:
    request.Start()
    done(request)


def staged_sum() -> None:
    staged[:] = mine
    started(kept_staged)
    mine[:] = staged


VARIANTS = {
    "pp blocking": lambda: leg(lambda: comm.Send(buf, peer, 7), lambda: comm.Recv(buf, peer, 7)),
    "pp nonblocking": lambda: leg(lambda: done(comm.Isend(buf, peer, 7)),
                                  lambda: done(comm.Irecv(buf, peer, 7))),
    "pp persistent": lambda: leg(lambda: started(kept_send), lambda: started(kept_recv)),
    "ar blocking": lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
    "ar nonblocking": lambda: done(comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)),
    "ar persistent": lambda: started(kept_sum),
    "ar staged": staged_sum,
}

for _ in range(3):
    took = {}
    for name, step in VARIANTS.items():
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(N):
            step()
        per = (time.perf_counter() - start) / N * 1e6
        took[name] = per / 2 if name.startswith("pp") else per  # a leg: half a round trip
    if rank == 0:
        print("  ".join(f"{k} {v:.2f} us" for k, v in took.items()), flush=True)
for request in (kept_send, kept_recv, kept_sum, kept_staged):
    request.Free()
