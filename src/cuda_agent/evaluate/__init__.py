"""Evaluation core: a task and a candidate in; a verified, timed, rewarded record out."""

from cuda_agent.evaluate.evaluator import Evaluator, Timeouts, evaluate, long_lived, resolve_device
from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.reward import compute_reward, milestone_reward
from cuda_agent.evaluate.protocol.timing import TimingStats

__all__ = [
    "EvalResult",
    "Evaluator",
    "Policy",
    "Timeouts",
    "TimingConfig",
    "TimingStats",
    "compute_reward",
    "evaluate",
    "long_lived",
    "milestone_reward",
    "resolve_device",
]
