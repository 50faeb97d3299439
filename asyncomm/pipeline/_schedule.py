"""Pipeline schedules as data: actions per rank, the builders, and the compact text form.

A schedule is one list of actions per rank, in the order the rank runs them. Stage ``s``
lives on rank ``s % n_ranks`` (the looping placement of interleaved 1F1B; with one stage per
rank it is simply rank ``s``) unless the schedule carries a placement of its own (ZB-V's V:
rank ``r`` hosts stages ``r`` and ``2 * n_ranks - 1 - r``). Every stage boundary is a send on
one side and a receive on the other (a hand-over, when both stages are on one rank), keyed by
direction, stage and microbatch:

- ``SEND_F`` of stage ``s`` pairs with ``RECV_F`` of stage ``s + 1`` (activations);
- ``SEND_B`` of stage ``s`` pairs with ``RECV_B`` of stage ``s - 1`` (input gradients).

A schedule with ``W`` actions splits every backward in two: ``B`` computes the gradient of
the stage's input (which the previous stage waits for), ``W`` that of its weights (which
nobody waits for, so it can fill a bubble), from what ``B`` kept.

The builders only decide the order of the forwards and backwards on each rank;
:func:`from_compute` then places the receives just before the compute that needs them and
the sends just after the compute that produced them, so that every builder (and every
hand-written compute order) gets the same communication rules.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Op(enum.Enum):
    """What an action does."""

    F = "F"  # forward of `microbatch` on `stage`
    B = "B"  # backward of `microbatch` on `stage` (only its input's gradient if there are Ws)
    W = "W"  # the weights' gradient of that backward, later (schedules that split it)
    SEND_F = "SEND_F"  # send stage's output activation of microbatch to stage + 1
    RECV_F = "RECV_F"  # receive stage's input activation of microbatch from stage - 1
    SEND_B = "SEND_B"  # send the gradient wrt stage's input of microbatch to stage - 1
    RECV_B = "RECV_B"  # receive the gradient wrt stage's output of microbatch from stage + 1

    @property
    def is_compute(self) -> bool:
        """Whether this is a forward or a backward (as opposed to a send or a receive)."""
        return self in (Op.F, Op.B, Op.W)


_ACTION = re.compile(r"(SEND_F|SEND_B|RECV_F|RECV_B|F|B|W)(\d+)@s(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: ``op`` for ``microbatch`` on (global, virtual) ``stage``.

    Args:
        op: what the step does.
        stage: the stage's global index, an int >= 0.
        microbatch: the microbatch's index, an int >= 0.

    Raises:
        TypeError, ValueError: ``op`` is not an ``Op``, or a number is not an int >= 0.
    """

    op: Op
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            raise TypeError(f"Action.op must be an Op, got {self.op!r}")
        _check_counts(0, **{"Action.stage": self.stage, "Action.microbatch": self.microbatch})

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}@s{self.stage}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form written by ``str(action)``, e.g. ``"RECV_B2@s0"``.

        Args:
            text: one action's text; spaces around it are ignored.

        Returns:
            The action it names.

        Raises:
            ValueError: ``text`` is not of the form ``<OP><microbatch>@s<stage>``.
        """
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected <OP><microbatch>@s<stage> "
                             f"with OP one of {', '.join(op.value for op in Op)}, e.g. 'F3@s1' "
                             "or 'RECV_B2@s0'")
        op, microbatch, stage = match.groups()
        return cls(Op(op), int(stage), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """The action list of every rank of a pipeline, in execution order.

    Constructing a schedule checks only its shape; :func:`asyncomm.pipeline.validate` checks
    that it is complete, consistent and free of deadlocks. The arguments are kept as
    attributes of the same names (``actions`` and ``placement`` as tuples).

    Args:
        name: the schedule's name, shown in errors and charts.
        n_ranks: pipeline ranks, an int >= 1.
        n_stages: total (virtual) stages, ``n_ranks * stages_per_rank``.
        n_microbatches: microbatches per step, an int >= 1.
        actions: per rank, its ``Action`` list in execution order.
        placement: the rank of each stage (``placement[s]`` hosts stage ``s``), the same
            number of stages on every rank; default: stage ``s`` on rank ``s % n_ranks``.

    Raises:
        TypeError: a count is not an int, or an action list holds something not an ``Action``.
        ValueError: a count is below 1, ``n_stages`` is not a multiple of ``n_ranks``, there
            is not one action list per rank, or ``placement`` does not fit as said above.
    """

    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[int, ...] | None = None  # stage -> rank; None: s % n_ranks

    def __post_init__(self) -> None:
        _check_counts(n_ranks=self.n_ranks, n_stages=self.n_stages,
                      n_microbatches=self.n_microbatches)
        if self.n_stages % self.n_ranks:
            raise ValueError(f"schedule {self.name!r}: n_stages ({self.n_stages}) must be a "
                             f"multiple of n_ranks ({self.n_ranks})")
        # Accept lists too, and store tuples so that the schedule is hashable and frozen.
        actions = tuple(tuple(rank_actions) for rank_actions in self.actions)
        if len(actions) != self.n_ranks:
            raise ValueError(f"schedule {self.name!r}: {len(actions)} action lists for "
                             f"{self.n_ranks} ranks")
        for rank, rank_actions in enumerate(actions):
            for index, action in enumerate(rank_actions):
                if not isinstance(action, Action):
                    raise TypeError(f"schedule {self.name!r}: rank {rank} index {index}: "
                                    f"expected an Action, got {action!r}")
        object.__setattr__(self, "actions", actions)
        if self.placement is not None:
            placement = tuple(self.placement)
            if len(placement) != self.n_stages or any(
                    isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.n_ranks
                    for r in placement):
                raise ValueError(f"schedule {self.name!r}: placement {placement!r} must give "
                                 f"each of the {self.n_stages} stages a rank in "
                                 f"0..{self.n_ranks - 1}")
            if any(placement.count(r) != self.stages_per_rank for r in range(self.n_ranks)):
                raise ValueError(f"schedule {self.name!r}: placement {placement!r} must put "
                                 f"{self.stages_per_rank} stages on every rank")
            object.__setattr__(self, "placement", placement)

    @property
    def stages_per_rank(self) -> int:
        """How many (virtual) stages each rank hosts."""
        return self.n_stages // self.n_ranks

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into B (input gradient) and W (weight gradient)."""
        return any(a.op is Op.W for rank_actions in self.actions for a in rank_actions)

    def rank_of(self, stage: int) -> int:
        """Return the rank that hosts ``stage``.

        Args:
            stage: a stage index.

        Raises:
            ValueError: ``stage`` is not in ``0..n_stages - 1``.
        """
        if not 0 <= stage < self.n_stages:
            raise ValueError(f"stage {stage} out of range 0..{self.n_stages - 1}")
        return stage % self.n_ranks if self.placement is None else self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Return the stages ``rank`` hosts, in increasing order.

        Args:
            rank: a rank of the pipeline.

        Raises:
            ValueError: ``rank`` is not in ``0..n_ranks - 1``.
        """
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} out of range 0..{self.n_ranks - 1}")
        if self.placement is None:
            return tuple(range(rank, self.n_stages, self.n_ranks))
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def format(self) -> str:
        """Return the compact text form: one line per rank, actions separated by spaces."""
        return "\n".join(" ".join(map(str, rank_actions)) for rank_actions in self.actions)


def _check_counts(least: int = 1, **counts: object) -> None:
    for what, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{what} must be an int, got {value!r}")
        if value < least:
            raise ValueError(f"{what} must be >= {least}, got {value}")


def _as_action(item: Action | str) -> Action:
    if isinstance(item, Action):
        return item
    if isinstance(item, str):
        return Action.parse(item)
    raise TypeError(f"expected an Action or its text form, got {item!r}")


def parse(text: str, *, name: str = "custom", n_stages: int | None = None,
          n_microbatches: int | None = None, placement: Sequence[int] | None = None) -> Schedule:
    """Parse a schedule from its compact text form, one line per rank.

    Each non-empty line lists a rank's actions in order, separated by spaces, e.g.
    ``"F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0"``; ``#`` starts a comment. The result is
    :meth:`Schedule.format`'s inverse.

    Args:
        text: the schedule, rank 0's line first.
        name: the schedule's name.
        n_stages: total stages; default: one past the highest stage named, rounded up to
            a multiple of the number of ranks.
        n_microbatches: default: one past the highest microbatch named.
        placement: the rank of each stage (default: stage ``s`` on rank ``s % n_ranks``).

    Returns:
        The schedule (not validated: see :func:`asyncomm.pipeline.validate`).

    Raises:
        ValueError: a line holds something that is not an action, or no line holds any.
    """
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    ranks = [line for line in lines if line]
    if not ranks:
        raise ValueError("cannot parse a schedule from text with no actions")
    actions: list[tuple[Action, ...]] = []
    for rank, line in enumerate(ranks):
        try:
            actions.append(tuple(Action.parse(word) for word in line.split()))
        except ValueError as error:
            raise ValueError(f"rank {rank} (line {rank + 1}): {error}") from None
    return _assemble(name, actions, n_stages, n_microbatches, placement)


def from_compute(compute: Sequence[Iterable[Action | str]], *, name: str = "custom",
                 n_stages: int | None = None, n_microbatches: int | None = None,
                 placement: Sequence[int] | None = None) -> Schedule:
    """Build a schedule from the order of forwards and backwards on each rank.

    This is the easy way to write a schedule by hand: give each rank's F and B (and W)
    actions in the order it should run them; every receive is placed just before the
    forward or backward that needs it and every send just after the one that produced it
    (a W neither sends nor receives).

    Args:
        compute: per rank, its F/B actions (``Action`` or text such as ``"F3@s1"``).
        name: the schedule's name.
        n_stages: total stages; default as in :func:`parse`.
        n_microbatches: default: one past the highest microbatch named.
        placement: the rank of each stage (default: stage ``s`` on rank ``s % n_ranks``).

    Returns:
        The schedule (not validated: see :func:`asyncomm.pipeline.validate`).

    Raises:
        ValueError: a rank's list holds a send or a receive, or text that is no action.
    """
    compute_actions = [tuple(_as_action(item) for item in rank_items) for rank_items in compute]
    if not compute_actions:
        raise ValueError("from_compute needs at least one rank")
    for rank, rank_items in enumerate(compute_actions):
        for index, action in enumerate(rank_items):
            if not action.op.is_compute:
                raise ValueError(f"from_compute: rank {rank} index {index}: {action} is not a "
                                 "forward or backward (sends and receives are placed "
                                 "automatically)")
    stages = n_stages if n_stages is not None else _default_stages(compute_actions)
    actions = [_with_communication(rank_items, stages) for rank_items in compute_actions]
    return _assemble(name, actions, stages, n_microbatches, placement)


def _default_stages(actions: Sequence[Sequence[Action]]) -> int:
    n_ranks = len(actions)
    highest = max((a.stage for rank_actions in actions for a in rank_actions), default=0)
    return -(-(highest + 1) // n_ranks) * n_ranks


def _assemble(name: str, actions: Sequence[Sequence[Action]], n_stages: int | None,
              n_microbatches: int | None, placement: Sequence[int] | None = None) -> Schedule:
    if n_stages is None:
        n_stages = _default_stages(actions)
    if n_microbatches is None:
        n_microbatches = 1 + max((a.microbatch for rank_actions in actions for a in rank_actions),
                                 default=0)
    return Schedule(name, len(actions), n_stages, n_microbatches, tuple(tuple(a) for a in actions),
                    None if placement is None else tuple(placement))


def _with_communication(compute: Iterable[Action], n_stages: int) -> tuple[Action, ...]:
    """Wrap each forward and backward in the receive before it and the send after it."""
    last = n_stages - 1
    out: list[Action] = []
    for action in compute:
        stage, microbatch = action.stage, action.microbatch
        if action.op is Op.F:
            if stage > 0:
                out.append(Action(Op.RECV_F, stage, microbatch))
            out.append(action)
            if stage < last:
                out.append(Action(Op.SEND_F, stage, microbatch))
        elif action.op is Op.W:  # nobody waits for a weight gradient
            out.append(action)
        else:
            # The last stage's backward starts from the loss, not from a received gradient.
            if stage < last:
                out.append(Action(Op.RECV_B, stage, microbatch))
            out.append(action)
            if stage > 0:
                out.append(Action(Op.SEND_B, stage, microbatch))
    return tuple(out)


def gpipe(n_ranks: int, n_microbatches: int) -> Schedule:
    """Build GPipe: every rank runs all its forwards, then all its backwards.

    Each rank holds the activations of all ``n_microbatches`` at the peak.

    Args:
        n_ranks: pipeline ranks, one stage each.
        n_microbatches: microbatches per step.

    Returns:
        The schedule.

    Raises:
        TypeError, ValueError: a count is not an int >= 1.
    """
    _check_counts(n_ranks=n_ranks, n_microbatches=n_microbatches)
    microbatches = range(n_microbatches)
    compute = [[Action(Op.F, rank, m) for m in microbatches]
               + [Action(Op.B, rank, m) for m in microbatches] for rank in range(n_ranks)]
    return from_compute(compute, name="gpipe", n_stages=n_ranks, n_microbatches=n_microbatches)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> Schedule:
    """Build 1F1B: warm-up forwards, then one forward one backward, then the backwards left.

    Rank ``r`` runs ``min(n_ranks - r - 1, n_microbatches)`` warm-up forwards, so it holds
    at most ``min(n_microbatches, n_ranks - r)`` activations instead of GPipe's all.

    Args:
        n_ranks: pipeline ranks, one stage each.
        n_microbatches: microbatches per step.

    Returns:
        The schedule.

    Raises:
        TypeError, ValueError: a count is not an int >= 1.
    """
    _check_counts(n_ranks=n_ranks, n_microbatches=n_microbatches)
    compute = []
    for rank in range(n_ranks):
        warmup = min(n_ranks - rank - 1, n_microbatches)
        forwards = [Action(Op.F, rank, m) for m in range(n_microbatches)]
        backwards = [Action(Op.B, rank, m) for m in range(n_microbatches)]
        compute.append(_one_f_one_b_order(forwards, backwards, warmup))
    return from_compute(compute, name="1f1b", n_stages=n_ranks, n_microbatches=n_microbatches)


def interleaved_1f1b(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Build interleaved 1F1B: 1F1B over ``stages_per_rank`` virtual stages per rank.

    Rank ``r`` hosts stages ``r, r + n_ranks, r + 2 * n_ranks, ...`` (looping placement).
    Microbatches go through a rank's stages in groups of ``n_ranks``: forwards of
    microbatches 0..p-1 on its first stage, then the same microbatches on its second stage,
    and so on; backwards in the same groups from the last stage back. As in Megatron-LM,
    rank ``r`` first runs ``(n_ranks - r - 1) * 2 + (stages_per_rank - 1) * n_ranks``
    warm-up forwards (all of them when ``n_microbatches == n_ranks``), then alternates.
    Those extra warm-up forwards (about twice 1F1B's) cost activation memory but hide
    message latency: with ``stages_per_rank=1`` this is 1F1B with the longer warm-up, whose
    bubble stays near the no-latency theory when messages take time (``simulate`` with a
    ``comm_cost`` shows it) where plain 1F1B's grows.

    Args:
        n_ranks: pipeline ranks.
        n_microbatches: microbatches per step, a multiple of ``n_ranks``.
        stages_per_rank: virtual stages per rank.

    Returns:
        The schedule.

    Raises:
        ValueError: ``n_microbatches`` is not a multiple of ``n_ranks`` (the grouping above
            needs whole groups), or a count is below 1.
        TypeError: a count is not an int.
    """
    _check_counts(n_ranks=n_ranks, n_microbatches=n_microbatches,
                  stages_per_rank=stages_per_rank)
    if n_microbatches % n_ranks:
        raise ValueError(f"interleaved 1F1B needs n_microbatches ({n_microbatches}) to be a "
                         f"multiple of n_ranks ({n_ranks})")
    p, v = n_ranks, stages_per_rank
    total = n_microbatches * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        position = (k // p) % v
        return position if forward else v - 1 - position

    compute = []
    for rank in range(n_ranks):
        warmup = (total if n_microbatches == n_ranks
                  else min((p - rank - 1) * 2 + (v - 1) * p, total))
        forwards = [Action(Op.F, chunk(k, True) * p + rank, microbatch(k)) for k in range(total)]
        backwards = [Action(Op.B, chunk(k, False) * p + rank, microbatch(k)) for k in range(total)]
        compute.append(_one_f_one_b_order(forwards, backwards, warmup))
    return from_compute(compute, name="interleaved", n_stages=p * v, n_microbatches=n_microbatches)


def _one_f_one_b_order(forwards: Sequence[Action], backwards: Sequence[Action], warmup: int,
                       weights: Sequence[Action] = (), delay: int = 0) -> list[Action]:
    """Interleave: ``warmup`` forwards, then one forward one backward, then the backwards left;
    with ``weights``, each W (oldest first) where :func:`~asyncomm.pipeline.zbh1` puts it."""
    total = len(forwards)
    order, pending = list(forwards[:warmup]), deque(weights)
    for k, backward in enumerate(backwards):
        if warmup + k < total:
            order.append(forwards[warmup + k])
        order.append(backward)
        if pending and (k >= delay or warmup + k >= total):
            order.append(pending.popleft())
    return order + list(pending)
