"""The baseline of the prototypes' small-dict rows: mpi4py's pickle ``send``/``recv``.

Imported by ``lean_channel.py`` and ``lean_semantics.py`` (run from anywhere: a script's
own folder is on its path).
"""

import time
from typing import Any


def pickled(comm: Any, rank: int, peer: int, message: object, rounds: int,
            per_round: int) -> float:
    """Rank 0 sends ``per_round`` messages with pickle, rank 1 receives them and acks."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            for _ in range(per_round):
                comm.send(message, peer, 11)
            comm.recv(source=peer, tag=12)
        else:
            for _ in range(per_round):
                comm.recv(source=peer, tag=11)
            comm.send(None, peer, 12)
    return time.perf_counter() - start
