"""Check a schedule before anything runs, and compute its theory: bubble, peak activations.

:func:`validate` rejects a broken schedule with a :class:`ScheduleError` that names the
rank, the index in its list and the action. :func:`simulate` also times it: every rank runs
its list in order; a forward costs ``f_cost``, a backward ``b_cost + w_cost`` -- or, in a
schedule that splits backwards, a ``B`` ``b_cost`` and a ``W`` ``w_cost``; a send never
blocks and its message arrives ``comm_cost`` later (at once between two stages of one
rank); a receive blocks its rank until the message is there.

Note on receives: the executor posts receives early and only the forward or backward that
needs a message waits for it, which never waits longer than a receive that blocks where it
stands. So a schedule this simulator finds free of deadlocks cannot deadlock when executed,
and its timings match the executor's whenever each receive sits just before the compute
that needs it (as in every built-in schedule).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from fractions import Fraction

from asyncomm.pipeline._schedule import Action, Op, Schedule

_MAX_ROWS = 1000  # rows of the default grid before its step coarsens

# a message's other end, and its stage less this end's (SEND_F of s feeds RECV_F of s + 1)
_PEER = {Op.SEND_F: (Op.RECV_F, 1), Op.RECV_F: (Op.SEND_F, -1), Op.SEND_B: (Op.RECV_B, -1),
         Op.RECV_B: (Op.SEND_B, 1)}


class ScheduleError(ValueError):
    """A schedule is broken: incomplete, inconsistent, or it would deadlock.

    Attributes:
        rank: the rank whose list holds the offending action (None if no single rank).
        index: the action's index in that rank's list (None for a missing action).
        action: the offending (or missing) action.
    """

    def __init__(self, message: str, rank: int | None = None, index: int | None = None,
                 action: Action | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action


def _matching(action: Action) -> Action:
    """Return the send that feeds receive ``action``, or the receive that takes send ``action``."""
    op, step = _PEER[action.op]
    return Action(op, action.stage + step, action.microbatch)


def _fail(schedule: Schedule, rank: int, index: int, what: str) -> ScheduleError:
    action = schedule.actions[rank][index]
    return ScheduleError(f"{schedule.name}: rank {rank} index {index} ({action}): {what}",
                         rank, index, action)


def _check_actions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """Check each action on its own and against duplicates; return where each action is."""
    last = schedule.n_stages - 1
    position: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            stage = action.stage
            if stage > last:
                raise _fail(schedule, rank, index, f"stage {stage} out of range 0..{last}")
            if action.microbatch >= schedule.n_microbatches:
                raise _fail(schedule, rank, index, f"microbatch {action.microbatch} out of "
                            f"range 0..{schedule.n_microbatches - 1}")
            home = schedule.rank_of(stage)
            if home != rank:
                raise _fail(schedule, rank, index,
                            f"stage {stage} lives on rank {home}, not {rank}")
            if action.op in (Op.RECV_F, Op.SEND_B) and stage == 0:
                raise _fail(schedule, rank, index, "stage 0 has no previous stage")
            if action.op in (Op.SEND_F, Op.RECV_B) and stage == last:
                raise _fail(schedule, rank, index,
                            "the last stage has no next stage (its backward starts from the loss)")
            if action in position:
                raise _fail(schedule, rank, index, f"duplicate of index {position[action][1]}")
            position[action] = (rank, index)
    return position


def _check_pairs(schedule: Schedule, position: dict[Action, tuple[int, int]]) -> None:
    """Check that every receive has its send and every send its receive."""
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            if action.op.is_compute:
                continue
            peer = _matching(action)
            if peer not in position:
                kind = ("receive with no matching send" if action.op in (Op.RECV_F, Op.RECV_B)
                        else "send with no matching receive")
                raise _fail(schedule, rank, index,
                            f"{kind}: no {peer} on rank {schedule.rank_of(peer.stage)}")


def _check_complete(schedule: Schedule, position: dict[Action, tuple[int, int]]) -> None:
    """Check one F and one B per hosted stage and microbatch, with their messages in order;
    and, in a schedule that splits backwards, one W after each B."""
    last = schedule.n_stages - 1
    split = schedule.splits_backward
    for rank in range(schedule.n_ranks):
        for stage in schedule.stages_of(rank):
            for microbatch in range(schedule.n_microbatches):
                forward = Action(Op.F, stage, microbatch)
                backward = Action(Op.B, stage, microbatch)
                for needed in (forward, backward):
                    if needed not in position:
                        raise ScheduleError(
                            f"{schedule.name}: rank {rank} has no {needed} (every stage "
                            "needs one forward and one backward of every microbatch)",
                            rank, None, needed)
                f_index, b_index = position[forward][1], position[backward][1]
                if b_index < f_index:
                    raise _fail(schedule, rank, b_index,
                                f"backward before its forward (index {f_index})")
                if split:
                    weights = Action(Op.W, stage, microbatch)
                    if weights not in position:
                        raise ScheduleError(
                            f"{schedule.name}: rank {rank} has no {weights} (a schedule with W "
                            "actions needs one W after every B)", rank, None, weights)
                    w_index = position[weights][1]
                    if w_index < b_index:
                        raise _fail(schedule, rank, w_index,
                                    f"weight gradient before its B (index {b_index})")
                _check_order(schedule, rank, position, Op.RECV_F, forward, stage > 0, True)
                _check_order(schedule, rank, position, Op.SEND_F, forward, stage < last, False)
                _check_order(schedule, rank, position, Op.RECV_B, backward, stage < last, True)
                _check_order(schedule, rank, position, Op.SEND_B, backward, stage > 0, False)


def _check_order(schedule: Schedule, rank: int, position: dict[Action, tuple[int, int]], op: Op,
                 compute: Action, needed: bool, before: bool) -> None:
    """Check that ``compute`` has its message ``op`` on its side (``before`` or after it)."""
    if not needed:
        return
    message = Action(op, compute.stage, compute.microbatch)
    index = position[compute][1]
    if message not in position:
        where = "before" if before else "after"
        raise _fail(schedule, rank, index, f"no {message} {where} it")
    message_index = position[message][1]
    if before and message_index > index:
        raise _fail(schedule, rank, index,
                    f"needs {message}, which comes later (index {message_index})")
    if not before and message_index < index:
        raise _fail(schedule, rank, message_index,
                    f"sends before {compute} (index {index}) has produced it")


@dataclass(frozen=True)
class Interval:
    """When one action ran in the simulation: from ``start`` to ``end``.

    Attributes:
        start: when the action began (simulated time).
        end: when it ended (a send ends as it begins: sends never block).
        action: the action.
    """

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    """The timed run of a schedule.

    Attributes:
        schedule: what ran.
        f_cost, b_cost, comm_cost, w_cost: the costs it ran with (:func:`simulate`'s).
        timelines: per rank, every action of its list with its start and end.
        makespan: when the last action ended.
        bubble: fraction of rank time spent idle: ``1 - compute / (n_ranks * makespan)``.
        peak_activations: per rank, the most (stage, microbatch) pairs whose forward had
            run and backward had not (its W, where backwards are split: what B keeps for
            W is held too), i.e. activations held at once.
    """

    schedule: Schedule
    f_cost: float
    b_cost: float
    comm_cost: float
    timelines: tuple[tuple[Interval, ...], ...]
    makespan: float
    bubble: float
    peak_activations: tuple[int, ...]
    w_cost: float = 1.0

    def step_size(self) -> float:
        """Return the grid's default step: the largest time all costs are multiples of.

        Where that step would need more than 1000 rows (costs such as 1 and 1.001), it is
        the smaller of the forward and backward costs instead, and each row then shows
        what runs at its middle.
        """
        costs = [Fraction(c).limit_denominator(1000)
                 for c in (self.f_cost, self.b_cost, self.comm_cost, self.w_cost)]
        common = math.lcm(*(cost.denominator for cost in costs))
        step = Fraction(math.gcd(*(int(cost * common) for cost in costs)), common)
        if step > 0 and self.makespan / float(step) <= _MAX_ROWS:
            return float(step)
        return min(c for c in (self.f_cost, self.b_cost, self.w_cost) if c > 0)

    def grid(self, step: float | None = None) -> list[list[str]]:
        """Return the step x rank table: row k is time ``[k * step, (k + 1) * step)``.

        Each cell names the forward or backward running on that rank at the middle of the
        step (``"F3"``, ``"B3"``, ``"W3"``; ``"F3@s5"`` when ranks host several stages), or
        is empty when the rank is idle or communicating. A backward longer than a step
        fills several rows.

        Args:
            step: the time per row; default: :meth:`step_size` (exact for costs such as
                f=1, b=2, comm=0.5).

        Raises:
            ValueError: ``step`` is not > 0.
        """
        step = self.step_size() if step is None else step
        if not step > 0:
            raise ValueError(f"step must be > 0, got {step}")
        with_stage = self.schedule.stages_per_rank > 1
        computes = [[span for span in timeline if span.action.op.is_compute]
                    for timeline in self.timelines]
        starts = [[span.start for span in spans] for spans in computes]
        rows = []
        for row in range(math.ceil(self.makespan / step - 1e-9)):
            middle = (row + 0.5) * step
            cells = []
            for rank_starts, spans in zip(starts, computes, strict=True):
                cell = ""
                at = bisect_right(rank_starts, middle) - 1
                if at >= 0 and spans[at].end > middle:
                    action = spans[at].action
                    cell = str(action) if with_stage else f"{action.op.value}{action.microbatch}"
                cells.append(cell)
            rows.append(cells)
        return rows


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` is complete, consistent and free of deadlocks.

    Args:
        schedule: the schedule to check.

    Raises:
        ScheduleError: the first problem found, naming the rank, the index in its list and
            the action: a stage on the wrong rank, an out-of-range stage or microbatch, a
            duplicate, a receive with no matching send (or the reverse), a missing forward
            or backward, a backward before its forward, a message on the wrong side of its
            compute, or a deadlock (which actions wait on which).
        TypeError: ``schedule`` is not a ``Schedule``.
    """
    _run(schedule, 1.0, 1.0, 0.0, 1.0)


def simulate(schedule: Schedule, f_cost: float = 1.0, b_cost: float = 1.0,
             comm_cost: float = 0.0, w_cost: float = 1.0) -> Simulation:
    """Validate ``schedule`` and time it with the given costs per forward, B, message and W.

    Args:
        schedule: the schedule to check and time.
        f_cost: the time of a forward.
        b_cost: the time of a B; a backward that is not split (a schedule without W
            actions) costs ``b_cost + w_cost``: 2 by default, so that 1F1B and ZB-H1
            compare with F = B = W.
        comm_cost: the time a message takes between ranks (between two stages of one
            rank: none).
        w_cost: the time of a W.

    Returns:
        The timed run: every action's interval, the makespan, bubble and peak activations.

    Raises:
        ScheduleError, TypeError: as :func:`validate`; ``TypeError`` too for a cost that is
            not a number.
        ValueError: a cost is negative or infinite, or the forward and backward costs are all 0.
    """
    for what, cost in (("f_cost", f_cost), ("b_cost", b_cost), ("comm_cost", comm_cost),
                       ("w_cost", w_cost)):
        if not isinstance(cost, (int, float)) or isinstance(cost, bool):
            raise TypeError(f"{what} must be a number, got {cost!r}")
        if not cost >= 0 or math.isinf(cost):
            raise ValueError(f"{what} must be finite and >= 0, got {cost}")
    if f_cost + b_cost + w_cost <= 0:
        raise ValueError("f_cost, b_cost and w_cost cannot all be 0")
    return _run(schedule, float(f_cost), float(b_cost), float(comm_cost), float(w_cost))


def _run(schedule: Schedule, f_cost: float, b_cost: float, comm_cost: float,
         w_cost: float) -> Simulation:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {schedule!r}")
    position = _check_actions(schedule)
    _check_pairs(schedule, position)
    _check_complete(schedule, position)

    n_ranks = schedule.n_ranks
    actions = schedule.actions
    split = schedule.splits_backward
    cost = {Op.F: f_cost, Op.B: b_cost if split else b_cost + w_cost, Op.W: w_cost}
    clock = [0.0] * n_ranks
    cursor = [0] * n_ranks
    arrival: dict[Action, float] = {}  # receive -> when its message is there
    timelines: list[list[Interval]] = [[] for _ in range(n_ranks)]
    # Each action starts when its rank is free and (for a receive) its message has arrived,
    # so the times do not depend on the order in which this loop visits the ranks.
    progress = True
    while progress:
        progress = False
        for rank in range(n_ranks):
            while cursor[rank] < len(actions[rank]):
                action = actions[rank][cursor[rank]]
                start = end = clock[rank]
                if action.op in (Op.RECV_F, Op.RECV_B):
                    if action not in arrival:
                        break
                    end = max(start, arrival[action])
                elif action.op in (Op.SEND_F, Op.SEND_B):
                    peer = _matching(action)
                    local = schedule.rank_of(peer.stage) == rank  # a hand-over: no message
                    arrival[peer] = start + (0.0 if local else comm_cost)
                else:
                    end = start + cost[action.op]
                timelines[rank].append(Interval(start, end, action))
                clock[rank] = end
                cursor[rank] += 1
                progress = True
    blocked = [rank for rank in range(n_ranks) if cursor[rank] < len(actions[rank])]
    if blocked:
        raise _deadlock(schedule, cursor, position, blocked[0])

    makespan = max(clock)
    busy = sum(span.end - span.start for line in timelines for span in line
               if span.action.op.is_compute)
    bubble = 1.0 - busy / (n_ranks * makespan) if makespan > 0 else 0.0
    return Simulation(schedule, f_cost, b_cost, comm_cost, tuple(tuple(line) for line in timelines),
                      makespan, bubble, tuple(_peak(line, Op.W if split else Op.B)
                                              for line in actions), w_cost)


def _peak(actions: tuple[Action, ...], frees: Op) -> int:
    """The most activations held at once: from each F until the action that ``frees`` it."""
    live = peak = 0
    for action in actions:
        if action.op is Op.F:
            live += 1
            peak = max(peak, live)
        elif action.op is frees:
            live -= 1
    return peak


def _deadlock(schedule: Schedule, cursor: list[int], position: dict[Action, tuple[int, int]],
              rank: int) -> ScheduleError:
    """Describe the cycle of ranks waiting on each other that ``rank`` is caught in."""
    chain: list[int] = []
    while rank not in chain:
        chain.append(rank)
        waiting = schedule.actions[rank][cursor[rank]]
        rank = position[_matching(waiting)][0]
    cycle = chain[chain.index(rank) :]
    waits = []
    for waiter in cycle:
        waiting = schedule.actions[waiter][cursor[waiter]]
        send = _matching(waiting)
        sender, send_index = position[send]
        waits.append(f"rank {waiter} index {cursor[waiter]} ({waiting}) waits for {send} "
                     f"(rank {sender} index {send_index})")
    first = cycle[0]
    return ScheduleError(f"{schedule.name}: deadlock: " + "; ".join(waits), first, cursor[first],
                         schedule.actions[first][cursor[first]])
