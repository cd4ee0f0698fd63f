"""The reward, one rule on a correct candidate's speedups: the paper's milestone reward by default, the raw speedup
over torch.compile as an option. The verdict (``verdict``), the decision whether more rounds could change it
(``decide``) and the reward from times (``compute_reward``) all take it from ``speedup_reward``, ``beats`` and
``reward_line``."""

from __future__ import annotations

from cuda_agent.evaluate.protocol.policy import Policy


def reward_line(policy: Policy) -> float | None:
    """The speedup a baseline must be beaten by for a milestone ("faster" is ``t < beat_factor * t_baseline``);
    None for the raw-speedup reward, which has no line."""
    return 1 / policy.beat_factor if policy.reward == "milestone" else None


def beats(speedup: float | None, line: float | None) -> bool:
    """Whether a speedup (None: that baseline is unavailable) is past its line."""
    return speedup is not None and line is not None and speedup > line


def milestone(beats_eager: bool, beats_compile: bool) -> float:
    """The milestone reward of a correct candidate: 3 beats both, 2 beats eager only, 1 otherwise."""
    if beats_eager and beats_compile:
        return 3.0
    if beats_eager:
        return 2.0
    return 1.0


def speedup_reward(policy: Policy, speedup_eager: float | None, speedup_compile: float | None) -> float:
    """The reward of a correct candidate from its speedups over eager and torch.compile (None: not timed)."""
    if policy.reward == "speedup":
        return speedup_compile if speedup_compile else -1.0
    return milestone(beats(speedup_eager, reward_line(policy)), beats(speedup_compile, reward_line(policy)))


def _speedup(t_baseline: float | None, t: float) -> float | None:
    return None if t_baseline is None else t_baseline / t


def compute_reward(policy: Policy, correct: bool, t: float | None, t_eager: float | None, t_compile: float | None) -> float:
    """The reward from times (ms): -1 incorrect or untimed, else ``speedup_reward`` of their speedups."""
    if not correct or not t:
        return -1.0
    return speedup_reward(policy, _speedup(t_eager, t), _speedup(t_compile, t))


def milestone_reward(correct: bool, t: float | None, t_eager: float | None, t_compile: float | None, beat: float = 0.95) -> float:
    """-1 incorrect; 3 beats eager and compile; 2 beats eager only; 1 otherwise (``speedup_reward``'s milestone rule
    with ``beat`` for the policy's ``beat_factor``)."""
    return compute_reward(Policy(reward="milestone", beat_factor=beat), correct, t, t_eager, t_compile)
