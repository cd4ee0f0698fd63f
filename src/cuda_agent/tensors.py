"""Walking nested outputs: the tensors in lists, tuples and dicts, wherever they sit; and reading
GB-sized tensors a piece at a time.

Neutral ground below ``guard`` and ``evaluate``: the runtime guard checks the memory of
these tensors, the output transfer packs them, the degenerate check averages them, the
comparison and the inputs' fingerprint reduce them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

# Elements a reduction or a comparison works on at once. ATen's reductions asked for a wider
# dtype (``torch.sum(x, dtype=torch.float64)``, ``vector_norm(..., dtype=...)``, ``mean(dtype=...)``)
# first copy their whole input to it (``make_reduction``: ``self.to(in_dtype)``), and an elementwise
# comparison makes several temporaries of its inputs' size: for KernelBench's 6-8 GiB inputs and
# outputs that is 12-16 GiB more in each process, more than an 80 GB card has left beside the task.
PIECE = 1 << 24


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


PLAIN_SCALARS = (int, float, bool, complex, str, type(None))
_SLOTS = ("__iter__", "__getitem__", "__len__")  # what looking into a sequence may call
_MRO, _DICT, _NAME = (type.__dict__[name] for name in ("__mro__", "__dict__", "__name__"))  # read past any metaclass


def foreign_object(value: Any) -> str | None:
    """The type's name of the first thing in ``value`` that is not an exact ``torch.Tensor``, a ``list``, ``tuple``
    or ``dict`` (or a tuple type that changes none of how it is looked into: ``torch.return_types``, named tuples),
    or a plain scalar; None where there is none. Only types are asked, so no method of ``value`` runs: a tensor
    subclass (``__torch_function__``) or a container of the candidate's would run its code wherever the harness
    looked into it, and on the timing thread after a region's end that is code no bracket sees."""
    import torch

    kind = type(value)
    if kind is torch.Tensor or kind in PLAIN_SCALARS:
        return None
    if kind is list or kind is dict or _plain_tuple(kind):
        for item in (dict.values(value) if kind is dict else value):
            found = foreign_object(item)
            if found is not None:
                return found
        return None
    return _NAME.__get__(kind)


def _plain_tuple(kind: type) -> bool:
    if type(kind) is not type:  # a metaclass of its own
        return False
    for cls in _MRO.__get__(kind):
        if cls is tuple:
            return True
        if any(slot in _DICT.__get__(cls) for slot in _SLOTS):
            return False
    return False


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (``tensors_in``), each counted by its elements."""
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def pieces(*tensors: Any) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """Aligned views of same-shaped ``tensors``, about ``PIECE`` elements each, covering them once in
    row-major order, each with the flat index of its first element. Contiguous tensors are cut
    anywhere; otherwise along the first dimension (a piece is then at least one index of it)."""
    first = tensors[0]
    total = first.numel()
    if total <= PIECE or first.dim() == 0:
        yield 0, tensors
        return
    if all(t.is_contiguous() for t in tensors):
        flats = [t.view(-1) for t in tensors]
        for start in range(0, total, PIECE):
            yield start, tuple(f[start:start + PIECE] for f in flats)
        return
    row = total // first.shape[0]
    rows = max(1, PIECE // row)
    for start in range(0, first.shape[0], rows):
        yield start * row, tuple(t[start:start + rows] for t in tensors)


def wide_sum(values: Any) -> float:
    """The sum of a real tensor, accumulated in float64 a piece at a time."""
    import torch

    return math.fsum(read_all([torch.sum(piece, dtype=torch.float64) for _, (piece,) in pieces(values)]))


def read_all(scalars: list[Any]) -> list[float]:
    """One-element tensors' values, read from the device at once: one wait for the device, not one a
    value (a GB-sized tensor is a hundred pieces; each wait beside another process's work on the GPU is
    a turn of its time slice)."""
    import torch

    if not scalars:
        return []
    return torch.stack([s.reshape(()).to(torch.float64) for s in scalars]).tolist()


def wide_squares(values: Any, finite_only: bool = False) -> float:
    """The sum of squares of a real tensor in float64, a piece at a time; with
    ``finite_only``, non-finite values count as zero."""
    import torch

    def norm(piece: Any, finite: bool = False) -> Any:
        piece = piece if piece.is_floating_point() else piece.double()
        if finite:
            piece = torch.where(torch.isfinite(piece), piece, 0.0)
        return torch.linalg.vector_norm(piece, 2, dtype=torch.float64)

    norms = read_all([norm(piece) for _, (piece,) in pieces(values)])
    if finite_only and not all(math.isfinite(n) for n in norms):
        norms = [n if math.isfinite(n) else float(norm(piece, finite=True))
                 for n, (_, (piece,)) in zip(norms, pieces(values))]
    total = 0.0
    for value in norms:
        total += value * value
    return total
