"""Reduction operators and the dtypes a reduction accepts, shared by every backend."""

from __future__ import annotations

import contextlib
import enum

import torch


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values.

    On ``bool`` tensors ``sum``/``max``/``bor`` are logical or, ``product``/
    ``min``/``band`` logical and, ``bxor`` logical xor.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hashed so too (Enum's own hash is
    # Python code, and operators key the backends' caches on every reduction).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Return ``op`` as a ``ReduceOp``.

        Args:
            op: a ``ReduceOp``, or its name in any case ("sum", "AVG", ...).

        Raises:
            ValueError: ``op`` names no reduction.
            TypeError: ``op`` is neither a ``ReduceOp`` nor a str.
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            with contextlib.suppress(ValueError):
                return cls(op.lower())
            names = ", ".join(member.value for member in cls)
            raise ValueError(f"unknown reduce op {op!r}: expected one of {names}")
        raise TypeError(f"op must be a ReduceOp or its name, not {type(op).__name__}")


BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})

# The dtypes every backend moves and reduces (CPU); others move but may not reduce.
REDUCIBLE_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_reduce(dtype: torch.dtype, op: ReduceOp, what: str) -> None:
    """Raise ``TypeError`` if ``op`` is meaningless on ``dtype`` (one rule for all backends)."""
    if dtype not in REDUCIBLE_DTYPES:
        raise TypeError(f"{what}: cannot reduce tensors of dtype {dtype}")
    if op in BITWISE and dtype.is_floating_point:
        raise TypeError(f"{what}: {op.value} needs an integer or bool dtype, not {dtype}")
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(f"{what}: avg needs a floating-point dtype, not {dtype}")
