"""What the benchmark scripts share: the bundled examples of a device, KernelBench tasks by solution folder, and
one timed evaluation."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Iterator

from cuda_agent import EvalResult, Evaluator, load_candidate, load_task
from cuda_agent.bench.solutions import task_of
from cuda_agent.tasks import load_tasks

ROOT = Path(__file__).resolve().parents[1]


def examples(device: str, names: list[str] | None = None) -> Iterator[tuple[str, object, object]]:
    """(name, task, candidate) for the named examples, or every example of ``device``."""
    prefix = "cuda_" if device == "cuda" else "cpu_"
    for name in names or sorted(p.name for p in (ROOT / "examples").glob(prefix + "*")):
        yield name, load_task(ROOT / "examples" / name / "model.py"), load_candidate(ROOT / "examples" / name / "solution")


def kernelbench_tasks(kernelbench: Path | None, names: list[str]) -> list[object]:
    """The KernelBench task of each solution folder name (``level1_20``), from ``kernelbench.jsonl``."""
    if kernelbench is None or not kernelbench.is_file():
        raise SystemExit(f"--kernelbench {kernelbench} is not a file; pass kernelbench.jsonl")
    tasks = {(t.level, t.problem_id): t for t in load_tasks(kernelbench)}
    missing = [name for name in names if task_of(Path(name)) not in tasks]
    if missing:
        raise SystemExit(f"{kernelbench} has no task for {', '.join(missing)}")
    return [tasks[task_of(Path(name))] for name in names]


def cv(values: list[float]) -> float:
    """Coefficient of variation (population): how far repeated measurements spread."""
    return statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def timed(evaluator: Evaluator, task, candidate) -> tuple[float, EvalResult]:
    """Seconds for one evaluation, and its result; a benchmark stops on anything but correct."""
    start = time.perf_counter()
    result = evaluator.evaluate(task, candidate)
    seconds = time.perf_counter() - start
    if result.status != "correct":
        raise SystemExit(f"{task.name}: {result.status}: {result.reason}\n{result.traceback or ''}{result.output}")
    return seconds, result
