"""The schedules by name: ``get("zbh1", n_ranks, n_microbatches)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncomm.pipeline._schedule import Schedule, gpipe, interleaved_1f1b, one_f_one_b
from asyncomm.pipeline._zero_bubble import zbh1, zbv

_BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zbh1": zbh1,
    "zbv": zbv,
}

SCHEDULES: tuple[str, ...] = tuple(_BUILDERS)
"""The names :func:`get` knows."""


def get(name: str, n_ranks: int, n_microbatches: int, **kw: Any) -> Schedule:
    """Build the schedule called ``name`` for ``n_ranks`` ranks and ``n_microbatches``.

    Args:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zbh1"`` or ``"zbv"`` (any case).
        n_ranks: the pipeline's ranks.
        n_microbatches: microbatches per step.
        kw: for the builder (``stages_per_rank`` for ``"interleaved"``).

    Returns:
        The schedule the builder makes.

    Raises:
        ValueError: unknown name, or the builder rejects its arguments.
        TypeError: ``name`` is not a str, or a keyword the builder does not take.
    """
    if not isinstance(name, str):
        raise TypeError(f"schedule name must be a str, got {name!r}")
    builder = _BUILDERS.get(name.lower())
    if builder is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return builder(n_ranks, n_microbatches, **kw)
