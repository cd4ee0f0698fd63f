"""Many evaluations at once: a CPU pool compiles while one evaluator per device slot runs.

Builds never hold a GPU: a candidate takes a device slot only once it is
built, so GPUs never wait on nvcc.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Callable, Sequence

from cuda_agent.build import BuildResult
from cuda_agent.build.toolchain import visible_gpus
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate.evaluator import Evaluator, resolve_device
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.tasks import Task


def evaluate_many(
    pairs: Sequence[tuple[Task, Candidate]],
    device: str = "auto",
    *,
    gpus: Sequence[int] | None = None,
    slots: int = 1,
    build_workers: int | None = None,
    on_result: Callable[[int, EvalResult], None] | None = None,
    **options: Any,
) -> list[EvalResult]:
    """Evaluate ``pairs``; results come back in input order.

    On CUDA there is one evaluator per GPU in ``gpus`` (default: every visible
    GPU); on the CPU, ``slots`` evaluators run side by side. ``on_result`` is
    called as each one finishes (for progress and persistence).
    """
    device = resolve_device(device)
    if device == "cuda":
        indices = list(gpus) if gpus is not None else [int(g["index"]) for g in visible_gpus()] or [0]
    else:
        indices = [None] * max(1, slots)  # type: ignore[list-item]
    free: "queue.Queue[int | None]" = queue.Queue()
    for index in indices:
        free.put(index)
    evaluators = {index: Evaluator(device, gpu_index=index, **options) for index in set(indices)}
    builder = next(iter(evaluators.values()))
    results: list[EvalResult | None] = [None] * len(pairs)

    def run(position: int, built: BuildResult) -> None:
        index = free.get()
        try:
            task, candidate = pairs[position]
            result = evaluators[index].evaluate(task, candidate, build_result=built)
        finally:
            free.put(index)
        results[position] = result
        if on_result:
            on_result(position, result)

    workers = build_workers or max(1, (os.cpu_count() or 2) // 2)
    with ThreadPoolExecutor(max_workers=workers) as build_pool, ThreadPoolExecutor(max_workers=len(indices)) as run_pool:
        builds: dict[Future, int] = {build_pool.submit(builder.build, c): i for i, (_t, c) in enumerate(pairs)}
        runs = [run_pool.submit(run, builds[f], f.result()) for f in as_completed(builds)]
        for future in runs:
            future.result()
    return [r for r in results if r is not None]
