"""The reward: the paper's milestone reward by default, raw speedup as an option."""

from __future__ import annotations

from cuda_agent.evaluate.protocol.policy import Policy


def milestone_reward(correct: bool, t: float | None, t_eager: float | None, t_compile: float | None, beat: float = 0.95) -> float:
    """-1 incorrect; 3 beats eager and compile; 2 beats eager only; 1 otherwise."""
    if not correct or t is None:
        return -1.0
    return milestone(t_eager is not None and t < beat * t_eager, t_compile is not None and t < beat * t_compile)


def milestone(beats_eager: bool, beats_compile: bool) -> float:
    """The milestone reward of a correct candidate: 3 beats both, 2 beats eager only, 1 otherwise."""
    if beats_eager and beats_compile:
        return 3.0
    if beats_eager:
        return 2.0
    return 1.0


def compute_reward(policy: Policy, correct: bool, t: float | None, t_eager: float | None, t_compile: float | None) -> float:
    if policy.reward == "speedup":
        if not correct or not t or not t_compile:
            return -1.0
        return t_compile / t
    return milestone_reward(correct, t, t_eager, t_compile, policy.beat_factor)
