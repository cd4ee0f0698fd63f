"""Many evaluations at once: a CPU pool compiles while one evaluator per device slot runs.

Builds never hold a GPU: a candidate takes a device slot only once it is
built, so GPUs never wait on nvcc.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, Callable, Iterable, Sequence, TypeVar

from cuda_agent.build import BuildResult
from cuda_agent.build.toolchain import default_build_workers, visible_gpus
from cuda_agent.candidates import Candidate
from cuda_agent.evaluate.evaluator import Evaluator, long_lived, resolve_device
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.tasks import Task

T = TypeVar("T")
S = TypeVar("S")


def device_slots(device: str, gpus: Sequence[int] | None = None) -> list[int | None]:
    """The GPU indices to spread work over (``gpus``, default every visible GPU), or ``[None]``
    (the one CPU) off the GPU."""
    if device != "cuda":
        return [None]
    return list(gpus) if gpus else [int(g["index"]) for g in visible_gpus()] or [0]


def drain(items: Iterable[T], slots: Sequence[int | None], setup: Callable[[int | None], S],
          handle: Callable[[S, int | None, T], None], deadline_s: float | None = None) -> None:
    """Work through ``items`` with one thread per entry of ``slots`` (a slot may repeat): each thread
    calls ``setup(slot)`` once, then ``handle(state, slot, item)`` for every item it takes, until
    none is left or ``deadline_s`` has passed (items left then are not taken). An exception in a
    thread is raised here once every thread has ended."""
    todo: "queue.Queue[T]" = queue.Queue()
    for item in items:
        todo.put(item)
    started = time.monotonic()
    failures: list[BaseException] = []

    def work(slot: int | None) -> None:
        try:
            state = setup(slot)
            while deadline_s is None or time.monotonic() - started <= deadline_s:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    return
                handle(state, slot, item)
        except BaseException as exc:  # raised below: a thread's error must not vanish
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(slot,), daemon=True) for slot in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


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
    indices = device_slots(device, gpus) if device == "cuda" else [None] * max(1, slots)
    free: "queue.Queue[int | None]" = queue.Queue()
    for index in indices:
        free.put(index)
    evaluators = {index: Evaluator(device, gpu_index=index, **(long_lived(device) | options))
                  for index in set(indices)}
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

    workers = build_workers or default_build_workers()
    try:
        with ThreadPoolExecutor(max_workers=workers) as build_pool, ThreadPoolExecutor(max_workers=len(indices)) as run_pool:
            builds: dict[Future, int] = {build_pool.submit(builder.build, c): i for i, (_t, c) in enumerate(pairs)}
            runs = [run_pool.submit(run, builds[f], f.result()) for f in as_completed(builds)]
            for future in runs:
                future.result()
    finally:
        for evaluator in evaluators.values():
            evaluator.close()
    return [r for r in results if r is not None]
