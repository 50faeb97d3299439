"""``SharedSum``: the sum of every rank's buffer through shared memory, for ranks of one host.

Note on why
-----------
Between ranks of one host, an all-reduce over the backend's connections costs every rank the
kernel's copies of each byte, on the cores the ranks' computations fill. Through memory the
ranks share, the same sum costs each rank a copy in, its share of the additions and a copy
out (docs/overlap.md has the figures against DDP).

Note on the steps
-----------------
The shared file holds ``size + 1`` regions of ``numel`` elements: rank r's contribution in
region r, the sum in the last. ``sum()``: every rank has written its region (first barrier);
rank r adds up its own slice of every region, in rank order, into the sum region (so every
rank reads the same sum); second barrier; every rank reads the whole sum. Nothing is
overwritten while it is read: a rank writes its region again only after the second barrier
(no one reads the regions after it), and the sum region only after the next sum's first
barrier, which each rank enters once it has read the last sum. The barriers are the
communicator's: a dead peer or a timeout fails a sum as it fails any collective, and ranks
whose sum failed are out of step for good.

Note on making one
-----------------
``shared_sum()`` is a collective. Every rank says its host (its name and boot id): ranks on
several hosts get ``None``. Rank 0 makes the file in ``/dev/shm``, reserves its space
(``posix_fallocate``: a full ``/dev/shm`` refuses here, not with SIGBUS at a later write) and
writes a random token at its start; each rank checks the token before it maps the file (a
container of its own with the same host name fails that). Every rank agrees to use it, or
none does; rank 0 unlinks the file once all have mapped it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time

import torch

from asyncomm._comm import Comm
from asyncomm._core import shm
from asyncomm._observe import recorder

_FOLDER = shm.FOLDER
_TOKEN_BYTES = 16


class SharedSum:
    """Sums one buffer per rank of ``comm`` through a mapping every rank shares."""

    def __init__(self, comm: Comm, memory: torch.Tensor, numel: int) -> None:
        self._comm = comm
        regions = memory.view(comm.size + 1, numel)
        self.mine = regions[comm.rank]  # this rank's contribution goes here
        self.total = regions[comm.size]  # the sum, after ``sum()``
        # this rank's slice of every rank's region, and of the sum's
        part = regions[:, numel * comm.rank // comm.size:numel * (comm.rank + 1) // comm.size]
        self._parts, self._out = list(part[:-1]), part[-1]

    async def sum(self) -> None:
        """Write the sum of every rank's ``mine`` into ``total`` (see the note on the steps).

        Traced as one all-reduce of ``mine``'s bytes, ``gradsync:shared_sum``, from the
        first barrier's call to the second's end (the barriers appear on their own too).
        """
        start = time.perf_counter()
        await self._comm.barrier()
        first, second, *others = self._parts
        torch.add(first, second, out=self._out)
        for part in others:
            self._out.add_(part)
        await self._comm.barrier()
        recording = recorder.recorder()
        if recording is not None:
            recording.torch_op("all_reduce", self.mine.nbytes, start, time.perf_counter(),
                               "gradsync:shared_sum")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _create(nbytes: int) -> tuple[str, str] | None:
    """Make and reserve the shared file; return its path and token (``None``: cannot)."""
    try:
        fd, path = shm.reserved_file("asyncomm-sum", nbytes, _FOLDER)
    except OSError:
        return None
    try:
        token = os.urandom(_TOKEN_BYTES).hex()
        os.pwrite(fd, token.encode(), 0)
        return path, token
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _map(path: str, token: str, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Map the file rank 0 made, if it is the one it says (``None``: not this one, or none)."""
    try:
        with open(path, "rb") as f:
            if f.read(2 * _TOKEN_BYTES) != token.encode():
                return None
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except (OSError, RuntimeError):
        return None


async def shared_sum(comm: Comm, numel: int, dtype: torch.dtype) -> SharedSum | None:
    """Make a ``SharedSum`` of ``numel`` elements per rank; ``None`` where the ranks cannot
    share memory (a collective: see the note on making one)."""
    hosts = await comm.all_gather_object((socket.gethostname(), _boot_id()))
    if comm.size < 2 or len(set(hosts)) > 1:
        return None
    count = (comm.size + 1) * numel
    made = _create(count * dtype.itemsize) if comm.rank == 0 else None
    made = await comm.broadcast_object(made, src=0)
    memory = None if made is None else _map(made[0], made[1], count, dtype)
    mapped = await comm.all_gather_object(memory is not None)
    if comm.rank == 0 and made is not None:
        with contextlib.suppress(OSError):
            os.unlink(made[0])
    if not all(mapped):
        return None
    assert memory is not None, "every rank mapped it"
    return SharedSum(comm, memory, numel)
