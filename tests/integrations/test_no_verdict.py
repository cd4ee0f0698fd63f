"""An evaluation without a verdict is no reward in every consumer's own convention, never the failure reward:
``score_reply``, TRL's reward function, verl's reward, OpenEnv's single-turn step, our training stages' metrics.
A scripted evaluator answers each evaluation with no verdict (the host busy while timing)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cuda_agent.evaluate.protocol.policy import Policy, TimingConfig
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.train.episodes import EpisodeOutcome
from cuda_agent.train.single_turn import FAILURE_REWARD, score_reply
from cuda_agent.train.stages import episode_metrics

BUSY_REASON = "the host was busy with other work while the baselines were timed: evaluate again when the host is quieter"


class UndecidedEvaluator:
    """An ``EvaluatorLike`` whose every evaluation has no verdict, after the given attempts."""

    device = "cpu"
    policy = Policy()
    timing = TimingConfig().resolved("cpu")

    def __init__(self, attempts: int = 3):
        self.attempts, self.calls = attempts, 0

    def evaluate(self, task, candidate, build_result=None, *, timed=True):
        self.calls += 1
        return EvalResult(task=task.to_dict(), candidate=candidate.to_dict(), device="cpu", policy={}, timing={},
                          status="error", stage="profile", reason=BUSY_REASON, reward=None, attempts=self.attempts,
                          compiled=True, correct=True)


def reply_text(examples: Path) -> str:
    solution = examples / "cpu_swish" / "solution"
    files = [solution / "model_new.py", *sorted((solution / "kernels").iterdir())]
    return "\n".join(f"### {f.relative_to(solution)}\n```\n{f.read_text()}\n```" for f in files)


def test_score_reply_gives_no_reward_and_says_why(task, examples, tmp_path):
    outcome = score_reply(task, reply_text(examples), UndecidedEvaluator(), tmp_path)
    assert outcome.reward is None and outcome.reward != FAILURE_REWARD and outcome.no_verdict
    assert "no verdict (busy after 3 attempts)" in outcome.reason and "evaluate again" in outcome.reason


def test_trl_reward_function_returns_none_for_the_sample_and_counts_it(task, examples):
    pytest.importorskip("trl")
    from cuda_agent.integrations.core import task_columns
    from cuda_agent.integrations.trl import KernelReward

    evaluator = UndecidedEvaluator()
    reward = KernelReward(evaluator=evaluator, workers=1)
    columns = {k: [v, v] for k, v in task_columns(task).items()}
    # A group's two samples with the same reply: evaluated once, both without a reward.
    assert reward(["p", "p"], [reply_text(examples)] * 2, **columns) == [None, None] and evaluator.calls == 1
    assert reward.no_verdict == 2 and "evaluate again" in reward.reasons[0]


def test_verl_reward_is_a_number_that_is_not_the_failure_and_flags_it(task, examples):
    from cuda_agent.train.verl.reward import NO_VERDICT_SCORE, compute_score
    from cuda_agent.train.verl.data import task_row

    score = compute_score("kernelbench", reply_text(examples), None, task_row(task, 0)["extra_info"],
                          evaluator=UndecidedEvaluator())
    assert score == {"score": NO_VERDICT_SCORE, "acc": 0.0, "no_verdict": 1.0} and score["score"] != FAILURE_REWARD


def test_openenv_single_turn_step_has_no_reward_and_the_reason(task, examples):
    pytest.importorskip("openenv")
    from cuda_agent.integrations.core import EvaluatorOptions
    from cuda_agent.integrations.openenv import KernelReplyEnv, ReplyAction

    env = KernelReplyEnv([task], EvaluatorOptions(evaluator=UndecidedEvaluator()))
    env.reset(task=task.name)
    observation = env.step(ReplyAction(reply=reply_text(examples)))
    assert observation.done and observation.reward is None and observation.metadata["no_verdict"]
    assert "evaluate again" in observation.metadata["reason"] and env.state.reward is None
    assert "evaluate again" in env.state.reason


def test_openenv_mcp_finish_has_no_reward_and_the_reason(task, examples):
    """The OpenEnv package's environment: a tool call's feedback says nothing was evaluated yet; ``finish`` on a
    workspace whose closing evaluation has no verdict ends the episode with no reward and the reason."""
    pytest.importorskip("openenv")
    from openenv.core.env_server.mcp_types import CallToolAction

    from cuda_agent.integrations.core import EvaluatorOptions
    from cuda_agent.integrations.openenv import FINISH, KernelToolEnv

    from integration_setup import SANDBOX

    env = KernelToolEnv([task], EvaluatorOptions(evaluator=UndecidedEvaluator(), sandbox=SANDBOX))
    try:
        opened = env.reset(task=task.name)
        assert FINISH in {t["function"]["name"] for t in opened.tools}
        read = env.step(CallToolAction(tool_name="read", arguments={"path": "model.py"}))
        assert not read.done and read.feedback == [] and read.error is None
        closed = env.step(CallToolAction(tool_name=FINISH))
        assert closed.done and closed.reward is None and closed.metadata["no_verdict"]
        assert "evaluate again" in closed.metadata["reason"] and env.state.reward is None and env.state.done
    finally:
        env.close()


def test_training_metrics_leave_a_no_verdict_out_and_count_it():
    outcomes = [EpisodeOutcome("a", 1.0, [], "correct"), EpisodeOutcome("b", None, [], "error"),
                EpisodeOutcome("c", -1.0, [], "incorrect")]
    line = episode_metrics(outcomes)
    assert line["episodes"] == 3 and line["no_verdict"] == 1
    assert line["reward_mean"] == 0.0 and line["pass_rate"] == 0.5 and not math.isnan(line["reward_mean"])
