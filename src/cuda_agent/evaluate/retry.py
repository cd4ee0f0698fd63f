"""Evaluating again where an evaluation had no verdict because the host or GPU was busy.

An evaluation refused for other work on the host (the baselines' CPU pressure, the brackets' spread, another
process's GPU work: ``result.BUSY``) is not the candidate's doing, and the same evaluation a little later may
decide. ``with_retries`` runs an evaluation up to ``RetryPolicy.attempts`` times: between attempts it waits at
least the back-off, then until the host is quiet (its CPU pressure under ``quiet_share`` over ``QUIET_WINDOW_S``)
or the back-off's ceiling has passed. Nothing else is retried: a verdict (correct, incorrect, failed) stands, and
a harness error (``result.HARNESS``: the task or the toolchain failed) would fail again. Each attempt reuses what
the ones before built (the build cache) and the task's reference process the evaluator keeps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from cuda_agent.evaluate.pressure import CPU_PRESSURE, cpu_stall_us
from cuda_agent.evaluate.result import BUSY, EvalResult

QUIET_WINDOW_S = 1.0  # the host's CPU pressure is judged over windows this long while waiting


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and after how long, an evaluation without a verdict for a busy host is tried again.

    ``attempts``: evaluations in all (1: none again). Before attempt ``n + 1``: at least ``backoff_s * 2**(n-1)``
    seconds, then up to ``backoff_max_s`` more for a window in which some task waited for a CPU less than
    ``quiet_share`` of the time (where the kernel reports CPU pressure; elsewhere the back-off alone)."""

    attempts: int = 3
    backoff_s: float = 2.0
    backoff_max_s: float = 30.0
    quiet_share: float = 0.1

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts is the number of evaluations, at least 1, not {self.attempts}.")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("RetryPolicy.backoff_s and backoff_max_s are seconds, 0 or more.")
        if not 0 < self.quiet_share <= 1:
            raise ValueError("RetryPolicy.quiet_share is a share of time, above 0 and at most 1.")

    @classmethod
    def none(cls) -> "RetryPolicy":
        """One attempt: whoever calls retries itself (the service's queue, which may pick another slot)."""
        return cls(attempts=1)

    def backoff(self, attempt: int) -> float:
        """The least wait after attempt ``attempt`` (1-based) had no verdict."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)


def host_pressure(window_s: float = QUIET_WINDOW_S, sleep: Callable[[float], None] = time.sleep) -> float | None:
    """The share of the next ``window_s`` in which some task on the host waited for a CPU; None where the kernel
    does not say."""
    before, started = cpu_stall_us(CPU_PRESSURE), time.monotonic()
    sleep(window_s)
    after, wall = cpu_stall_us(CPU_PRESSURE), time.monotonic() - started
    if before is None or after is None or wall <= 0:
        return None
    return (after - before) / (wall * 1e6)


def wait_for_quiet(policy: RetryPolicy, attempt: int, sleep: Callable[[float], None] = time.sleep,
                   pressure: Callable[[], float | None] = host_pressure) -> tuple[float, float | None]:
    """The wait before the next attempt: the back-off, then quiet windows looked for until ``backoff_max_s``.
    Returns the seconds waited and the last pressure seen (None: not measured)."""
    started = time.monotonic()
    sleep(policy.backoff(attempt))
    share = None
    while time.monotonic() - started < policy.backoff_max_s:
        share = pressure()
        if share is None or share < policy.quiet_share:
            break
    return round(time.monotonic() - started, 3), share


def with_retries(attempt: Callable[[], EvalResult], policy: RetryPolicy,
                 on_retry: Callable[[int, EvalResult], None] = lambda n, result: None,
                 wait: Callable[[RetryPolicy, int], tuple[float, float | None]] = wait_for_quiet) -> EvalResult:
    """``attempt()`` until it has a verdict, a no-verdict that is not ``BUSY``, or ``policy.attempts`` ran. The
    result says how many ran (``attempts``), what the earlier ones found (notes) and the time waited between them
    (``durations["retry_wait"]``)."""
    earlier: list[str] = []
    waited = 0.0
    for number in range(1, policy.attempts + 1):
        result = attempt()
        if result.no_verdict_kind != BUSY or number == policy.attempts:
            break
        earlier.append(f"attempt {number} had no verdict, the host or GPU being busy ({result.reason})")
        on_retry(number, result)
        seconds, share = wait(policy, number)
        waited += seconds
        if share is not None:
            earlier[-1] += f"; waited {seconds:.1f} s (CPU pressure then {share:.0%})"
    result.attempts = number
    result.notes[:0] = earlier
    if number > 1:
        result.durations["retry_wait"] = round(waited, 3)
    return result
