"""asyncomm: await your distributed PyTorch communication.

Collectives and point-to-point operations return awaitable ``Handle``s over
torch.distributed (gloo, nccl) or MPI; every rank runs one asyncio event loop.
"""

from asyncomm import trace
from asyncomm._actors import Actor, ActorRef, endpoint
from asyncomm._channels import Channel, Message
from asyncomm._comm import Comm
from asyncomm._compute import compute
from asyncomm._errors import (
    CommClosedError,
    CommError,
    CommTimeoutError,
    MismatchError,
    PeerFailedError,
    ProtocolError,
    RemoteError,
)
from asyncomm._gradsync import GradSync
from asyncomm._handle import Handle
from asyncomm._ops import ReduceOp
from asyncomm._runtime import init, run

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorRef",
    "Channel",
    "Comm",
    "CommClosedError",
    "CommError",
    "CommTimeoutError",
    "GradSync",
    "Handle",
    "Message",
    "MismatchError",
    "PeerFailedError",
    "ProtocolError",
    "ReduceOp",
    "RemoteError",
    "__version__",
    "compute",
    "endpoint",
    "init",
    "run",
    "trace",
]
