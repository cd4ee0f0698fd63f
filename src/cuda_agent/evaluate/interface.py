"""What clients (the agent, bench, synth, train, a service) may use of an evaluator.

``Evaluator`` satisfies it; so must anything that stands in for one (a remote evaluator on a pool of
GPUs), and clients type their evaluator parameter with it so that they need nothing more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from cuda_agent.build import BuildResult
    from cuda_agent.candidates import Candidate
    from cuda_agent.evaluate.counters import CounterReport
    from cuda_agent.evaluate.protocol.degenerate import DegenerateReport
    from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
    from cuda_agent.evaluate.result import EvalResult
    from cuda_agent.tasks import Task


@runtime_checkable
class EvaluatorLike(Protocol):
    device: str  # "cuda" or "cpu"
    policy: "Policy"
    timing: "TimingConfig"

    def evaluate(self, task: "Task", candidate: "Candidate", build_result: "BuildResult | None" = None, *,
                 timed: bool = True) -> "EvalResult":
        """Build, verify, time and reward: the rewarded record."""

    def verify(self, task: "Task", candidate: "Candidate", build_result: "BuildResult | None" = None) -> "EvalResult":
        """Correctness only: no timing, no reward."""

    def build(self, candidate: "Candidate") -> "BuildResult":
        """Compile only."""

    def baseline(self, task: "Task", refresh: bool = False, degenerate: bool = False) -> dict[str, Any]:
        """Eager and torch.compile times of ``task`` (cached where they are)."""

    def check_degenerate(self, task: "Task", draws: int = 3) -> "DegenerateReport":
        """Which trivial candidates pass ``task``."""

    def counters(self, task: "Task", candidate: "Candidate", times: dict[str, float] | None = None) -> "CounterReport":
        """Hardware counters of one call of a correct candidate (advice for the agent, never a reward)."""

    def close(self) -> None:
        """Stop the processes kept for later evaluations."""
