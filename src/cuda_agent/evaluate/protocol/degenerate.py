"""Degenerate tasks: tasks that a trivial candidate passes.

If zeros, a constant, an input returned as is, or the mean of an input passes
a task's checks, the task rewards no kernel work at all (known cases: softmax
over a long row, whose outputs sit below atol; norms replaced by a fixed
affine map). The data pipeline drops such tasks and the benchmark runner
flags them. The trivial outputs are built and compared in the reference
process, against expected outputs that never leave it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from cuda_agent.evaluate.protocol.compare import compare_outputs
from cuda_agent.tensors import tensors_in, wide_sum

TRIVIAL_CANDIDATES = ("zeros", "constant", "identity", "input-mean")


@dataclass
class DegenerateReport:
    """Which trivial candidates pass a task under a policy's tolerance."""

    task: str
    policy: str
    passing: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)

    @property
    def degenerate(self) -> bool:
        return bool(self.passing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"degenerate": self.degenerate}

    def summary(self) -> str:
        if not self.passing:
            return f"{self.task}: not degenerate under policy {self.policy} (no trivial candidate passes)"
        return f"{self.task}: DEGENERATE under policy {self.policy}: passed by {', '.join(self.passing)}"


def _map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, fn) for k, v in value.items()}
    return value


def trivial_outputs(inputs: list[Any], expected: Any, constants: Any) -> Iterator[tuple[str, Any]]:
    """What each trivial candidate would return for these inputs, as ``(name, output)`` pairs
    made one at a time: on tasks with GB-sized outputs, holding all four at once runs a shared
    GPU out of memory.

    ``constants`` is a mean per output leaf taken from an earlier draw: the
    constant a hacker would hard-code after seeing one set of outputs.
    ``identity`` exists only when an input has the output's shape and dtype.
    """
    import torch

    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    yield "zeros", _map_leaves(expected, torch.zeros_like)
    leaves = iter(constants)

    def constant(e: Any) -> Any:
        value = next(leaves)
        return torch.full_like(e, value if e.is_floating_point() else round(value))

    yield "constant", _map_leaves(expected, constant)

    def same_as_input(e: Any) -> Any:
        match = next((t for t in tensors if t.shape == e.shape and t.dtype == e.dtype), None)
        if match is None:
            raise LookupError
        return match.clone()

    try:
        identity = _map_leaves(expected, same_as_input)
    except LookupError:
        pass
    else:
        yield "identity", identity
        del identity
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        mean = wide_sum(floats[0]) / floats[0].numel() if floats[0].numel() else 0.0
        yield "input-mean", _map_leaves(expected, lambda e: torch.full_like(e, mean if e.is_floating_point() else round(mean)))


def trivial_failures(inputs: list[Any], expected: Any, constants: Any, atol: float, rtol: float,
                     scale: bool) -> dict[str, str | None]:
    """Each trivial candidate (in ``TRIVIAL_CANDIDATES`` order) against ``expected`` under a
    tolerance: None where it passes, else why it fails."""
    verdicts: dict[str, str | None] = {name: "not applicable (no input matches the output)" for name in TRIVIAL_CANDIDATES}
    for name, output in trivial_outputs(inputs, expected, constants):
        bad = [r for r in compare_outputs(expected, output, atol, rtol, scale=scale) if not r["ok"]]
        verdicts[name] = f"{bad[0]['path']}: {bad[0]['reason']}" if bad else None
        del output
    return verdicts


def leaf_means(expected: Any) -> list[float]:
    """The mean of each output leaf, in the order ``trivial_outputs`` visits them."""
    return [wide_sum(e) / e.numel() if e.numel() else 0.0 for e in tensors_in(expected)]
