"""The baselines table: eager and torch.compile times of every task on this GPU and software stack.

Published times differ from machine to machine (and from torch version to
version) by up to 8.7x on some KernelBench problems, so speedups are only
meaningful against baselines measured here. ``measure_baselines`` times each
task once with the evaluation core (the same cache and timing method that
evaluations use), checks whether it is degenerate, and appends one JSON line per
task as it finishes; a rerun skips the tasks already in the file (timed by the
same method), so a table can be built over several device calls or sessions. With several GPUs, one
evaluator per GPU works through a shared queue.

``compare_published`` sets the table next to KernelBench's published H100 times:
Spearman rank correlation and the tasks whose ratio to the H100 time is
furthest from the typical ratio.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.jsonl import append_jsonl, read_jsonl
from cuda_agent.tasks.task import Task, TaskError

__all__ = ["TABLE_FORMAT", "task_key", "read_table", "incomplete", "to_measure", "measure_baselines", "load_published",
           "spearman", "compare_published", "PUBLISHED_FILES", "render_table_report"]

TABLE_FORMAT = 1


def task_key(task: Task) -> str:
    return task.digest[:16]


def read_table(path: Path) -> list[dict[str, Any]]:
    """Rows of a baselines table, the latest per task (a retried task is appended again); a
    half-written last line (a killed run) is dropped."""
    latest: dict[str, dict[str, Any]] = {}
    for row in read_jsonl(Path(path)):
        latest.pop(row["key"], None)  # re-inserted: the order is that of the latest rows
        latest[row["key"]] = row
    return list(latest.values())


def incomplete(row: dict[str, Any]) -> bool:
    """A row to measure again: the task could not be timed, or the degenerate check could not run
    (on a shared GPU, most often out of memory)."""
    return "error" in row or "degenerate_error" in row


def to_measure(tasks: list[Task], out: Path, timing: Any, device: str) -> list[Task]:
    """The tasks of ``tasks`` that ``out`` has no complete row for, timed by ``timing`` (a
    ``TimingConfig``). A row timed by another method is timed again, since its time means something
    else; it stays in the file until the new row supersedes it."""
    from cuda_agent.evaluate.baseline import baseline_timing

    wanted = baseline_timing(timing.to_dict(), device)
    done = {row["key"] for row in read_table(out)
            if not incomplete(row) and baseline_timing(row.get("timing") or {}, device) == wanted}
    return [task for task in tasks if task_key(task) not in done]


def measure_baselines(tasks: list[Task], out: Path, device: str = "cuda", gpus: list[int] | None = None,
                      per_gpu: int = 1, degenerate: bool = True, evaluator_options: dict[str, Any] | None = None,
                      progress: Callable[[int, int, dict[str, Any]], None] | None = None,
                      deadline_s: float | None = None) -> list[dict[str, Any]]:
    """Time every task not yet in ``out`` (JSONL), and again those whose row is ``incomplete``;
    the rows written now. ``gpus``: indices to
    spread over (default: every visible GPU; ignored on the CPU). ``per_gpu``: tasks in flight
    per GPU; they load and torch.compile at once but time one at a time (a lock per GPU), which
    hides compile times of tens of seconds. ``deadline_s``: stop taking new tasks after this many
    seconds (a device call's time limit), leaving the rest for a rerun."""
    from cuda_agent.evaluate.evaluator import Evaluator
    from cuda_agent.evaluate.protocol.policy import TimingConfig
    from cuda_agent.evaluate.pool import device_slots, drain

    if per_gpu < 1:
        raise ValueError(f"per_gpu must be at least 1, not {per_gpu}.")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = to_measure(tasks, out, (evaluator_options or {}).get("timing") or TimingConfig(), device)
    slots = device_slots(device, gpus)
    lock = threading.Lock()
    timing_locks = {gpu: threading.Lock() for gpu in slots}
    written: list[dict[str, Any]] = []

    def setup(gpu: int | None) -> Evaluator:
        return Evaluator(device, gpu_index=gpu, timing_lock=timing_locks[gpu], **(evaluator_options or {}))

    def measure(evaluator: EvaluatorLike, gpu: int | None, task: Task) -> None:
        row = _measure_one(evaluator, task, degenerate)
        row.update(gpu_index=gpu, per_gpu=per_gpu)
        with lock:
            if not append_jsonl(out, row):
                return  # a stopped command's killed workers are no task's baselines
            written.append(row)
            if progress:
                progress(len(written), len(todo), row)

    drain(todo, [gpu for gpu in slots for _ in range(per_gpu)], setup, measure, deadline_s)
    return written


def _measure_one(evaluator: Any, task: Task, degenerate: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"format": TABLE_FORMAT, "key": task_key(task), "digest": task.digest, "name": task.name,
                           "level": task.level, "problem_id": task.problem_id, "policy": evaluator.policy.name,
                           "timing": evaluator.timing.to_dict()}
    clock = time.monotonic()
    try:
        # One reference process for both: the check costs no second start-up and task load.
        record = evaluator.baseline(task, degenerate=degenerate)
    except TaskError as exc:
        return row | {"error": str(exc)[:1000], "seconds": round(time.monotonic() - clock, 2)}
    row.update(environment=record["environment"], eager=record.get("eager"), compile=record.get("compile"),
               compile_error=record.get("compile_error"), compile_seconds=record.get("compile_seconds"),
               notes=record.get("notes", []), cached=record["cached"], durations=record.get("durations"))
    row["eager_ms"] = (record.get("eager") or {}).get("median_ms")
    row["compile_ms"] = (record.get("compile") or {}).get("median_ms")
    if "degenerate" in record:
        row["degenerate"] = record["degenerate"].degenerate
        row["degenerate_by"] = record["degenerate"].passing
    elif "degenerate_error" in record:
        row["degenerate_error"] = record["degenerate_error"][:500]
    row["seconds"] = round(time.monotonic() - clock, 2)
    return row


# -- comparison with published times --------------------------------------------------------------

def load_published(path: Path) -> dict[tuple[int, str], float]:
    """KernelBench's published times: {(level, problem file stem): mean ms}."""
    data = json.loads(Path(path).read_text())
    table = {}
    for level_name, problems in data.items():
        if not level_name.startswith("level"):
            continue
        level = int(level_name.removeprefix("level"))
        for filename, stats in problems.items():
            table[(level, filename.removesuffix(".py"))] = float(stats["mean"])
    return table


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's r of the ranks, ties averaged)."""
    if len(a) != len(b) or len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else None


def compare_published(rows: list[dict[str, Any]], published: dict[tuple[int, str], float], which: str = "eager_ms",
                      top: int = 10) -> dict[str, Any]:
    """Our times (``which``: eager_ms or compile_ms) next to published ones."""
    pairs = []
    for row in rows:
        ours = row.get(which)
        stem = str(row.get("name", "")).split("/")[-1]
        theirs = published.get((row.get("level"), stem))
        if ours and theirs and ours > 0 and theirs > 0:
            pairs.append((row, ours, theirs))
    if not pairs:
        return {"matched": 0}
    ratios = sorted(o / t for _, o, t in pairs)
    median = ratios[len(ratios) // 2]
    outliers = sorted(pairs, key=lambda p: -abs(math.log((p[1] / p[2]) / median)))[:top]
    return {
        "matched": len(pairs), "spearman": spearman([o for _, o, _ in pairs], [t for _, _, t in pairs]),
        "median_ratio": median,
        "disagreements": [{"name": r["name"], "ours_ms": o, "published_ms": t, "ratio": o / t,
                           "vs_typical": (o / t) / median} for r, o, t in outliers],
    }


PUBLISHED_FILES = {"eager_ms": "h100_sxm_baseline_time_torch.json",
                   "compile_ms": "h100_sxm_baseline_time_torch_compile_inductor_default.json"}


def render_table_report(rows: list[dict[str, Any]], published_dir: Path | None = None) -> str:
    """Markdown: what was measured where, per level, and the comparison with the published H100 times."""
    measured = [r for r in rows if r.get("eager_ms")]
    env = next((r["environment"] for r in measured if r.get("environment")), {})
    lines = ["# Baselines", "",
             f"{len(measured)} tasks timed ({sum('error' in r for r in rows)} errors) on {env.get('gpu') or env.get('cpu', '?')}"
             f" (driver {env.get('driver', '-')}, torch {env.get('torch', '?')}, CUDA {env.get('torch_cuda', '-')}), "
             f"policy `{rows[0].get('policy') if rows else '?'}`, timing `{(rows[0].get('timing') or {}).get('method') if rows else '?'}`.",
             "", "| level | tasks | median eager ms | median compile ms | compile failed | degenerate |",
             "|---|---:|---:|---:|---:|---:|"]
    for level in sorted({r.get("level") for r in measured if r.get("level") is not None}):
        group = [r for r in measured if r.get("level") == level]
        eager = sorted(r["eager_ms"] for r in group)
        compiled = sorted(r["compile_ms"] for r in group if r.get("compile_ms"))
        compile_median = f"{compiled[len(compiled) // 2]:.3g}" if compiled else "-"
        lines.append(f"| {level} | {len(group)} | {eager[len(eager) // 2]:.3g} | {compile_median} | "
                     f"{sum(bool(r.get('compile_error')) for r in group)} | {sum(bool(r.get('degenerate')) for r in group)} |")
    degenerate = [r for r in measured if r.get("degenerate")]
    if degenerate:
        lines += ["", "## Degenerate tasks", "",
                  "A trivial candidate passes these under the policy's tolerance: a solution's reward there says "
                  "little about kernel work.", "", "| task | passed by |", "|---|---|"]
        lines += [f"| {r['name']} | {', '.join(r.get('degenerate_by') or [])} |" for r in degenerate]
    unchecked = [r for r in rows if incomplete(r)]
    if unchecked:
        lines += ["", f"{len(unchecked)} tasks to measure again (a rerun retries them): "
                  + ", ".join(r["name"] for r in unchecked[:20])]
    if published_dir is not None:
        for which, filename in PUBLISHED_FILES.items():
            path = Path(published_dir) / filename
            if not path.exists():
                continue
            result = compare_published(measured, load_published(path), which)
            if not result.get("matched"):
                continue
            lines += ["", f"## {which.removesuffix('_ms')} vs the published H100 times ({filename})", "",
                      f"{result['matched']} tasks matched; Spearman rank correlation {result['spearman']:.3f}; "
                      f"typical ratio ours/H100 {result['median_ratio']:.3f}.", "",
                      "| task | ours ms | H100 ms | ratio | vs typical |", "|---|---:|---:|---:|---:|"]
            for d in result["disagreements"]:
                lines.append(f"| {d['name']} | {d['ours_ms']:.4g} | {d['published_ms']:.4g} | {d['ratio']:.3g} | "
                             f"{d['vs_typical']:.3g}x |")
    return "\n".join(lines) + "\n"
