"""What a stage computes: the model cut into stages, and the passes of one (stage, microbatch).

A forward keeps what its backward needs in a ``Slot``. A whole backward (schedules
without W) accumulates the weights' gradients and returns the input's. Split in two
(schedules with W): ``input_gradient`` (B) computes only the input's gradient,
``weight_gradient`` (W) later the weights'. B + W leave exactly the gradients of one
whole backward.

Note on splitting
-----------------
A naive W would backpropagate from the stage's output again, repeating B's work. torch's
pipelining splits better (``stage_backward_input``/``stage_backward_weight``, private in
``torch.distributed.pipelining._backward``): B keeps the gradients at the nodes the weights
hang from, and W starts from those. It is used where it exists, the stage has an input to
differentiate, and no gradient hooks must fire (it sets ``.grad`` itself, unseen by
``GradSync``'s hooks). Elsewhere, and on stage 0 (its input is data: its B has nothing to
compute), W runs the backward to the weights (``torch.autograd.backward(...,
inputs=weights)``) from the graph B kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncomm._backends.split_backward import torch_split


@dataclass(frozen=True)
class StepStats:
    """Times of one step on this rank.

    ``bubble`` is ``1 - busy_s / wall_s``, the fraction of the step this rank waited.

    Attributes:
        wall_s: seconds of the step, from its start to its last send's completion.
        busy_s: seconds spent in this rank's forward and backward computes.
        forward_s: of those, the forwards'.
        backward_s: of those, the backwards' (Ws included).
        start, end: ``time.perf_counter()`` at the step's start and end: on one host they
            are comparable between ranks, so ``1 - sum(busy_s) / (n_ranks * (max(end) -
            min(start)))`` is the simulator's bubble, idle tails included.
    """

    wall_s: float
    busy_s: float
    forward_s: float
    backward_s: float
    start: float = 0.0
    end: float = 0.0

    @property
    def bubble(self) -> float:
        """Return the fraction of the step this rank spent not computing."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def split(model: nn.Sequential, n_stages: int,
          sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into ``n_stages`` consecutive ``nn.Sequential`` stages.

    Args:
        model: the layers, in order; the stages share its modules (no copy).
        n_stages: how many stages.
        sizes: layers per stage (sum ``len(model)``); default: as even as
            possible, earlier stages taking the extra layers.

    Returns:
        All ``n_stages`` stages; give them all to ``Pipeline``, which keeps
        the ones this rank hosts.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``.
        ValueError: fewer layers than stages, or ``sizes`` that do not fit.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split: model must be an nn.Sequential, not {type(model).__name__}")
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"split: n_stages must be an int >= 1, not {n_stages!r}")
    layers = list(model)
    if sizes is None:
        if len(layers) < n_stages:
            raise ValueError(f"split: {len(layers)} layers cannot make {n_stages} stages")
        base, extra = divmod(len(layers), n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    sizes = list(sizes)
    if (len(sizes) != n_stages or any(isinstance(k, bool) or not isinstance(k, int) or k < 1
                                      for k in sizes) or sum(sizes) != len(layers)):
        raise ValueError(f"split: sizes={sizes} must be {n_stages} ints >= 1 summing to "
                         f"{len(layers)} (the model's layers)")
    stages, at = [], 0
    for k in sizes:
        stages.append(nn.Sequential(*layers[at:at + k]))
        at += k
    return stages


@dataclass
class Slot:
    """What one (stage, microbatch) keeps from its F until its B."""

    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None  # in the autograd graph, until the B
    loss: torch.Tensor | None = None
    to_send: torch.Tensor | None = None  # the output, detached, until its SEND_F
    grad_input: torch.Tensor | None = None  # from the B until its SEND_B
    grad_output: torch.Tensor | None = None  # a split backward's: from its B until its W
    param_groups: list[dict[str, Any]] | None = None  # ... or what torch's split B kept
    backward_done: bool = False
    weights_pending: bool = False  # a split backward's B ran, its W not yet

    def finished(self) -> bool:
        return (self.backward_done and not self.weights_pending and self.to_send is None
                and self.grad_input is None)


def _start(slot: Slot, grad: torch.Tensor | None, n: int
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward's root and its gradient: the scaled loss, or the output and ``grad``."""
    if slot.loss is not None:
        return slot.loss / n, None
    assert slot.output is not None
    return slot.output, grad


def whole_backward(slot: Slot, grad: torch.Tensor | None, n: int,
                   stage: int) -> tuple[torch.Tensor | None, float]:
    """Run the backward of ``slot``: weights' gradients accumulate; return the input's."""
    begin = time.perf_counter()
    root, seed = _start(slot, grad, n)
    torch.autograd.backward(root, seed)
    x = slot.inputs
    if stage == 0 or x is None:
        return None, time.perf_counter() - begin
    grad_input = x.grad if x.requires_grad and x.grad is not None else torch.zeros_like(x)
    return grad_input, time.perf_counter() - begin


def input_gradient(slot: Slot, grad: torch.Tensor | None, n: int, stage: int,
                   weights: list[nn.Parameter], hooked: bool = False
                   ) -> tuple[torch.Tensor | None, float]:
    """B of a split backward: return the input's gradient; keep what W needs.

    ``hooked``: the weights' gradient hooks must fire in W (see the note on splitting).
    """
    begin = time.perf_counter()
    x = slot.inputs
    grad_input = None
    if x is not None and (stage != 0 or x.requires_grad):  # stage 0's, if the user asks
        if x.requires_grad:
            root, seed = _start(slot, grad, n)
            split = None if hooked or not x.is_leaf else torch_split()  # (it reads x.grad)
            if split is not None:
                grads, slot.param_groups = split[0](
                    [root], None if seed is None else [seed], [x], iter(weights))
                grad_input = grads[0]
            else:
                (grad_input,) = torch.autograd.grad(root, (x,), seed, retain_graph=True,
                                                    allow_unused=True)
        if grad_input is None:
            grad_input = torch.zeros_like(x)
    if stage == 0:
        grad_input = None  # no stage before it to send it to
    slot.grad_output = grad  # what a W without torch's split starts from
    return grad_input, time.perf_counter() - begin


def weight_gradient(slot: Slot, n: int, weights: list[nn.Parameter]) -> float:
    """W of a split backward: accumulate the weights' gradients from what B kept; free it."""
    begin = time.perf_counter()
    split = torch_split() if slot.param_groups is not None else None
    if split is not None:
        split[1](iter(weights), slot.param_groups)
    else:
        root, seed = _start(slot, slot.grad_output, n)
        if weights and root.requires_grad:
            torch.autograd.backward(root, seed, inputs=weights)
    return time.perf_counter() - begin
