"""asyncomm: await your distributed PyTorch communication.

Collectives and point-to-point operations return awaitable ``Handle``s over
torch.distributed (gloo, nccl) or MPI; every rank runs one asyncio event loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncomm import trace
    from asyncomm._comm import Comm
    from asyncomm._core.errors import (
        CommClosedError,
        CommError,
        CommTimeoutError,
        MismatchError,
        PeerFailedError,
        ProtocolError,
        RemoteError,
    )
    from asyncomm._core.handle import Handle
    from asyncomm._core.ops import ReduceOp
    from asyncomm._messaging.actors import Actor, ActorRef, endpoint
    from asyncomm._messaging.channels import Channel, Message
    from asyncomm._messaging.meshes import Mesh
    from asyncomm._overlap.compute import compute
    from asyncomm._overlap.gradsync import GradSync
    from asyncomm._runtime import init, run

# Where each public name lives. Importing them is deferred to their first use so that the
# command line (``asyncomm run`` spawning ranks, ``--help``) starts without loading torch.
_HOMES = {name: home for home, names in (
    ("_comm", ("Comm",)),
    ("_core.errors", ("CommClosedError", "CommError", "CommTimeoutError", "MismatchError",
                      "PeerFailedError", "ProtocolError", "RemoteError")),
    ("_core.handle", ("Handle",)),
    ("_core.ops", ("ReduceOp",)),
    ("_messaging.actors", ("Actor", "ActorRef", "endpoint")),
    ("_messaging.channels", ("Channel", "Message")),
    ("_messaging.meshes", ("Mesh",)),
    ("_overlap.compute", ("compute",)),
    ("_overlap.gradsync", ("GradSync",)),
    ("_runtime", ("init", "run")),
) for name in names}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        value = getattr(importlib.import_module(f"asyncomm.{_HOMES[name]}"), name)
    else:  # a module of the package (``asyncomm.trace``, ``asyncomm.pipeline``, ...)
        try:
            value = importlib.import_module(f"asyncomm.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"asyncomm.{name}":
                raise
            raise AttributeError(f"module 'asyncomm' has no attribute {name!r}") from None
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = ["Actor", "ActorRef", "Channel", "Comm", "CommClosedError", "CommError",
           "CommTimeoutError", "GradSync", "Handle", "Mesh", "Message", "MismatchError",
           "PeerFailedError", "ProtocolError", "ReduceOp", "RemoteError", "__version__",
           "compute", "endpoint", "init", "run", "trace"]
