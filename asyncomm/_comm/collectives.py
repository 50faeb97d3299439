"""``Collectives``: the collective operations of ``Comm``, each checked, then issued (as
``Comm``'s docstring says); every rank of the communicator must call the same collectives in
the same order. The handle fails with ``CommTimeoutError`` (its deadline passed: ``timeout``,
or the communicator's), ``PeerFailedError`` (a rank it needs is gone), ``MismatchError`` (the
ranks disagree, where the backend or debug mode can tell) or ``CommClosedError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from asyncomm._core.arguments import Arguments
from asyncomm._core.backend import Backend
from asyncomm._core.errors import CommError
from asyncomm._core.handle import Deadlines, Handle
from asyncomm._core.instrument import Instrument
from asyncomm._core.ops import ReduceOp

Buffer = TypeVar("Buffer", torch.Tensor, np.ndarray)  # type: ignore[type-arg]


class Collectives:
    """Mixed into ``Comm``: its collectives (see the module's note on errors, and ``Comm``'s
    on quick operations)."""

    _rank: int
    _backend: Backend
    _args: Arguments
    _instrument: Instrument
    _deadlines: Deadlines
    _quick: bool  # the backend has quick operations
    _quick_ops: dict[object, dict[torch.dtype, object]]  # per op, per dtype: the backend's
    _hold: Callable[[Handle[Any], CommError], None]  # every handle's (``Peers._held``)
    _seq: int
    _last_op: str
    _last_tensor: object
    _issue: Callable[..., Handle[Any]]

    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        """Wait until every rank has called ``barrier``.

        Args:
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``None``.

        Raises:
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        return self._issue("barrier", self._backend.barrier, (), None, None, timeout)

    def broadcast(self, tensor: Buffer, src: int, *, timeout: float | None = None
                  ) -> Handle[Buffer]:
        """Copy ``src``'s ``tensor`` into ``tensor`` on every rank.

        Args:
            tensor: the data on ``src``, the buffer elsewhere (same shape and dtype).
            src: the rank whose data is copied.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``tensor``.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "broadcast")
        src = self._args.peer(src, "broadcast", "src")
        return self._issue("broadcast", self._backend.broadcast, (t, src), tensor, t, timeout)

    def all_reduce(self, tensor: Buffer, op: ReduceOp | str = "sum", *,
                   timeout: float | None = None) -> Handle[Buffer]:
        """Reduce ``tensor`` over all ranks, in place; every rank gets the result.

        Args:
            tensor: this rank's part, replaced by the result.
            op: a ``ReduceOp`` or its name (sum, avg, product, min, max, band, bor, bxor).
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``tensor``.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        if self._quick and timeout is None:  # see Comm's note on quick operations
            quick_ops = self._quick_ops.get(op)
            if quick_ops is not None and self._instrument.recording is None:
                seq = self._seq + 1
                handle = self._backend.quick_all_reduce(
                    tensor, quick_ops, (self._rank, "all_reduce", seq, None, None))
                if handle is not None:  # numbered; its deadline set if it is in flight
                    self._seq, self._last_op, self._last_tensor = seq, "all_reduce", tensor
                    if not handle._state:
                        handle._hold = self._hold
                        self._deadlines.add_default(handle)
                    return handle
        t = self._args.tensor(tensor, "all_reduce")
        reduce_op = self._args.reduce_op(op, t.dtype, "all_reduce")
        if self._quick and t.dtype not in self._quick_ops.get(op, ()):
            quick_op = self._backend.quick_op(t.dtype, reduce_op)
            if quick_op is not None:
                self._quick_ops.setdefault(op, {})[t.dtype] = quick_op
        return self._issue("all_reduce", self._backend.all_reduce, (t, reduce_op), tensor, t,
                           timeout)

    def reduce(self, tensor: Buffer, dst: int, op: ReduceOp | str = "sum", *,
               timeout: float | None = None) -> Handle[Buffer]:
        """Reduce ``tensor`` over all ranks into ``tensor`` on ``dst``.

        Args:
            tensor: this rank's part; on ``dst``, replaced by the result.
            dst: the rank that gets the result.
            op: a ``ReduceOp`` or its name.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``tensor``.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "reduce")
        dst = self._args.peer(dst, "reduce", "dst")
        reduce_op = self._args.reduce_op(op, t.dtype, "reduce")
        return self._issue("reduce", self._backend.reduce, (t, dst, reduce_op), tensor, t, timeout)

    def all_gather(self, tensor: torch.Tensor | np.ndarray,  # type: ignore[type-arg]
                   out: Sequence[Any] | None = None, *,
                   timeout: float | None = None) -> Handle[Sequence[Any]]:
        """Gather every rank's ``tensor`` on every rank.

        Args:
            tensor: this rank's part (the same shape and dtype on every rank).
            out: ``size`` buffers like ``tensor`` to gather into (default: made here).
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to the parts in rank order (``out``, if given).

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "all_gather", writes=False)
        outs = self._outputs(out, t, "all_gather")
        return self._issue("all_gather", self._backend.all_gather, (outs, t),
                           outs if out is None else out, (t, outs), timeout)

    def gather(self, tensor: torch.Tensor | np.ndarray, dst: int,  # type: ignore[type-arg]
               out: Sequence[Any] | None = None, *,
               timeout: float | None = None) -> Handle[Sequence[Any] | None]:
        """Gather every rank's ``tensor`` on ``dst``.

        Args:
            tensor: this rank's part (the same shape and dtype on every rank).
            dst: the rank that gets the parts.
            out: on ``dst``, ``size`` buffers to gather into (default: made here).
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to the parts in rank order on ``dst``, ``None`` elsewhere.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "gather", writes=False)
        dst = self._args.peer(dst, "gather", "dst")
        outs = self._outputs(out, t, "gather") if self._rank == dst else None
        result = outs if out is None or outs is None else out
        return self._issue("gather", self._backend.gather, (outs, t, dst), result, (t, outs),
                           timeout)

    def scatter(self, tensor: Buffer, chunks: Sequence[torch.Tensor] | None = None,
                src: int = 0, *, timeout: float | None = None) -> Handle[Buffer]:
        """Fill ``tensor`` on every rank with ``chunks[rank]`` of ``src``.

        Args:
            tensor: the buffer this rank's chunk lands in.
            chunks: on ``src`` only, ``size`` tensors like ``tensor``.
            src: the rank that gives the chunks.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``tensor``.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "scatter")
        src = self._args.peer(src, "scatter", "src")
        parts: list[torch.Tensor] | None = None
        if self._rank == src:
            if chunks is None:
                raise ValueError(f"{self._args.what('scatter')}: src {src} must give chunks")
            parts = self._args.tensors(chunks, "scatter", "chunks", like=t, writes=False)
        return self._issue("scatter", self._backend.scatter, (t, parts, src), tensor, (t, parts),
                           timeout)

    def reduce_scatter(self, tensor: Buffer, chunks: Sequence[torch.Tensor],
                       op: ReduceOp | str = "sum", *, timeout: float | None = None
                       ) -> Handle[Buffer]:
        """Set ``tensor`` to the reduction over ranks of their ``chunks[rank]``.

        Args:
            tensor: the buffer this rank's reduced chunk lands in.
            chunks: ``size`` tensors like ``tensor``, chunk j for rank j.
            op: a ``ReduceOp`` or its name.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``tensor``.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        t = self._args.tensor(tensor, "reduce_scatter")
        parts = self._args.tensors(chunks, "reduce_scatter", "chunks", like=t, writes=False)
        reduce_op = self._args.reduce_op(op, t.dtype, "reduce_scatter")
        return self._issue("reduce_scatter", self._backend.reduce_scatter, (t, parts, reduce_op),
                           tensor, (t, parts), timeout)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                   timeout: float | None = None) -> Handle[list[torch.Tensor]]:
        """Send ``inputs[j]`` to rank j; receive rank j's into ``outputs[j]``.

        Args:
            outputs: ``size`` buffers, one per source rank.
            inputs: ``size`` tensors of the outputs' dtype, one per destination rank.
            timeout: seconds until the handle fails (default: the communicator's).

        Returns:
            A handle that resolves to ``outputs``, as a list.

        Raises:
            TypeError, ValueError: bad arguments, before anything is sent.
            CommTimeoutError, PeerFailedError, MismatchError, CommClosedError: from the handle.
        """
        ins = self._args.tensors(inputs, "all_to_all", "inputs", like=None, writes=False)
        outs = self._args.tensors(outputs, "all_to_all", "outputs", like=None)
        if outs[0].dtype != ins[0].dtype:
            raise TypeError(f"{self._args.what('all_to_all')}: outputs are {outs[0].dtype}, "
                            f"inputs {ins[0].dtype}")
        return self._issue("all_to_all", self._backend.all_to_all, (outs, ins), list(outputs),
                           (outs, ins), timeout)

    def _outputs(self, out: Sequence[torch.Tensor] | None, like: torch.Tensor,
                 op: str) -> list[torch.Tensor]:
        if out is None:  # one allocation; consecutive views let backends gather in place
            return list(like.new_empty((self._backend.size, *like.shape)).unbind(0))
        return self._args.tensors(out, op, "out", like=like)
