"""An evaluation without a verdict for a busy host is tried again within a bounded budget; nothing else is."""

import re
from pathlib import Path

import pytest

from cuda_agent.evaluate.result import BUSY, BUSY_PHRASE, HARNESS, EvalResult, no_reward_reason, no_verdict_kind
from cuda_agent.evaluate.retry import RetryPolicy, wait_for_quiet, with_retries

SRC = Path(__file__).resolve().parents[2] / "src" / "cuda_agent"
BUSY_REASON = "the host was busy with other work while the baselines were timed: evaluate again when the host is quieter"


def record(status: str, reason: str | None = None, reward: float | None = None) -> EvalResult:
    return EvalResult(task={"name": "t"}, candidate={}, device="cpu", policy={}, timing={}, status=status,
                      reason=reason, reward=reward)


def run(results: list[EvalResult], policy: RetryPolicy = RetryPolicy(attempts=3)) -> tuple[EvalResult, int, list]:
    calls, waits = [0], []

    def attempt() -> EvalResult:
        calls[0] += 1
        return results[calls[0] - 1]

    def wait(policy: RetryPolicy, number: int) -> tuple[float, float | None]:
        waits.append(number)
        return 0.0, 0.05

    return with_retries(attempt, policy, wait=wait), calls[0], waits


def test_a_busy_no_verdict_is_evaluated_again_until_it_has_a_verdict():
    result, calls, waits = run([record("error", BUSY_REASON), record("correct", reward=1.0)])
    assert (result.status, result.reward, result.attempts, calls, waits) == ("correct", 1.0, 2, 2, [1])
    assert result.notes[0].startswith("attempt 1 had no verdict") and "retry_wait" in result.durations


@pytest.mark.parametrize("first", [record("correct", reward=3.0), record("incorrect", "wrong", -1.0),
                                   record("failed", "build failed", -1.0),
                                   record("error", "reference process: the shared memory did not arrive")])
def test_a_verdict_or_a_harness_error_is_never_retried(first):
    result, calls, waits = run([first, record("correct", reward=1.0)])
    assert result is first and calls == 1 and waits == [] and result.attempts == 1


def test_the_budget_bounds_the_attempts_and_the_last_no_verdict_stands():
    result, calls, waits = run([record("error", BUSY_REASON)] * 5, RetryPolicy(attempts=3))
    assert (result.status, result.reward, result.attempts, calls, waits) == ("error", None, 3, 3, [1, 2])
    assert result.no_verdict and result.no_verdict_kind == BUSY
    assert "after 3 attempts" in no_reward_reason(result.to_dict())
    assert "reward: none (no verdict)" in result.summary() and "evaluate again" in result.summary()


def test_one_attempt_policy_never_waits():
    result, calls, waits = run([record("error", BUSY_REASON), record("correct", reward=1.0)], RetryPolicy.none())
    assert calls == 1 and waits == [] and result.attempts == 1


def test_the_wait_is_the_backoff_then_quiet_windows_up_to_the_ceiling():
    slept, seen = [], iter([0.9, 0.6, 0.05])
    waited, share = wait_for_quiet(RetryPolicy(backoff_s=2.0, backoff_max_s=60.0, quiet_share=0.1), 2,
                                   sleep=slept.append, pressure=lambda: next(seen))
    assert slept == [4.0] and share == 0.05  # 2 s doubled for the second retry; quiet on the third window
    assert RetryPolicy(backoff_s=2.0, backoff_max_s=5.0).backoff(4) == 5.0


@pytest.mark.parametrize("bad", [{"attempts": 0}, {"backoff_s": -1}, {"quiet_share": 0}])
def test_a_retry_policy_out_of_range_is_refused(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_every_refusal_for_a_busy_host_is_told_apart_by_its_phrase():
    """The evaluator's refusals for other work on the host or GPU say "evaluate again"; the retry and every
    consumer tell a busy host from a harness error by it. Every such Stop in the sources carries the phrase, and
    only no-verdicts (status error) are classed at all."""
    found = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r'Stop\("error",', text):
            call = text[match.start():match.start() + 700].split("Stop(", 2)[1]  # up to the next Stop
            if "evaluate again" in call.split("\n\n")[0]:
                found.append(path.name)
    assert {"rounds.py", "watchers.py", "quiet.py"} <= set(found), found
    assert no_verdict_kind("error", f"... {BUSY_PHRASE} when it is quieter") == BUSY
    assert no_verdict_kind("error", "the toolchain probe extension does not build") == HARNESS
    assert no_verdict_kind("failed", f"... {BUSY_PHRASE}") is None and no_verdict_kind("correct", None) is None
