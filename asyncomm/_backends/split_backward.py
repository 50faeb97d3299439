"""torch's split of a stage's backward into its input's and its weights' gradients.

torch keeps it in ``torch.distributed.pipelining`` (private ``_backward``: ``stage_backward_input``
and ``stage_backward_weight``), so it is reached from here, where the engines are imported; the
pipeline executor uses it for zero-bubble schedules (see ``pipeline._passes``' note on splitting).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def torch_split() -> tuple[Any, Any] | None:
    """Return torch's (``stage_backward_input``, ``stage_backward_weight``), or ``None``.

    Imported at the first call: ``torch.distributed.pipelining`` brings sympy and
    more, which a process that only imports ``asyncomm.pipeline`` should not pay for.
    """
    try:
        from torch.distributed.pipelining import _backward as split
    except ImportError:  # pragma: no cover - a torch without it
        return None
    found = (getattr(split, "stage_backward_input", None),
             getattr(split, "stage_backward_weight", None))
    return None if None in found else found
