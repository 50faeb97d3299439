"""The checks of ``Comm``'s arguments: a bad one raises before anything is sent."""

from __future__ import annotations

import operator
import warnings

import numpy as np
import torch

from asyncomm._core.backend import Backend
from asyncomm._core.ops import ReduceOp, check_reduce


class Arguments:
    """Check the arguments of a communicator's operations; raise ``TypeError``/``ValueError``.

    Each check returns the value as the backend takes it (an array as a tensor, a numpy
    integer as an int). Plain values in range pass in one step: every operation checks.
    """

    def __init__(self, backend: Backend, timeout: float) -> None:
        self._backend = backend
        self.timeout = timeout  # the communicator's default deadline
        self._checked_ops: dict[tuple[object, torch.dtype], ReduceOp] = {}

    def what(self, op: str) -> str:
        return f"rank {self._backend.rank}: {op}"

    def tensor(self, value: object, op: str, name: str = "tensor",
               writes: bool = True) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            tensor = value
        elif isinstance(value, np.ndarray):
            tensor = self.from_numpy(value, op, name, writes)
        else:
            raise TypeError(f"{self.what(op)}: {name} must be a torch.Tensor or numpy.ndarray, "
                            f"not {type(value).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{self.what(op)}: {name} must be contiguous "
                             "(call .contiguous() and use the copy)")
        if tensor.is_conj() or tensor.is_neg():  # (its memory holds other values: not moved)
            kind, call = ("conjugate", "resolve_conj") if tensor.is_conj() else (
                "negative", "resolve_neg")
            raise ValueError(f"{self.what(op)}: {name} is a {kind} view, whose memory does not "
                             f"hold its values (call .{call}() and use the copy)")
        backend = self._backend
        if not (tensor.is_cuda if backend.cuda else tensor.is_cpu):  # (meta, mps, ...: no)
            raise TypeError(f"{self.what(op)}: the {backend.name} backend moves "
                            f"{'cuda' if backend.cuda else 'cpu'} tensors, "
                            f"{name} is on {tensor.device}")
        if backend.dtypes is not None and tensor.dtype not in backend.dtypes:
            raise TypeError(f"{self.what(op)}: the {backend.name} backend cannot move "
                            f"{tensor.dtype}")
        return tensor

    def from_numpy(self, array: np.ndarray, op: str, name: str,  # type: ignore[type-arg]
                   writes: bool) -> torch.Tensor:
        if not array.flags.writeable:
            if writes:
                raise ValueError(f"{self.what(op)}: {name} is a read-only array")
            with warnings.catch_warnings():  # torch warns of read-only arrays; we only read
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(array)
        try:
            return torch.from_numpy(array)
        except TypeError as exc:
            raise TypeError(f"{self.what(op)}: {name}: {exc}") from None

    def tensors(self, values: object, op: str, name: str, like: torch.Tensor | None,
                writes: bool = True) -> list[torch.Tensor]:
        size = self._backend.size
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{self.what(op)}: {name} must be a list of {size} tensors, "
                            f"not {type(values).__name__}")
        if len(values) != size:
            raise ValueError(f"{self.what(op)}: {name} has {len(values)} tensors, "
                             f"expected one per rank ({size})")
        tensors = [self.tensor(v, op, f"{name}[{i}]", writes) for i, v in enumerate(values)]
        for i, tensor in enumerate(tensors):
            if like is not None and (tensor.shape != like.shape or tensor.dtype != like.dtype):
                raise ValueError(
                    f"{self.what(op)}: {name}[{i}] is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {tuple(like.shape)} {like.dtype} like the tensor")
            if tensor.dtype != tensors[0].dtype:
                raise TypeError(f"{self.what(op)}: {name} mixes dtypes "
                                f"{tensors[0].dtype} and {tensor.dtype}")
        return tensors

    def peer(self, value: object, op: str, name: str, self_ok: bool = True) -> int:
        if type(value) is int and 0 <= value < self._backend.size and (
                self_ok or value != self._backend.rank):
            return value  # the commonest: a plain int in range
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{self.what(op)}: {name} must be an int rank, "
                            f"not {type(value).__name__}")
        rank, size = operator.index(value), self._backend.size
        if not 0 <= rank < size:
            raise ValueError(f"{self.what(op)}: {name}={rank} is outside 0..{size - 1}")
        if not self_ok and rank == self._backend.rank:
            raise ValueError(f"{self.what(op)}: {name}={rank} is this rank itself")
        return rank

    def tag(self, value: object, op: str, most: int | None = None) -> int:
        most = self._backend.max_tag if most is None else most
        if type(value) is int and 0 <= value <= most:
            return value  # the commonest: a plain int in range
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{self.what(op)}: tag must be an int, not {type(value).__name__}")
        tag = operator.index(value)
        if not 0 <= tag <= most:
            raise ValueError(f"{self.what(op)}: tag={tag} is outside 0..{most}")
        return tag

    def deadline(self, timeout: float | None, op: str) -> float:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"{self.what(op)}: timeout must be seconds (a number), "
                            f"not {type(timeout).__name__}")
        if not timeout > 0:
            raise ValueError(f"{self.what(op)}: timeout must be > 0 (math.inf for none), "
                             f"got {timeout}")
        return float(timeout)

    def reduce_op(self, op: ReduceOp | str, dtype: torch.dtype, what: str) -> ReduceOp:
        key = (op, dtype)
        parsed = self._checked_ops.get(key)
        if parsed is None:  # checked once per (op, dtype): reductions are a hot path
            try:
                parsed = ReduceOp.parse(op)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{self.what(what)}: {exc}") from None
            check_reduce(dtype, parsed, self.what(what))
            self._backend.check_reduce(dtype, parsed, self.what(what))
            self._checked_ops[key] = parsed
        return parsed
