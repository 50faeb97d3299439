"""Backends: the only code that imports torch.distributed or mpi4py, chosen once by name.

``torch_backend`` drives gloo and nccl process groups, ``gloo_link`` carries channel frames over
gloo; ``mpi_backend`` drives MPI communicators and ``mpi_link`` carries frames over MPI. Each
implements the interfaces of ``asyncomm._core.backend`` and ``asyncomm._core.link``.
"""

from __future__ import annotations

import asyncio

from asyncomm._core.backend import Backend
from asyncomm._core.env import LaunchEnv


async def open_backend(name: str, env: LaunchEnv, timeout: float,
                       loop: asyncio.AbstractEventLoop) -> tuple[Backend, Backend]:
    """Join the world on backend ``name``; return the user's and asyncomm's own communicator.

    The second communicator spans the same ranks and carries asyncomm's own multi-step operations
    (objects), so they never interleave with the user's collectives.
    """
    if name == "mpi":
        from asyncomm._backends.mpi_backend import open_mpi

        return await open_mpi(loop)
    from asyncomm._backends.torch_backend import open_torch

    return await open_torch(name, env, timeout, loop)
