"""Zero-bubble schedules (Qi et al., ICLR 2024): ZB-H1 by its rule, ZB-V by list scheduling.

Both split every backward into ``B`` (the input's gradient, which the previous stage
waits for) and ``W`` (the weights', which nobody waits for). ZB-H1 follows 1F1B with
each rank's Ws delayed (see :func:`zbh1`). For ZB-V (two stages per rank in a V: see
:func:`v_placement`) a greedy list scheduler places them with unit costs (F = B = W = 1,
free messages): at each time step a free rank runs, by priority, a ready ``B`` (the oldest
microbatch first), else a ready ``F`` if it holds fewer activations than its limit, else
its oldest pending ``W``. An activation is held from its ``F`` until its ``W`` (what ``W``
needs is what ``B`` kept), so the limit (``2 * n_ranks`` stage activations: half-size
stages, 1F1B's peak memory again) bounds memory, and a rank at its limit runs a ``W`` to
make room: ``W``\\ s fill what would have been bubbles.

The orders go through :func:`from_compute`, which places the messages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from asyncomm.pipeline._schedule import (
    Action,
    Op,
    Schedule,
    _check_counts,
    _one_f_one_b_order,
    from_compute,
)


def zbh1(n_ranks: int, n_microbatches: int) -> Schedule:
    """Build ZB-H1: 1F1B's peak memory, backwards split, weight gradients filling bubbles.

    Rank ``r`` runs 1F1B's warm-up forwards, then F and B alternately, each B
    followed by a W from the ``r``-th on (rank ``r`` holds ``r`` more activations
    than in 1F1B -- at most ``n_ranks``, 1F1B's peak on rank 0); then its last Bs,
    each followed by a W, and the Ws left. With F = B = W its makespan is
    ``3 m + (p - 1)`` against 1F1B's ``3 m + 3 (p - 1)``: a third of the bubble.

    Args:
        n_ranks: pipeline ranks, one stage each.
        n_microbatches: microbatches per step.

    Returns:
        The schedule.

    Raises:
        TypeError, ValueError: a count is not an int >= 1.
    """
    _check_counts(n_ranks=n_ranks, n_microbatches=n_microbatches)
    orders = []
    for rank in range(n_ranks):  # 1F1B's order, each W delayed by ``rank`` backwards
        f, b, w = ([Action(op, rank, m) for m in range(n_microbatches)]
                   for op in (Op.F, Op.B, Op.W))
        orders.append(_one_f_one_b_order(f, b, min(n_ranks - rank - 1, n_microbatches), w, rank))
    return from_compute(orders, name="zbh1", n_stages=n_ranks, n_microbatches=n_microbatches)


def v_placement(n_ranks: int) -> tuple[int, ...]:
    """Return ZB-V's placement of ``2 * n_ranks`` stages: rank r hosts r and 2 n_ranks - 1 - r.

    Args:
        n_ranks: pipeline ranks.

    Returns:
        The rank of each stage, as ``Schedule``'s ``placement`` takes it.

    Raises:
        TypeError, ValueError: ``n_ranks`` is not an int >= 1.
    """
    _check_counts(n_ranks=n_ranks)
    return tuple(s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(2 * n_ranks))


def zbv(n_ranks: int, n_microbatches: int) -> Schedule:
    """Build ZB-V: two stages per rank in a V, backwards split; nearly no bubble.

    Args:
        n_ranks: pipeline ranks, two stages each (placed by :func:`v_placement`).
        n_microbatches: microbatches per step.

    Returns:
        The schedule.

    Raises:
        TypeError, ValueError: a count is not an int >= 1.
    """
    _check_counts(n_ranks=n_ranks, n_microbatches=n_microbatches)
    placement = v_placement(n_ranks)
    orders = _greedy(n_ranks, n_microbatches, placement, 2 * n_ranks)
    return from_compute(orders, name="zbv", n_stages=2 * n_ranks,
                        n_microbatches=n_microbatches, placement=placement)


def _greedy(n_ranks: int, n_microbatches: int, placement: Sequence[int],
            limit: int) -> list[list[Action]]:
    """Return each rank's F/B/W order, list-scheduled with unit costs (see the module note)."""
    n_stages, last = len(placement), len(placement) - 1
    hosted = [[s for s in range(n_stages) if placement[s] == r] for r in range(n_ranks)]
    f_end: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> when its F ended
    b_end: dict[tuple[int, int], int] = {}
    next_f, next_b = [0] * n_stages, [0] * n_stages  # each stage's microbatches in order
    waiting_w: list[deque[tuple[int, int]]] = [deque() for _ in range(n_ranks)]
    held = [0] * n_ranks
    orders: list[list[Action]] = [[] for _ in range(n_ranks)]
    left = 3 * n_stages * n_microbatches
    time = 0

    def pick(rank: int) -> Action | None:
        """The action ``rank`` starts at ``time``: a ready B, else a ready F, else a W."""
        never = time + 1
        ready_b = [(next_b[s], -s) for s in hosted[rank]
                   if next_b[s] < n_microbatches
                   and f_end.get((s, next_b[s]), never) <= time
                   and (s == last or b_end.get((s + 1, next_b[s]), never) <= time)]
        if ready_b:
            mb, stage = min(ready_b)
            return Action(Op.B, -stage, mb)
        if held[rank] < limit:
            ready_f = [(next_f[s], -s) for s in hosted[rank]
                       if next_f[s] < n_microbatches
                       and (s == 0 or f_end.get((s - 1, next_f[s]), never) <= time)]
            if ready_f:
                mb, stage = min(ready_f)
                return Action(Op.F, -stage, mb)
        if waiting_w[rank]:
            stage, mb = waiting_w[rank].popleft()
            return Action(Op.W, stage, mb)
        return None

    while left:
        for rank in range(n_ranks):
            action = pick(rank)
            if action is None:
                continue
            stage, mb = action.stage, action.microbatch
            if action.op is Op.F:
                f_end[stage, mb] = time + 1
                next_f[stage] += 1
                held[rank] += 1
            elif action.op is Op.B:
                b_end[stage, mb] = time + 1
                next_b[stage] += 1
                waiting_w[rank].append((stage, mb))
            else:
                held[rank] -= 1
            orders[rank].append(action)
            left -= 1
        time += 1
        if time > 6 * n_stages * n_microbatches + 4 * n_stages:  # cannot happen: a bug
            raise RuntimeError("zero-bubble list scheduling made no progress")
    return orders
