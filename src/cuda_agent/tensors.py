"""Walking nested outputs: the tensors in lists, tuples and dicts, wherever they sit.

Neutral ground below ``guard`` and ``evaluate``: the runtime guard checks the memory of
these tensors, the output transfer packs them, the degenerate check averages them.
"""

from __future__ import annotations

from typing import Any, Iterable


def tensors_in(value: Any) -> Iterable[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
