"""The timing loop calls the clocks it bound before candidate code loads (``evaluate.protocol.bound``): a name swapped
afterwards changes nothing it measures, and a swap of what it bound is reported by the harness snapshot."""

import time

import pytest

from cuda_agent.evaluate.protocol import bound
from cuda_agent.evaluate.worker.call_guard import CallGuard
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.timing import calibrate, time_round
from cuda_agent.guard.runtime import RuleBroken

SLEEP_S = 0.004


def _half_speed(real):
    """A clock that runs at half speed from the moment it is installed: what a forger swaps in."""
    origin = real()
    return lambda: origin + (real() - origin) // 2


def test_a_clock_swapped_in_time_after_load_changes_no_sample(monkeypatch):
    monkeypatch.setattr(time, "perf_counter_ns", _half_speed(time.perf_counter_ns))
    samples = time_round(lambda: (lambda: time.sleep(SLEEP_S)), "cpu", TimingConfig(method="host"), trials=4)
    # Timed by the swapped clock, each sample would be about half of the sleep.
    assert min(samples) >= SLEEP_S * 1e3 * 0.95


def test_calibration_times_with_the_bound_clock_too(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # a frozen clock: the warm-up would never end
    warmup = calibrate(lambda: time.sleep(0.001), "cpu", TimingConfig(method="host", warmup=2, warmup_ms=5.0))
    assert warmup.estimate_ms >= warmup.call_ms >= 0.9


@pytest.mark.parametrize("name", ["perf_counter_ns", "perf_counter"])
def test_swapping_a_bound_clock_is_monkeypatch(monkeypatch, name):
    guard = CallGuard()
    monkeypatch.setattr(bound, name, lambda: 0)
    with pytest.raises(RuleBroken) as caught:
        guard.verify_harness("during the timing rounds")
    assert caught.value.rule == "monkeypatch"
    assert f"cuda_agent.evaluate.protocol.bound.{name}" in str(caught.value)


def test_the_cuda_calls_are_held_to_their_identity(monkeypatch):
    """On a GPU ``bind_cuda`` fills ``bound.CUDA``; replacing it, or one of its calls, is seen like a clock swap."""
    class Calls:
        pass

    calls = Calls()
    for name in bound.CUDA_CALLS:
        setattr(calls, name, object())
    monkeypatch.setattr(bound, "CUDA", calls)
    guard = CallGuard()
    guard.verify_harness("before any swap")
    monkeypatch.setattr(calls, "elapsed", lambda start, end: 0.001)
    with pytest.raises(RuleBroken, match="bound.CUDA.elapsed"):
        guard.verify_harness("during the timing rounds")
