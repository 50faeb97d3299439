"""``asyncomm.compute``: work off the event loop while communication progresses.
(Its pool, run on a bare loop and shut down by hand, is in internals/test_compute_pool.py.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World


async def check_communication_progresses_during_compute(comm: Comm) -> bool:
    peer = 1 - comm.rank
    done = threading.Event()

    async def ping_pong() -> None:
        t = torch.zeros(4)
        for _ in range(20):
            if comm.rank == 0:
                await comm.send(t, peer)
                await comm.recv(t, peer)
            else:
                await comm.recv(t, peer)
                await comm.send(t, peer)
            await comm.all_reduce(t)
        done.set()

    # The compute holds its thread until the 60 round trips are done: they can only
    # finish while it runs (else it gives up after 60 s and says so).
    waited, _ = await asyncio.gather(asyncomm.compute(done.wait, 60.0), ping_pong())
    return bool(waited)


def test_communication_progresses_during_compute(world2: World) -> None:
    assert world2.run(check_communication_progresses_during_compute) == [True, True]


async def test_bad_arguments_raise_type_error() -> None:
    with pytest.raises(TypeError, match="callable"):
        await asyncomm.compute(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        await asyncomm.compute(print, name=5)  # type: ignore[arg-type]
