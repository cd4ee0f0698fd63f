"""The candidate process's call guard: ``guard.runtime.CallGuard``, which also holds the evaluation
core's own timing and output functions to their identities.

``guard`` sits below ``evaluate`` and cannot name these functions; the core names them here. A
candidate that replaced ``timing.time_round`` or ``transfer.write_outputs`` would report whatever
times or outputs it liked, so they are checked like ``time.perf_counter`` (rule ``monkeypatch``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from cuda_agent.evaluate.protocol import bound, timing
from cuda_agent.evaluate.worker import transfer
from cuda_agent.guard import runtime


def trusted_functions() -> dict[str, Callable[[], Any]]:
    """Getters of the evaluation core's functions the candidate process relies on, by the name a
    ``monkeypatch`` verdict reports."""
    return {
        "cuda_agent.evaluate.protocol.timing.calibrate": lambda: timing.calibrate,
        "cuda_agent.evaluate.protocol.timing.time_round": lambda: timing.time_round,
        "cuda_agent.evaluate.protocol.timing.TimingStats.from_samples": lambda: timing.TimingStats.__dict__["from_samples"],
        "cuda_agent.evaluate.worker.transfer.write_outputs": lambda: transfer.write_outputs,
        # What the timing loop calls as bound before load (``evaluate.protocol.bound``), the bound objects themselves.
        "cuda_agent.evaluate.protocol.bound.perf_counter_ns": lambda: bound.perf_counter_ns,
        "cuda_agent.evaluate.protocol.bound.perf_counter": lambda: bound.perf_counter,
        "cuda_agent.evaluate.protocol.bound.bind_cuda": lambda: bound.bind_cuda,
        "cuda_agent.evaluate.protocol.bound.CUDA": lambda: bound.CUDA,
        "cuda_agent.evaluate.protocol.bound.CudaCalls.record": lambda: bound.CudaCalls.__dict__["record"],
        **{f"cuda_agent.evaluate.protocol.bound.CUDA.{name}": _bound_cuda(name) for name in bound.CUDA_CALLS},
    }


def _bound_cuda(name: str) -> Callable[[], Any]:
    return lambda: getattr(bound.CUDA, name, None)


class CallGuard(runtime.CallGuard):
    """``guard.runtime.CallGuard`` trusting ``trusted_functions()`` too; one per candidate process."""

    def __init__(self, allowed_aten: Iterable[str] = ()):
        super().__init__(allowed_aten, trusted=trusted_functions())
