"""The statistics of interleaved timing rounds and the noise-aware reward decision (no processes)."""

import math
import random

import pytest

from cuda_agent.evaluate.decide import Plan, Rounds, run_rounds, settled, speedup, t_quantile
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.reward import milestone

LINE = 1 / 0.95


def reward_of(beats):
    return milestone(beats.get("eager", False), beats.get("compile", False))


@pytest.mark.parametrize("p, df, expected", [(0.975, 1, 12.706), (0.975, 4, 2.776), (0.975, 9, 2.262),
                                             (0.95, 4, 2.132), (0.995, 10, 3.169), (0.975, 10_000, 1.960)])
def test_t_quantiles_match_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-3)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-3)


def test_speedup_is_the_geometric_mean_of_the_rounds_with_a_t_interval():
    ratios = [1.10, 1.20, 1.15, 1.12, 1.18]
    s = speedup("eager", ratios, LINE, 0.95)
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    assert s.estimate == pytest.approx(math.exp(mean))
    assert s.low == pytest.approx(math.exp(mean - 2.776 * sd / math.sqrt(5)), rel=1e-4)
    assert s.high == pytest.approx(math.exp(mean + 2.776 * sd / math.sqrt(5)), rel=1e-4)
    assert s.beats and s.confident and s.rounds == 5
    straddling = speedup("eager", [1.0, 1.1, 1.03, 1.08, 1.06], LINE, 0.95)
    assert straddling.low < LINE < straddling.high and not straddling.confident
    assert speedup("eager", [0.9, 0.91, 0.92], LINE, 0.95).to_dict()["beats"] is False
    assert speedup("compile", [0.5, 3.0], None, 0.95).confident  # no line (raw-speedup reward): nothing to decide


def test_settled_spends_no_rounds_on_a_decision_that_cannot_change_the_reward():
    eager_lost = speedup("eager", [0.95, 0.96, 0.97, 0.95, 0.96], LINE, 0.95)
    compile_open = speedup("compile", [1.03, 1.07, 1.05, 1.06, 1.04], LINE, 0.95)
    assert eager_lost.confident and not compile_open.confident
    assert settled({"eager": eager_lost, "compile": compile_open}, reward_of)  # 1 either way
    eager_won = speedup("eager", [1.2, 1.25, 1.22, 1.21, 1.23], LINE, 0.95)
    assert not settled({"eager": eager_won, "compile": compile_open}, reward_of)  # 2 or 3
    eager_open = speedup("eager", [1.03, 1.07, 1.05, 1.06, 1.04], LINE, 0.95)
    assert not settled({"eager": eager_open}, reward_of)


def test_plan_groups_launch_bound_calls_and_sizes_rounds():
    config = TimingConfig(region_ms=1.0, round_ms=50.0, round_trials=(4, 100), max_calls=100)
    assert Plan.for_call(0.01, config) == Plan(trials=50, calls=100)
    assert Plan.for_call(0.05, config) == Plan(trials=50, calls=20)
    assert Plan.for_call(2.0, config) == Plan(trials=25, calls=1)
    assert Plan.for_call(500.0, config) == Plan(trials=4, calls=1)  # at least the minimum trials


def test_plan_fills_regions_by_the_call_alone_and_rounds_by_the_call_with_its_draw():
    # A 0.08 ms call whose inputs take 0.25 ms to draw: grouped by its wall time its regions were 0.25 ms
    # (a quarter of region_ms), too short for the outside clock; by the call alone they last region_ms.
    config = TimingConfig(region_ms=1.0, round_ms=50.0, round_trials=(4, 100), max_calls=100)
    assert Plan.for_call(0.33, config) == Plan(trials=38, calls=4)
    plan = Plan.for_call(0.33, config, call_ms=0.08)
    assert plan == Plan(trials=12, calls=13) and plan.calls * 0.08 >= config.region_ms
    assert plan.trials * plan.calls * 0.33 == pytest.approx(config.round_ms, rel=0.15)  # the round's wall kept
    # A call time beyond the wall time, or none, is not believed: the wall time sizes both.
    assert Plan.for_call(0.33, config, call_ms=5.0) == Plan.for_call(0.33, config, call_ms=0.0) == Plan(38, 4)
    assert Plan.for_call(2.0, config, call_ms=1.5) == Plan(trials=25, calls=1)
    assert Plan.for_call(0.5, config, call_ms=0.001) == Plan(trials=4, calls=100)  # at most max_calls
    # A region's calls stay alive together: at most region_bytes of inputs and outputs, at least one call.
    gib = 1 << 30
    assert Plan.for_call(2.5, config, call_ms=0.005, call_bytes=2 * gib) == Plan(trials=20, calls=1)
    assert Plan.for_call(0.33, config, call_ms=0.08, call_bytes=128 << 20) == Plan(trials=12, calls=13)
    assert Plan.for_call(0.33, config, call_ms=0.08, call_bytes=256 << 20).calls == 8
    assert Plan.for_call(9.0, config, call_ms=0.5, call_bytes=5 * gib).calls == 1
    # On a GPU, a share of its memory where that is more (cuda_gelu's 2 GiB calls on an H200: two a region).
    h200, small = 143_771_140_096, 24 << 30
    assert Plan.for_call(2.6, config, call_ms=0.52, call_bytes=2 * gib, device_bytes=h200).calls == 2
    assert Plan.for_call(2.6, config, call_ms=0.52, call_bytes=2 * gib, device_bytes=small).calls == 1
    assert Plan.for_call(2.6, config, call_ms=0.26, call_bytes=2 * gib, device_bytes=h200).calls == 4


def test_default_regions_of_a_sub_ms_call_are_what_the_outside_clock_was_measured_on():
    # docs/SECURITY.md, "Regions of 2 ms": the defaults give cuda_gelu (0.52 ms, 2 GiB a call) four calls a region on
    # an H200 (2.08 ms; its stated margin 0.05) and two on an H100, whose 1/16 share (5 GB) holds only two.
    config, gib = TimingConfig(), 1 << 30
    h200, h100 = 143_771_140_096, 85_045_870_592
    assert Plan.for_call(0.9, config, call_ms=0.52, call_bytes=2 * gib, device_bytes=h200).calls == 4
    assert Plan.for_call(0.9, config, call_ms=0.52, call_bytes=2 * gib, device_bytes=h100).calls == 2
    # A small call fills the 2 ms by its own time (0.08 ms a call, inputs far under the cap: 25 calls).
    assert Plan.for_call(0.33, config, call_ms=0.08, call_bytes=64 << 20, device_bytes=h200).calls == 25


def test_rounds_rotate_the_order_and_stop_once_decided():
    config = TimingConfig(rounds_min=3, rounds_max=10, budget_s=60)
    order, calls = [], {"candidate": [], "eager": []}

    def side(name, ms):
        def run(first, trials, count):
            order.append(name)
            calls[name].append(first)
            return [ms] * trials
        return run

    plans = {"candidate": Plan(4, 2), "eager": Plan(3, 1)}
    rounds = run_rounds({"candidate": side("candidate", 1.0), "eager": side("eager", 2.0)}, plans, config,
                        undecided=lambda r: r.count("candidate") < 5)
    assert rounds.count("candidate") == rounds.count("eager") == 5
    assert order[:6] == ["candidate", "eager", "eager", "candidate", "candidate", "eager"]
    assert calls["candidate"] == [0, 8, 16, 24, 32] and calls["eager"] == [0, 3, 6, 9, 12]  # call indices continue
    assert rounds.ratios("eager") == [2.0] * 5 and rounds.spread("eager") == 0.0
    assert rounds.stats("candidate", "events").trials == 20

    decided_early = run_rounds({"candidate": side("candidate", 1.0)}, {"candidate": Plan(4, 1)}, config,
                               undecided=lambda r: False)
    assert decided_early.count("candidate") == config.rounds_min
    never = run_rounds({"candidate": side("candidate", 1.0)}, {"candidate": Plan(4, 1)}, config,
                       undecided=lambda r: True)
    assert never.count("candidate") == config.rounds_max


def test_interleaving_cancels_a_slow_spell_that_one_sided_timing_turns_into_a_wrong_reward():
    """A machine whose speed drifts by 12% over time: interleaved rounds give the true ratio (1.10,
    reward 2); timing the baseline first, then the candidate in the slow part, would not."""
    rng = random.Random(0)
    clock = {"t": 0}

    def speed():
        clock["t"] += 1
        return 1.0 + 0.12 * (clock["t"] > 6)  # slow from the 7th region on

    def side(base_ms):
        return lambda first, trials, calls: [base_ms * speed() * (1 + rng.gauss(0, 0.002)) for _ in range(trials)]

    config = TimingConfig(rounds_min=5, rounds_max=20, budget_s=60)
    rounds = run_rounds({"candidate": side(1.0), "eager": side(1.10)}, {"candidate": Plan(1, 1), "eager": Plan(1, 1)},
                        config, undecided=lambda r: False, rounds=Rounds())
    estimate = speedup("eager", rounds.ratios("eager"), LINE, 0.95)
    assert estimate.estimate == pytest.approx(1.10, rel=0.03) and estimate.beats
    one_sided = 1.10 * 1.0 / (1.0 * 1.12)  # baseline timed before the spell, candidate inside it
    assert one_sided < LINE


def test_cached_baselines_count_as_fixed_times():
    rounds = Rounds(fixed={"eager": 3.0})
    rounds.add("candidate", [1.0, 1.0, 1.0])
    rounds.add("candidate", [1.5, 1.5])
    assert rounds.ratios("eager") == [3.0, 2.0]
    # The outside clock's correction (verdict.decide) scales the candidate's samples alone, in a copy.
    slower = rounds.scaled("candidate", 1.25)
    assert slower.ratios("eager") == [2.4, 1.6] and rounds.ratios("eager") == [3.0, 2.0]


def test_timing_config_checks_the_round_settings():
    with pytest.raises(ValueError, match="rounds_min"):
        TimingConfig(rounds_min=2)
    with pytest.raises(ValueError, match="baselines"):
        TimingConfig(baselines="sometimes")
    with pytest.raises(ValueError, match="round_trials"):
        TimingConfig(round_trials=(1, 5))
    restored = TimingConfig.from_dict(TimingConfig(round_trials=(3, 7)).to_dict())
    assert restored.round_trials == (3, 7)


def test_timing_config_checks_the_region_bounds():
    with pytest.raises(ValueError, match="end_fence"):
        TimingConfig(end_fence="host")
    with pytest.raises(ValueError, match="hold_us"):
        TimingConfig(hold_us=-1)
    default = TimingConfig()
    assert default.end_fence == "stream" and default.hold_us == 200.0
    assert TimingConfig.from_dict(TimingConfig(end_fence="device", hold_us=0).to_dict()).end_fence == "device"


def test_the_clock_check_passes_an_honest_round_and_fails_regions_reported_short():
    from cuda_agent.evaluate.decide import clock_check
    from cuda_agent.evaluate.protocol.policy import TimingConfig

    config = TimingConfig(clock_slack=0.1, clock_trial_us=50, clock_noise=3, clock_harness_share=0.0)
    # 10 regions of 1 ms reported; the rounds took 13 ms, of which 3 ms is the harness (empty rounds);
    # one slow round moves neither the medians nor the scatter much.
    honest = clock_check([13.1, 13.0, 19.0], [10.0, 10.0, 10.0], [3.0, 3.2], 10, config)
    assert honest.ok and honest.unexplained_ms == pytest.approx(0.0)
    assert honest.limit_ms == pytest.approx(1.0 + 0.5 + 3 * 1.4826 * 0.1)
    # The same rounds reported as 0.55 ms regions: 4.5 ms per round unexplained.
    forged = clock_check([13.1, 13.0, 13.2], [5.5, 5.5, 5.5], [3.0, 3.2], 10, config)
    assert not forged.ok and forged.unexplained_ms == pytest.approx(4.5)
    assert forged.to_dict()["ok"] is False
    # A host whose harness time wanders by milliseconds is given that much room.
    noisy = clock_check([20.0, 13.0, 16.0, 24.0, 13.5], [10.0] * 5, [3.0, 9.0, 4.0], 10, config)
    assert noisy.ok and noisy.limit_ms > 10
    # And a share of the harness's own time (the default: half of it).
    shared = clock_check([13.1, 13.0, 13.2], [5.5, 5.5, 5.5], [3.0, 3.2], 10, TimingConfig())
    assert shared.limit_ms == pytest.approx(forged.limit_ms + 0.5 * 3.1)


def test_the_clock_judges_short_regions_only_by_a_gross_excess():
    """axpby on the H200: rounds reporting 0.06-0.4 ms of regions against a harness that moves by
    10-20 ms between processes. Over the limit there is not evidence of a forged report, unless the
    excess is several times the limit."""
    from cuda_agent.evaluate.decide import CLOCK_GROSS, clock_check
    from cuda_agent.evaluate.protocol.policy import TimingConfig

    config = TimingConfig()
    long_regions = clock_check([13.1, 13.0, 13.2], [5.5, 5.5, 5.5], [3.0, 3.2], 10, config)
    assert long_regions.decisive and not long_regions.ok  # judged as before
    launch_bound = clock_check([40.3, 37.1, 40.6, 40.8, 41.4], [0.14] * 5, [16.6, 18.1, 18.1], 8, config)
    assert not launch_bound.ok and not launch_bound.decisive and not launch_bound.gross
    forged = clock_check([140.0, 141.0, 139.0], [0.14] * 3, [16.6, 18.1, 18.1], 8, config)
    assert not forged.decisive and forged.gross and forged.unexplained_ms > CLOCK_GROSS * forged.limit_ms
