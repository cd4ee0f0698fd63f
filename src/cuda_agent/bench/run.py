"""A benchmark run: every solution of a set evaluated against its task, persisted as it goes.

A run directory holds ``run.json`` (what was asked: tasks, solutions, device,
policy) and ``results.jsonl``, one line per evaluated entry: the task, the
entry's path relative to the solution set and the evaluation core's full
record. A rerun with the same directory evaluates only the entries not yet in
``results.jsonl`` or recorded there as an ``error`` (no verdict: a busy host, or
harness trouble such as a reference out of memory: evaluated again); a rerun asking for something else is
refused, naming the difference. Reports are made from the directory (``bench.report``).

Without a baselines table, each evaluation times the baselines in rounds
interleaved with the candidate's (the evaluation core's default). A table measured
on this machine (``cuda-agent baselines``) seeds the core's cache and the run
takes its baselines from there (``TimingConfig(baselines="cached")``), so a run
over all of KernelBench times no eager or torch.compile baseline again; a table
from another GPU or software stack seeds keys that are never looked up.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.bench.baselines import read_table
from cuda_agent.bench.solutions import SolutionSet
from cuda_agent.evaluate.baseline import BaselineCache, baseline_key
from cuda_agent.evaluate.protocol.policy import Policy
from cuda_agent.jsonl import append_jsonl, read_jsonl
from cuda_agent.tasks.task import Task

__all__ = ["RUN_FORMAT", "results_path", "read_results", "read_run", "seed_baselines", "start_run", "run_bench",
           "without_verdict", "drop_errors", "AGENT_FINAL", "run_agent_bench"]

RUN_FORMAT = 1


def results_path(run_dir: Path) -> Path:
    return Path(run_dir) / "results.jsonl"


def read_results(run_dir: Path) -> list[dict[str, Any]]:
    """The run's rows; a half-written last line (a killed run) is dropped."""
    return read_jsonl(results_path(run_dir))


def read_run(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: not a benchmark run (no run.json); make one with `cuda-agent bench`.")
    return json.loads(path.read_text())


def seed_baselines(table: Path, cache_dir: Path, policy: Policy, device: str) -> int:
    """Put each row of a baselines table into the evaluation core's baseline cache under the key
    an evaluation would look up; the number of rows put. Rows of another policy are skipped."""
    cache = BaselineCache(Path(cache_dir) / "baselines")
    policy_dict = policy.to_dict()
    put = 0
    for row in read_table(table):
        if row.get("policy") != policy.name or not row.get("eager") or not row.get("environment"):
            continue
        key = baseline_key(row["digest"], row["environment"], policy_dict, row["timing"], device)
        record = {k: row[k] for k in ("eager", "compile", "compile_error", "compile_seconds") if row.get(k) is not None}
        cache.put(key, record | {"key": key})
        put += 1
    return put


def language_settings(language: str | None) -> dict[str, Any]:
    """What ``run.json`` records of the kernel language asked for: nothing for CUDA (runs from before
    languages were asked for continue unchanged), ``language`` otherwise."""
    return {} if language in (None, "cuda") else {"language": language}


def start_run(run_dir: Path, tasks: list[Task], solutions: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Write ``run.json``, or check that the one there asks for the same run. ``solutions`` says
    where they come from: a directory, or ``agent:MODEL``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"format": RUN_FORMAT, "solutions": solutions,
            "tasks": [{"name": t.name, "level": t.level, "problem_id": t.problem_id, "digest": t.digest} for t in tasks],
            **settings}
    path = run_dir / "run.json"
    if path.is_file():
        before = json.loads(path.read_text())
        changed = sorted(k for k in set(spec) | set(before) if spec.get(k) != before.get(k))
        if changed:
            raise ValueError(f"{run_dir} holds a run with other settings ({', '.join(changed)}); "
                             "continue it with the same ones, or give another --out.")
    else:
        path.write_text(json.dumps(spec, indent=1) + "\n")
    return spec


def run_bench(run_dir: Path, tasks: list[Task], solutions: SolutionSet, device: str, *,
              gpus: list[int] | None = None, evaluator_options: dict[str, Any] | None = None,
              settings: dict[str, Any] | None = None,
              progress: Callable[[int, int, dict[str, Any]], None] | None = None,
              evaluator: EvaluatorLike | None = None, concurrency: int = 1,
              language: str | None = None) -> list[dict[str, Any]]:
    """Evaluate every entry of ``solutions`` not yet in the run; the rows written now. With
    ``evaluator`` (an evaluation service's ``RemoteEvaluator``), ``concurrency`` evaluations are sent
    to it at once instead of running local evaluators. ``language``: every entry is read as a candidate
    in it (``cuda`` or ``triton``; None: each entry's own, read from its sources)."""
    from cuda_agent.candidates import CandidateError, load_candidate
    from cuda_agent.evaluate.pool import evaluate_many
    from cuda_agent.evaluate.result import EvalResult

    start_run(run_dir, tasks, str(solutions.root), settings or {})
    by_name = {t.name: t for t in tasks}
    done = {(r["task"]["name"], r["entry"]) for r in drop_errors(run_dir)}
    todo = [(name, path) for name, path in solutions.entries()
            if (name, str(path.relative_to(solutions.root))) not in done]
    lock = threading.Lock()
    written: list[dict[str, Any]] = []

    def write(row: dict[str, Any]) -> None:
        with lock:
            if not append_jsonl(results_path(run_dir), row):
                return  # a stopped command's killed workers are no entry's result
            written.append(row)
            if progress:
                progress(len(written), len(todo), row)

    pairs, entries = [], []
    for name, path in todo:
        entry = str(path.relative_to(solutions.root))
        task = by_name[name]
        try:
            pairs.append((task, load_candidate(path, language=language)))
            entries.append(entry)
        except CandidateError as exc:
            policy = (evaluator_options or {}).get("policy") or Policy()
            record = EvalResult.unloadable(task.to_dict(), str(path), device, policy.to_dict(), {}, str(exc))
            write({"entry": entry} | record.to_dict())
    if pairs and evaluator is not None:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            sent = {pool.submit(evaluator.evaluate, task, candidate): i for i, (task, candidate) in enumerate(pairs)}
            for future in as_completed(sent):
                write({"entry": entries[sent[future]]} | future.result().to_dict())
    elif pairs:
        evaluate_many(pairs, device, gpus=gpus, on_result=lambda i, result: write({"entry": entries[i]} | result.to_dict()),
                      **(evaluator_options or {}))
    return written


def without_verdict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of entries that ended without a verdict (status ``error``): counted apart from failures."""
    return [row for row in rows if row.get("status") == "error"]


def drop_errors(run_dir: Path) -> list[dict[str, Any]]:
    """The run's rows less its ``error`` ones, which are removed from the file so that they are
    evaluated again. An error is trouble on the harness's side (the reference ran out of memory or
    time, the machine was loaded), not a verdict on the solution, and may not recur; ``failed`` rows
    are the solution's own and stand."""
    rows = read_results(run_dir)
    kept = [row for row in rows if row.get("status") != "error"]
    if len(kept) < len(rows):
        path = results_path(run_dir)
        partial = path.with_suffix(".jsonl.tmp")
        partial.write_text("".join(json.dumps(row) + "\n" for row in kept))
        partial.replace(path)  # whole or not at all: an interrupted rewrite loses no row
    return kept


AGENT_FINAL = "agent/final"


def run_agent_bench(run_dir: Path, tasks: list[Task], make_backend: Callable[[], Any], device: str, *,
                    model: str, gpus: list[int] | None = None, evaluator_options: dict[str, Any] | None = None,
                    config: Any = None, sandbox: Any = "auto", settings: dict[str, Any] | None = None,
                    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
                    evaluator: EvaluatorLike | None = None, concurrency: int = 1) -> list[dict[str, Any]]:
    """Live: one agent episode per task not yet in the run, one evaluator (and episode) per GPU at a
    time. Each evaluation the agent asked for is a sample of the task (``agent/turn-N-verify``), the
    final fresh evaluation too (``agent/final``): the report takes the best, as the paper does. A
    task's rows are written together when its episode ends; its trajectory goes to
    ``trajectories.jsonl``. An episode cut off by an interruption is run again from the start. With
    ``evaluator`` (an evaluation service), ``concurrency`` episodes run at once, all evaluated there."""
    import shutil

    from cuda_agent.agent.loop import run_episode
    from cuda_agent.evaluate.evaluator import Evaluator, long_lived
    from cuda_agent.evaluate.pool import device_slots, drain

    start_run(run_dir, tasks, f"agent:{model}", settings or {})
    done = {r["task"]["name"] for r in read_results(run_dir) if r["entry"] == AGENT_FINAL}
    todo = [task for task in tasks if task.name not in done]
    lock = threading.Lock()
    written: list[dict[str, Any]] = []
    made: list[Evaluator] = []

    def setup(gpu: int | None) -> EvaluatorLike:
        if evaluator is not None:
            return evaluator
        # On a GPU machine, the processes of the agent's next evaluation start while it thinks.
        made.append(Evaluator(device, gpu_index=gpu, **(long_lived(device) | (evaluator_options or {}))))
        return made[-1]

    def episode_of(evaluator: EvaluatorLike, gpu: int | None, task: Task) -> None:
        workdir = Path(run_dir) / "episodes" / task.name.replace("/", "_")
        shutil.rmtree(workdir, ignore_errors=True)
        episode = run_episode(task, make_backend(), evaluator, workdir, config=config, model=model, sandbox=sandbox)
        rows = [{"entry": f"agent/turn-{e['turn']}-{e['command']}"} | e["result"] for e in episode.record["evaluations"]]
        rows.append({"entry": AGENT_FINAL} | episode.final)
        with lock:
            if not append_jsonl(Path(run_dir) / "trajectories.jsonl", episode.record):
                return  # a stopped command's killed workers are no task's episode
            append_jsonl(results_path(run_dir), *rows)  # the final row last: it marks the task done
            written.extend(rows)
            if progress:
                progress(len({r["task"]["name"] for r in written}), len(todo), rows[-1])

    try:
        drain(todo, [None] * max(1, concurrency) if evaluator is not None else device_slots(device, gpus), setup,
              episode_of)
    finally:
        for own in made:  # their kept references and started processes end with the run
            own.close()
    return written
