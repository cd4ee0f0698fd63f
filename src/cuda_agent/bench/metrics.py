"""The paper's KernelBench metrics, from per-task outcomes (pure arithmetic; no GPU).

Per level and overall (pooled over tasks, i.e. weighted by each level's task
count, as the paper does):

- ``pass_rate``: correct / tasks. Every task of the level counts in the
  denominator: a task with no solution or no verdict is not passed.
- ``no_verdict``: tasks whose best entry has no verdict (status ``error``: the
  evaluator could not decide, a busy host or a harness error): counted apart,
  never as the solution's failure; a rerun of the run evaluates them again.
- ``faster_eager@t`` / ``faster_compile@t``: share of *all* tasks that are correct
  and faster than the baseline by more than ``t`` (t = 1.0, and 1.05: the
  paper's reward threshold).
- ``geomean_eager`` / ``geomean_compile``: geometric mean speedup over the
  correct tasks that have that baseline.
- ``fast_p``: KernelBench's curve, the share of all tasks correct with speedup
  above ``p``, for a grid of ``p``.

A task evaluated several times (a trajectory) counts once, with its best
outcome (``best_of``). Tasks the evaluation core flags as degenerate are
counted and can be left out (``exclude_degenerate``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

STATUS_ORDER = ("correct", "incorrect", "failed", "error", "missing")  # best first
THRESHOLDS = (1.0, 1.05)
FAST_P_GRID = (0.0, 0.5, 0.8, 1.0, 1.05, 1.2, 1.5, 2.0, 3.0, 5.0)


@dataclass(frozen=True)
class TaskOutcome:
    level: int
    problem_id: int
    status: str  # one of STATUS_ORDER
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    degenerate: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUS_ORDER:
            raise ValueError(f"unknown status {self.status!r}; use one of {', '.join(STATUS_ORDER)}.")

    @property
    def key(self) -> tuple[int, int]:
        return (self.level, self.problem_id)

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    @classmethod
    def from_result(cls, result: dict[str, Any], degenerate: bool = False) -> "TaskOutcome":
        """From an ``EvalResult.to_dict()`` of a KernelBench task."""
        task = result["task"]
        if task.get("level") is None or task.get("problem_id") is None:
            raise ValueError(f"result for {task.get('name')!r} has no KernelBench level/problem_id")
        return cls(int(task["level"]), int(task["problem_id"]), result["status"],
                   result.get("speedup_eager"), result.get("speedup_compile"), degenerate, task.get("name", ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_of(outcomes: Iterable[TaskOutcome]) -> TaskOutcome:
    """The best of several outcomes of one task: a correct one with the largest speedup over
    torch.compile (then eager), else the least bad status."""
    items = list(outcomes)
    if not items:
        raise ValueError("best_of needs at least one outcome")

    def rank(o: TaskOutcome) -> tuple[int, float, float]:
        return (-STATUS_ORDER.index(o.status), o.speedup_compile or 0.0, o.speedup_eager or 0.0)

    return max(items, key=rank)


def per_task(outcomes: Iterable[TaskOutcome], tasks: Iterable[tuple[int, int]]) -> dict[tuple[int, int], TaskOutcome]:
    """One outcome per task of ``tasks`` (level, problem_id): the best one seen, ``missing`` where none."""
    seen: dict[tuple[int, int], list[TaskOutcome]] = {}
    for outcome in outcomes:
        seen.setdefault(outcome.key, []).append(outcome)
    table = {}
    for key in tasks:
        table[key] = best_of(seen[key]) if key in seen else TaskOutcome(key[0], key[1], "missing")
    return table


def geomean(values: list[float]) -> float | None:
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def fast_p(outcomes: list[TaskOutcome], baseline: str, grid: Iterable[float]) -> list[float | None]:
    """KernelBench's fast_p at each ``p`` of ``grid``: the share of all ``outcomes`` that are
    correct with a speedup over ``baseline`` (eager or compile) above ``p``."""
    speedups = [getattr(o, f"speedup_{baseline}") for o in outcomes if o.correct]
    n = len(outcomes)
    return [sum(s is not None and s > p for s in speedups) / n if n else None for p in grid]


def summarize(outcomes: list[TaskOutcome], thresholds: tuple[float, ...] = THRESHOLDS,
              grid: tuple[float, ...] = FAST_P_GRID) -> dict[str, Any]:
    """The metrics of one group of tasks (each task once)."""
    n = len(outcomes)
    correct = [o for o in outcomes if o.correct]
    row: dict[str, Any] = {"tasks": n, "correct": len(correct), "pass_rate": len(correct) / n if n else None,
                           "degenerate": sum(o.degenerate for o in outcomes),
                           "no_verdict": sum(o.status == "error" for o in outcomes),
                           "status": {s: sum(o.status == s for o in outcomes) for s in STATUS_ORDER}}
    for baseline in ("eager", "compile"):
        speedups = [getattr(o, f"speedup_{baseline}") for o in correct]
        for t in thresholds:
            row[f"faster_{baseline}@{t:g}"] = sum(s is not None and s > t for s in speedups) / n if n else None
        row[f"geomean_{baseline}"] = geomean([s for s in speedups if s is not None])
        row[f"fast_p_{baseline}"] = dict(zip((f"{p:g}" for p in grid), fast_p(outcomes, baseline, grid)))
    return row


def metrics(table: dict[tuple[int, int], TaskOutcome], exclude_degenerate: bool = False) -> dict[str, Any]:
    """Per level and overall; ``table`` from ``per_task``."""
    outcomes = [o for o in table.values() if not (exclude_degenerate and o.degenerate)]
    levels = sorted({o.level for o in outcomes})
    report = {"levels": {str(level): summarize([o for o in outcomes if o.level == level]) for level in levels}}
    report["overall"] = summarize(outcomes)
    report["exclude_degenerate"] = exclude_degenerate
    return report
