"""The last stage of an evaluation: times, speedups with their intervals and the reward, each decided
from the timing rounds; the baselines timed in them cached; results no honest kernel reaches
(``watchers.Plausibility``) failed before any reward."""

from __future__ import annotations

from typing import Any

from cuda_agent.evaluate.baseline import BaselineCache
from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.context import Setup
from cuda_agent.evaluate.decide import BASELINES, Rounds, reward_settled, speedups
from cuda_agent.evaluate.reference_process import keep_baseline
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.reward import speedup_reward
from cuda_agent.evaluate.watchers import Plausibility, stop_on


def decide(setup: Setup, cache: BaselineCache, rounds: Rounds, baseline: dict[str, Any], key: str,
           output_bytes: int, result: EvalResult) -> None:
    """Times, speedups with their intervals, the reward: each decision from the rounds."""
    method = setup.timing.method
    result.times["candidate"] = rounds.stats("candidate", method).to_dict()
    for side in BASELINES:
        if side in baseline["fixed"]:
            result.times[side] = baseline["fixed"][side]
        elif rounds.count(side):
            result.times[side] = rounds.stats(side, method).to_dict()
    found = speedups(rounds, setup.policy, setup.timing)
    if baseline.get("sides") and baseline.get("cache"):
        keep_baseline(setup, cache, key, rounds, baseline, result)
    compile_error = baseline.get("compile_error") or (baseline.get("record") or {}).get("compile_error")
    if "compile" not in found and compile_error:
        result.notes.append(f"torch.compile baseline unavailable: {compile_error}")
    result.decision = {
        "rounds": rounds.count("candidate"),
        # The reward is settled: more rounds could not change it (each speedup's own "confident"
        # says whether its interval is clear of its line).
        "confident": reward_settled(found),
        "speedups": {side: s.to_dict() for side, s in found.items()},
        "spread": {side: round(rounds.spread(side), 5) for side in rounds.samples},
    }
    if not result.decision["confident"]:
        result.notes.append("the reward decision is not confident: a speedup's interval still straddles its "
                            "line after the timing budget (TimingConfig.rounds_max / budget_s)")
    eager, compiled = found.get("eager"), found.get("compile")
    result.speedup_eager = eager.estimate if eager else None
    result.speedup_compile = compiled.estimate if compiled else None
    stop_on("profile", "", Plausibility(result.times["candidate"]["median_ms"], result.speedup_eager, output_bytes,
                                        setup.policy, setup.device, result))
    clock_settles(setup, result)
    result.reward = speedup_reward(setup.policy, result.speedup_eager, result.speedup_compile)
    result.status = "correct"


def clock_settles(setup: Setup, result: EvalResult) -> None:
    """Refuse (no verdict) a reward that the evaluator's clock's ``uncertainty`` could change. That share of a
    region is how far the brackets' cost, calibrated before the candidate's code loaded, may be off; the candidate's
    time may then be off by as much either way, and its speedups by the inverse. Up to ``uncertainty_max`` (half a
    reward line) it is stated and decided; past it, a milestone reward is still decided where the speedups at both
    ends of that range earn the same one (a kernel well clear of every line), and refused otherwise, as is any
    continuous (``speedup``) reward. Memory-heavy calls, whose regions cannot grow long (``Plan.region_bytes``), are
    the ones this decides: a 2.8x kernel in 1.6 ms regions is not refused for a 5% uncertainty."""
    share = ((result.timing or {}).get("regions") or {}).get("uncertainty")
    if share is None or share <= setup.timing.uncertainty_max:
        return
    if setup.policy.reward == "milestone" and share < 1:
        ends = {speedup_reward(setup.policy, *(None if s is None else s * factor
                                               for s in (result.speedup_eager, result.speedup_compile)))
                for factor in (1 / (1 + share), 1 / (1 - share))}
        if len(ends) == 1:
            result.notes.append(f"the evaluator's clock's uncertainty ({share:.1%} of a region) is over "
                                f"{setup.timing.uncertainty_max:.1%}, but the reward is the same at both ends of it")
            return
    raise Stop("error", "profile", f"the evaluator's own clock cannot time these regions closely enough: its "
               f"uncertainty (how far the brackets' own cost, measured before the candidate's code loaded, may be off) "
               f"is {share:.1%} of a region (limit {setup.timing.uncertainty_max:.1%}), which could change the reward; "
               f"the host or GPU was busy with other work: evaluate again when it is quieter")
