"""Pipeline parallelism: schedules as data, a simulator that checks them, and their chart.

A schedule is a list of actions per rank (forward, backward, send, receive of a microbatch
on a stage). Build one (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`,
the zero-bubble :func:`zbh1` and :func:`zbv`, :func:`get`), write your own
(:func:`from_compute`, :func:`parse`, or :class:`Schedule` from action lists), and check
it before anything runs. :class:`Pipeline` runs one on
real ranks (:func:`split` cuts an ``nn.Sequential`` into stages).
"""

from asyncomm.pipeline._catalog import SCHEDULES, get
from asyncomm.pipeline._execute import GradSyncLike, Pipeline
from asyncomm.pipeline._passes import StepStats, split
from asyncomm.pipeline._schedule import (
    Action,
    Op,
    Schedule,
    from_compute,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse,
)
from asyncomm.pipeline._show import plot, render
from asyncomm.pipeline._simulate import Interval, ScheduleError, Simulation, simulate, validate
from asyncomm.pipeline._zero_bubble import v_placement, zbh1, zbv

__all__ = ["Action", "GradSyncLike", "Interval", "Op", "Pipeline", "SCHEDULES", "Schedule",
           "ScheduleError", "Simulation", "StepStats", "from_compute", "get", "gpipe",
           "interleaved_1f1b", "one_f_one_b", "parse", "plot", "render", "simulate", "split",
           "v_placement", "validate", "zbh1", "zbv"]
