"""The timed region's end on a real GPU: in stream order, held busy at the start, and never shorter
than work the end event did not wait for."""

import statistics

import pytest

from cuda_agent.evaluate.policy import TimingConfig
from cuda_agent.evaluate.timing import time_round

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SLEEP_CYCLES = 2_000_000  # about 1 ms at 2 GHz


def median_ms(fn, **config) -> float:
    timing = TimingConfig(method="events", flush_l2=False, **config)
    return statistics.median(time_round(lambda: fn, "cuda", timing, trials=9))


def test_work_left_on_a_side_stream_is_timed_to_the_fence():
    side = torch.cuda.Stream()

    def joined():
        torch.cuda._sleep(SLEEP_CYCLES)

    def left_running():
        with torch.cuda.stream(side):  # never joined back: the end event does not wait for it
            torch.cuda._sleep(SLEEP_CYCLES)

    honest = median_ms(joined)
    assert honest > 0.3
    assert median_ms(left_running) >= 0.8 * honest
    # Without the fence check the side stream's work would not be seen at all.
    assert median_ms(left_running, end_fence="device") >= 0.8 * honest


def test_the_hold_keeps_host_time_out_of_a_short_region():
    def launches():
        for _ in range(4):
            torch.cuda._sleep(1000)

    held = median_ms(launches, hold_us=200.0)
    open_ = median_ms(launches, hold_us=0.0)
    assert held <= open_ + 0.002
    assert median_ms(lambda: None, hold_us=200.0) < 0.05


def test_a_baselines_hold_grows_to_cover_a_slow_host_path():
    """A call whose host path (guards, Python: torch.compile's took 110-520 us on the H200) outlasts
    the fixed 200 us hold leaves the GPU idle inside the region; the trusted baselines' adaptive hold
    learns the host's time in the warm-up and keeps it out."""
    import time

    from cuda_agent.evaluate.timing import HostLaunch, calibrate

    def slow_host():
        began = time.perf_counter()
        while time.perf_counter() - began < 0.0006:  # 600 us of host work before a short kernel
            pass
        torch.cuda._sleep(20_000)

    config = TimingConfig(method="events", flush_l2=False)
    fixed, adaptive = HostLaunch(), HostLaunch(adaptive=True)
    calibrate(slow_host, "cuda", config, host=fixed)
    calibrate(slow_host, "cuda", config, host=adaptive)
    fixed_ms = statistics.median(time_round(lambda: slow_host, "cuda", config, trials=9, host=fixed))
    adaptive_ms = statistics.median(time_round(lambda: slow_host, "cuda", config, trials=9, host=adaptive))
    assert fixed.late == 9 and fixed_ms > 0.3  # the host's 600 us, less the hold, is inside
    assert adaptive.late == 0 and adaptive.hold_us > 1200
    assert adaptive_ms < 0.1  # the kernel alone (about 10 us)
