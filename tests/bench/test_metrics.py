"""The paper's metrics on fixed inputs: failed, missing, degenerate and repeated tasks included."""

from __future__ import annotations

import math

import pytest

from cuda_agent.bench.metrics import TaskOutcome, best_of, geomean, metrics, per_task

TASKS = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2)]


def outcomes() -> list[TaskOutcome]:
    return [
        TaskOutcome(1, 1, "correct", 2.0, 1.5),
        TaskOutcome(1, 2, "correct", 1.02, 0.5),
        TaskOutcome(1, 2, "failed"),                       # a worse attempt at the same task
        TaskOutcome(1, 3, "incorrect"),
        # (1, 4) has no outcome: missing
        TaskOutcome(2, 1, "correct", 4.0, 1.06, degenerate=True),
        TaskOutcome(2, 1, "correct", 8.0, 1.04),           # faster vs eager, slower vs compile than the first
        TaskOutcome(2, 2, "error"),
    ]


def test_best_of_prefers_correct_then_compile_speedup_then_the_least_bad_status():
    table = per_task(outcomes(), TASKS)
    assert table[(1, 2)].status == "correct"
    assert table[(2, 1)].speedup_compile == 1.06 and table[(2, 1)].degenerate
    assert table[(1, 4)].status == "missing"
    assert best_of([TaskOutcome(3, 1, "error"), TaskOutcome(3, 1, "incorrect"), TaskOutcome(3, 1, "failed")]).status == "incorrect"
    with pytest.raises(ValueError):
        best_of([])


def test_level_and_overall_metrics():
    report = metrics(per_task(outcomes(), TASKS))
    one, two, overall = report["levels"]["1"], report["levels"]["2"], report["overall"]
    assert (one["tasks"], one["correct"], one["pass_rate"]) == (4, 2, 0.5)
    assert one["status"] == {"correct": 2, "incorrect": 1, "failed": 0, "error": 0, "missing": 1}
    assert one["faster_eager@1"] == 0.5 and one["faster_eager@1.05"] == 0.25   # 2.0 and 1.02 vs 1.05
    assert one["faster_compile@1"] == 0.25 and one["faster_compile@1.05"] == 0.25
    assert one["geomean_eager"] == pytest.approx(math.sqrt(2.0 * 1.02))
    assert one["geomean_compile"] == pytest.approx(math.sqrt(1.5 * 0.5))
    assert (two["tasks"], two["correct"], two["degenerate"]) == (2, 1, 1)
    assert two["faster_compile@1.05"] == 0.5
    # Overall pools the tasks: weighted by each level's task count, not a mean of the levels.
    assert overall["tasks"] == 6 and overall["pass_rate"] == pytest.approx(3 / 6)
    assert overall["faster_compile@1.05"] == pytest.approx(2 / 6)
    assert overall["geomean_eager"] == pytest.approx((2.0 * 1.02 * 4.0) ** (1 / 3))
    assert overall["fast_p_eager"]["0"] == pytest.approx(3 / 6) and overall["fast_p_eager"]["3"] == pytest.approx(1 / 6)


def test_degenerate_tasks_can_be_left_out():
    report = metrics(per_task(outcomes(), TASKS), exclude_degenerate=True)
    assert report["overall"]["tasks"] == 5 and report["levels"]["2"]["tasks"] == 1
    assert report["levels"]["2"]["pass_rate"] == 0.0 and report["levels"]["2"]["geomean_eager"] is None


def test_from_result_and_bad_input():
    result = {"task": {"name": "level1/19_ReLU", "level": 1, "problem_id": 19}, "status": "correct",
              "speedup_eager": 1.3, "speedup_compile": 0.9}
    outcome = TaskOutcome.from_result(result)
    assert outcome.key == (1, 19) and outcome.speedup_compile == 0.9
    with pytest.raises(ValueError, match="no KernelBench level"):
        TaskOutcome.from_result({"task": {"name": "x.py"}, "status": "correct"})
    with pytest.raises(ValueError, match="unknown status"):
        TaskOutcome(1, 1, "great")
    assert geomean([]) is None and geomean([0.0, -1.0]) is None and geomean([2.0, 8.0]) == pytest.approx(4.0)


def test_no_verdict_is_counted_apart_and_never_as_a_pass():
    table = {(1, 1): TaskOutcome(1, 1, "correct", 1.2, 1.1), (1, 2): TaskOutcome(1, 2, "error"),
             (1, 3): TaskOutcome(1, 3, "failed")}
    overall = metrics(table)["overall"]
    assert overall["no_verdict"] == 1 and overall["status"]["failed"] == 1 and overall["status"]["error"] == 1
    assert overall["pass_rate"] == pytest.approx(1 / 3)
