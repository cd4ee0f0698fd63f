"""What the benchmark scripts share: the bundled examples of a device, and one timed evaluation."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Iterator

from cuda_agent import EvalResult, Evaluator, load_candidate, load_task

ROOT = Path(__file__).resolve().parents[1]


def examples(device: str, names: list[str] | None = None) -> Iterator[tuple[str, object, object]]:
    """(name, task, candidate) for the named examples, or every example of ``device``."""
    prefix = "cuda_" if device == "cuda" else "cpu_"
    for name in names or sorted(p.name for p in (ROOT / "examples").glob(prefix + "*")):
        yield name, load_task(ROOT / "examples" / name / "model.py"), load_candidate(ROOT / "examples" / name / "solution")


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
