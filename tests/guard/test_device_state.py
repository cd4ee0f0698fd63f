"""GPU state checks that can be exercised without a GPU (the GPU suite runs them for real)."""

from __future__ import annotations

import pytest

from cuda_agent.guard import device_state


@pytest.fixture(autouse=True)
def fresh_readers():
    device_state._reader.cache_clear()
    yield
    device_state._reader.cache_clear()


def test_busy_gpu_is_reported_with_its_utilization(monkeypatch):
    readings = iter([0, 37, 2])
    monkeypatch.setattr(device_state, "_nvml_reader", lambda index: lambda: next(readings))
    reason = device_state.gpu_busy(0, samples=3, interval_s=0)
    assert reason and "37%" in reason


def test_idle_gpu_is_not_busy(monkeypatch):
    monkeypatch.setattr(device_state, "_nvml_reader", lambda index: lambda: 1)
    assert device_state.gpu_busy(0, samples=2, interval_s=0) is None


def test_no_reader_means_no_verdict(monkeypatch):
    monkeypatch.setattr(device_state, "_nvml_reader", lambda index: None)
    monkeypatch.setattr(device_state, "_smi_reader", lambda index: None)
    assert device_state.gpu_busy(0) is None


def test_driver_calls_fail_clearly_without_a_driver(monkeypatch):
    def missing(*args, **kwargs):
        raise OSError("libcuda.so.1: cannot open shared object file")

    device_state._driver.cache_clear()
    monkeypatch.setattr(device_state.ctypes, "CDLL", missing)
    try:
        with pytest.raises(device_state.DriverError, match="libcuda.so.1"):
            device_state.persisting_l2_limit()
    finally:
        device_state._driver.cache_clear()
