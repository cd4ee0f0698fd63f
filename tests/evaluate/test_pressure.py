"""Each side's CPU pressure over its timing (evaluate.pressure), from the kernel's stall counter."""

from __future__ import annotations

import time

from cuda_agent.evaluate.pressure import Pressure, cpu_stall_us


def _write(path, total_us: int) -> None:
    path.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total_us}\n"
                    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")


def test_a_sides_share_is_the_stall_over_its_own_calls(tmp_path):
    counter = tmp_path / "cpu"
    _write(counter, 1_000_000)
    pressure = Pressure(counter)
    total = {"us": 1_000_000}

    def eager(first: int, trials: int, calls: int) -> list[float]:
        time.sleep(0.02)
        total["us"] += 10_000  # stalled for 10 ms of at least 20
        _write(counter, total["us"])
        return [1.0] * trials

    def candidate(first: int, trials: int, calls: int) -> list[float]:
        time.sleep(0.02)
        return [1.0] * trials

    sides = {"eager": pressure.wrap("eager", eager), "candidate": pressure.wrap("candidate", candidate)}
    for _ in range(3):
        assert sides["eager"](0, 2, 1) == [1.0, 1.0] and sides["candidate"](0, 2, 1) == [1.0, 1.0]
    shares = pressure.shares()
    assert 0.1 < shares["eager"] <= 0.5 and shares["candidate"] == 0.0


def test_no_counter_measures_nothing(tmp_path):
    assert cpu_stall_us(tmp_path / "missing") is None
    pressure = Pressure(tmp_path / "missing")

    def side(first: int, trials: int, calls: int) -> list[float]:
        return [1.0]
    assert pressure.wrap("eager", side) is side and pressure.shares() == {}
