"""The GPU quiet before a baseline's region and before the candidate's GO (``evaluate.protocol.quiet``): how the
reference's probes are judged, and who is blamed. The probes themselves need a GPU (the red team's
``lingering-context-runtime`` case, tests/redteam/test_redteam_gpu.py)."""

from __future__ import annotations

import pytest

from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.messages import QuietReply, QuietRequest
from cuda_agent.evaluate.protocol.quiet import QUIET_US, GpuQuiet, quiet_after_stops
from cuda_agent.evaluate.protocol.timing import time_round
from cuda_agent.guard.policy import RULES


class Reference:
    """The reference's channel: answers the quiet request with ``after_ms``, and logs what happened."""

    def __init__(self, after_ms: float | None, log: list[str]) -> None:
        self.after_ms, self.log = after_ms, log

    def ask_typed(self, stage, request, reply_type, timeout_s):
        assert isinstance(request, QuietRequest) and reply_type is QuietReply
        self.log.append("probed")
        return QuietReply(after_ms=self.after_ms)


class Worker:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def kill(self) -> None:
        self.log.append("killed")


@pytest.mark.parametrize("busy_us", [None, 0.0, 18.5, QUIET_US])
def test_a_quiet_probe_passes_and_ends_nothing(busy_us):
    log: list[str] = []
    quiet = GpuQuiet(Reference(1.0, log), 30)
    quiet.candidate = Worker(log)
    quiet.judge(busy_us, "before a region of eager's")
    assert log == []


def test_work_that_ends_with_the_candidate_fails_it_by_name():
    log: list[str] = []
    quiet = GpuQuiet(Reference(6.4, log), 30)
    quiet.candidate = Worker(log)
    with pytest.raises(Stop) as stop:
        quiet.judge(2380.0, "before a region of eager's")
    assert log == ["killed", "probed"]  # ended first, then asked whether the GPU went quiet
    assert (stop.value.status, stop.value.rule) == ("failed", "gpu-busy")
    assert "gpu-busy" in RULES
    assert "2.38 ms" in stop.value.reason and "quiet 6 ms after" in stop.value.reason
    assert "before a region of eager's" in stop.value.reason


def test_work_that_outlives_the_candidate_is_another_process_and_refuses_the_evaluation():
    log: list[str] = []
    quiet = GpuQuiet(Reference(None, log), 30)
    quiet.candidate = Worker(log)
    with pytest.raises(Stop) as stop:
        quiet.judge(2100.0, "once a region's inputs were written, before its GO")
    assert log == ["killed", "probed"]
    assert (stop.value.status, stop.value.rule) == ("error", None)
    assert "another process" in stop.value.reason and "evaluate again" in stop.value.reason


def test_before_the_candidates_code_has_run_busy_is_never_its_doing():
    log: list[str] = []
    quiet = GpuQuiet(Reference(1.0, log), 30)  # no candidate: baselines alone, or the no-op regions
    with pytest.raises(Stop) as stop:
        quiet.judge(1500.0, "before a region of compile's")
    assert log == []  # nothing ended, nothing asked
    assert (stop.value.status, stop.value.rule) == ("error", None)


@pytest.mark.parametrize("bell", [False, True])
def test_the_probe_runs_before_each_region_opens(bell):
    """``before_region`` runs once a region, after its inputs are drawn and before its calls (and before READY
    where the region is bracketed): where the reference probes the GPU before a baseline's region."""
    events: list[str] = []

    class Bell:
        def wait(self, what, region):
            events.append(f"wait {what.decode().strip('_')}")

        def done(self, region, payload):
            events.append("done")

    def prepare():
        events.append("draw")
        return lambda: events.append("call")

    time_round(prepare, "cpu", TimingConfig(method="host"), trials=3, calls=2, after_end=lambda: b"",
               bell=Bell() if bell else None, announce=(lambda region: events.append("ready")) if bell else None,
               before_region=lambda: events.append("probe"))
    region = (["draw", "draw", "probe", "ready", "wait GO", "call", "call", "done", "wait CONT"] if bell
              else ["draw", "draw", "probe", "call", "call"])
    assert events == region * 3


class Paused:
    """A timing lock whose hold stopped ``paused`` other evaluations' processes (``DeviceLock.paused``)."""

    def __init__(self, paused: int) -> None:
        self.paused = paused


def _setup(device: str, paused: int):
    from types import SimpleNamespace

    from cuda_agent.evaluate import Timeouts
    return SimpleNamespace(device=device, timing_lock=Paused(paused), timeouts=Timeouts())


def test_a_timing_that_stopped_others_waits_for_a_quiet_gpu_and_refuses_without_one():
    log: list[str] = []
    quiet_after_stops(_setup("cuda", 0), Reference(None, log))  # stopped nothing: nothing to wait for
    quiet_after_stops(_setup("cpu", 2), Reference(None, log))  # no GPU queue on the CPU backend
    assert log == []
    quiet_after_stops(_setup("cuda", 1), Reference(3.0, log))  # quiet 3 ms after: go on
    assert log == ["probed"]
    with pytest.raises(Stop) as stop:
        quiet_after_stops(_setup("cuda", 2), Reference(None, log))  # still busy: refused, never the candidate's
    assert stop.value.status == "error" and stop.value.rule is None and "not quiet" in stop.value.reason
