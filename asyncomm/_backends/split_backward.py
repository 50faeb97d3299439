"""torch's split of a stage's backward into its input's and its weights' gradients.

torch keeps it in ``torch.distributed.pipelining`` (private ``_backward``:
``stage_backward_input`` and ``stage_backward_weight``), so it is reached from
here, where the engines are imported; the pipeline executor uses it for zero-bubble
schedules (see ``pipeline._passes``' note on splitting). ``None`` where a torch lacks it.
"""

from __future__ import annotations

from typing import Any

split_input: Any = None
split_weight: Any = None
try:
    from torch.distributed.pipelining import _backward as _torch_split

    split_input = _torch_split.stage_backward_input
    split_weight = _torch_split.stage_backward_weight
except (ImportError, AttributeError):  # pragma: no cover - a torch without them
    pass
