"""The hold before a timed region, sized from what the host takes to enqueue a side's calls
(``timing.HostLaunch``): torch.compile's host path outlasted the fixed 200 us hold on the H200 and
its regions then held GPU idle time."""

from __future__ import annotations

import time

import pytest

from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.timing import HOST_WINDOW, HostLaunch, calibrate

CONFIG = TimingConfig(hold_us=200.0, hold_max_us=5000.0)


def test_a_fixed_hold_ignores_the_host():
    host = HostLaunch(adaptive=False)
    host.recent.extend([900.0, 1200.0])
    assert host.hold_for(4, CONFIG) == 200.0


def test_an_adaptive_hold_covers_twice_the_longest_recent_enqueue_within_its_bounds():
    host = HostLaunch(adaptive=True)
    assert host.hold_for(2, CONFIG) == 200.0  # nothing learned yet
    host.recent.extend([100.0, 300.0])
    assert host.hold_for(2, CONFIG) == pytest.approx(2 * 2 * 300.0 + 50.0)
    assert host.hold_for(100, CONFIG) == 5000.0  # hold_max_us
    small = HostLaunch(adaptive=True)
    small.recent.append(10.0)
    assert small.hold_for(1, CONFIG) == 200.0  # never below hold_us


def test_a_first_call_hold_covers_one_call_whatever_the_region_holds():
    """The default for the baselines: a stream of calls waits for the host's first enqueue only (the
    rest overlap the GPU's work), and a launch-bound region's host time past it still counts."""
    host = HostLaunch(adaptive=True, first_call=True)
    host.recent.extend([100.0, 300.0])
    assert host.hold_for(1, CONFIG) == host.hold_for(100, CONFIG) == pytest.approx(300.0 + 50.0)
    assert TimingConfig().baseline_hold == "first-call"
    # It learns from each region's first call, and a region is late when its first call outlasts the hold.
    host.begin_round()
    host.region(900.0, 3, 350.0, first_us=320.0)
    assert host.late == 0 and host.recent[-1] == 320.0
    host.region(900.0, 3, 350.0, first_us=400.0)
    assert host.late == 1 and host.hold_for(3, CONFIG) == pytest.approx(450.0)
    launch_bound = HostLaunch(adaptive=True, first_call=True)
    launch_bound.recent.append(6.0)  # a few us a call, 100 calls a region: as fixed holds time it
    assert launch_bound.hold_for(100, CONFIG) == 200.0


def test_a_launch_bound_baseline_keeps_the_fixed_hold():
    """torch.compile of axpby on the H100: 400 us of host a call against 3 us of GPU, one call a
    region. Covered, its region held the GPU's 3 us alone and its reward moved between 1 and 3; in a
    stream of such calls the host is the cost."""
    compiled = HostLaunch(adaptive=True, first_call=True)
    compiled.recent.extend([380.0, 420.0])
    compiled.learn_bound(enqueue_us=400.0, tail_us=25.0)
    assert compiled.host_bound and compiled.hold_for(1, CONFIG) == 200.0
    gelu = HostLaunch(adaptive=True, first_call=True)  # 300-450 us of host, 520 us of GPU
    gelu.recent.extend([300.0, 450.0])
    gelu.learn_bound(enqueue_us=350.0, tail_us=500.0)
    assert not gelu.host_bound and gelu.hold_for(1, CONFIG) == pytest.approx(500.0)
    assert not HostLaunch(adaptive=True, first_call=True).host_bound  # nothing learned: covered


def test_the_warm_up_learns_whether_the_host_or_the_device_bounds_a_call():
    calls = []

    def slow_host():
        calls.append(None)
        time.sleep(0.002)  # the host's 2 ms; nothing left for a device after it

    host = HostLaunch(adaptive=True, first_call=True)
    calibrate(slow_host, "cpu", TimingConfig(warmup=6, warmup_ms=0.0), host=host)
    assert host.host_bound and host.hold_for(1, CONFIG) == 200.0


def test_an_old_stall_stops_widening_the_hold():
    host = HostLaunch(adaptive=True)
    host.region(2000.0, 1, 200.0)  # one region's enqueue hit a long pause
    assert host.hold_for(1, CONFIG) > 4000.0
    for _ in range(HOST_WINDOW):
        host.region(100.0, 1, 4050.0)
    assert host.hold_for(1, CONFIG) == pytest.approx(250.0)


def test_regions_that_outlast_their_hold_are_counted_per_round():
    host = HostLaunch()
    host.region(150.0, 1, 200.0)
    host.region(260.0, 2, 200.0)
    assert host.report() == {"enqueue_us": 260.0, "hold_us": 200.0, "late": 1, "fenced": 0,
                             "host_bound": False}
    host.begin_round()
    assert host.report() == {"enqueue_us": 0.0, "hold_us": 0.0, "late": 0, "fenced": 0, "host_bound": False}
    assert list(host.recent) == [150.0, 130.0]  # per call; kept across rounds


def test_warm_up_learns_only_from_its_later_calls():
    calls = []

    def fn():
        calls.append(None)
        if len(calls) <= 2:
            time.sleep(0.05)  # first calls compile and initialise lazily

    host = HostLaunch(adaptive=True)
    calibrate(fn, "cpu", TimingConfig(warmup=6, warmup_ms=0.0), host=host)
    assert len(calls) == 6 and len(host.recent) == 3
    assert max(host.recent) < 20_000  # us: none of the 50 ms first calls


def test_the_reference_reports_each_rounds_host_and_adapts_only_the_baselines(doubling_reference):
    side = doubling_reference
    timing = TimingConfig(method="host", baseline_hold="adaptive").to_dict()
    side.handle("expect", {"seed": 1, "strict": False, "atol": 1e-3, "rtol": 1e-3, "scale": True})
    reply = side.handle("time", {"side": "eager", "seed": 3, "first": 0, "trials": 3, "calls": 1, "timing": timing})
    assert set(reply["host"]) == {"enqueue_us", "hold_us", "late", "fenced", "host_bound"} and len(reply["samples"]) == 3
    assert side.launches["eager"].adaptive
    side.handle("time", {"side": "empty", "seed": 3, "first": 0, "trials": 3, "calls": 1, "timing": timing})
    assert not side.launches["empty"].adaptive  # it stands for the candidate's harness time
    assert not side.launches["eager"].first_call
    fixed = TimingConfig(method="host", baseline_hold="fixed").to_dict()
    side.handle("time", {"side": "eager", "seed": 3, "first": 0, "trials": 1, "calls": 1, "timing": fixed})
    assert not side.launches["eager"].adaptive
    default = TimingConfig(method="host").to_dict()
    side.handle("time", {"side": "eager", "seed": 3, "first": 0, "trials": 1, "calls": 1,
                         "timing": default})
    assert side.launches["eager"].adaptive and side.launches["eager"].first_call
    side.handle("time", {"side": "empty", "seed": 3, "first": 0, "trials": 1, "calls": 1, "timing": default})
    assert not side.launches["empty"].adaptive


def test_bad_hold_settings_are_refused():
    with pytest.raises(ValueError, match="baseline_hold"):
        TimingConfig(baseline_hold="sometimes")
    with pytest.raises(ValueError, match="hold_max_us"):
        TimingConfig(hold_us=500.0, hold_max_us=100.0)


def test_the_candidates_hold_is_the_one_the_evaluator_set():
    from cuda_agent.evaluate.protocol.timing import host_hold

    host = HostLaunch(fixed_us=650.0)
    host.recent.append(5000.0)  # whatever its process says it took
    assert host.hold_for(3, CONFIG) == 650.0
    # Twice eager's host time per call for the candidate's calls, within the bounds.
    assert host_hold(3, 100.0, CONFIG) == pytest.approx(650.0)
    assert host_hold(1, 10.0, CONFIG) == 200.0 and host_hold(1000, 100.0, CONFIG) == 5000.0


def test_the_reference_tells_the_evaluator_eagers_host_time_per_call(doubling_reference):
    side = doubling_reference
    reply = side.handle("calibrate", {"side": "eager", "seed": 1, "timing": TimingConfig(method="host").to_dict()})
    assert reply["host_us"] == side.launches["eager"].per_call_us > 0
    side.handle("time", {"side": "empty", "seed": 3, "first": 0, "trials": 2, "calls": 1, "hold_us": 750.0,
                         "timing": TimingConfig(method="host").to_dict()})
    assert side.launches["empty"].hold_for(1, CONFIG) == 750.0


def test_fixed_holds_keep_the_baseline_key_of_the_tables_measured_before_them():
    from cuda_agent.evaluate.baseline import baseline_key

    def key(device="cuda", **timing):
        return baseline_key("d", {"gpu": "H200"}, {"tf32": "off"}, TimingConfig(**timing).to_dict(), device)

    before = TimingConfig().to_dict()
    for name in ("baseline_hold", "hold_max_us"):
        before.pop(name)
    assert key(baseline_hold="fixed") == baseline_key("d", {"gpu": "H200"}, {"tf32": "off"}, before, "cuda")
    # The default (first-call holds) times the GPU baselines anew: tables measured before it do not serve.
    assert len({key(), key(baseline_hold="adaptive"), key(baseline_hold="fixed")}) == 3
    assert key(baseline_hold="adaptive", hold_max_us=5000.0) != key(baseline_hold="adaptive")
    # A host clock holds nothing: the CPU backend's cached baselines keep their key.
    assert key("cpu") == key("cpu", baseline_hold="fixed") == baseline_key("d", {"gpu": "H200"}, {"tf32": "off"},
                                                                             before, "cpu")
