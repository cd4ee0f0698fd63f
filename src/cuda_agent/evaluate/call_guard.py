"""The candidate process's call guard: ``guard.runtime.CallGuard``, which also holds the evaluation
core's own timing and output functions to their identities.

``guard`` sits below ``evaluate`` and cannot name these functions; the core names them here. A
candidate that replaced ``timing.time_round`` or ``transfer.write_outputs`` would report whatever
times or outputs it liked, so they are checked like ``time.perf_counter`` (rule ``monkeypatch``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from cuda_agent.evaluate import timing, transfer
from cuda_agent.guard import runtime


def trusted_functions() -> dict[str, Callable[[], Any]]:
    """Getters of the evaluation core's functions the candidate process relies on, by the name a
    ``monkeypatch`` verdict reports."""
    return {
        "cuda_agent.evaluate.timing.calibrate": lambda: timing.calibrate,
        "cuda_agent.evaluate.timing.time_round": lambda: timing.time_round,
        "cuda_agent.evaluate.timing.TimingStats.from_samples": lambda: timing.TimingStats.__dict__["from_samples"],
        "cuda_agent.evaluate.transfer.write_outputs": lambda: transfer.write_outputs,
    }


class CallGuard(runtime.CallGuard):
    """``guard.runtime.CallGuard`` trusting ``trusted_functions()`` too; one per candidate process."""

    def __init__(self, allowed_aten: Iterable[str] = ()):
        super().__init__(allowed_aten, trusted=trusted_functions())
