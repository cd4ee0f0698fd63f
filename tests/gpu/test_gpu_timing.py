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
