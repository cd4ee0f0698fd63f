"""``cuda-agent optimize``: episodes on one task, the best verified solution, a report.

The output directory holds ``solution/`` (the best correct solution of all
episodes: ``model_new.py``, ``kernels/`` and the fixed binding files, ready to
build), ``report.md``, ``result.json`` (the best's evaluation record),
``trajectories.jsonl`` (one line per episode, appended as each ends) and
``episode-K/workspace`` (what each agent left). Episodes run concurrently
against one evaluator: builds and checks overlap, timings take turns.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from cuda_agent.evaluate.counters import CounterReport
from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.agent.llm import ChatBackend
from cuda_agent.agent.loop import AgentConfig, Episode, run_episode, save_solution
from cuda_agent.jsonl import append_jsonl
from cuda_agent.tasks.task import Task

__all__ = ["optimize", "best_episode", "write_outputs"]


def optimize(task: Task, make_backend: Callable[[], ChatBackend], out: Path, evaluator: EvaluatorLike, *,
             episodes: int = 1, config: AgentConfig | None = None, model: str = "", sandbox: Any = "auto",
             on_turn: Callable[[int, dict[str, Any]], None] | None = None) -> list[Episode]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if episodes < 1:
        raise ValueError(f"--episodes must be at least 1, not {episodes}.")
    taken = [d.name for d in out.glob("episode-*")]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(sorted(taken))}; give a fresh --out directory.")
    lock = threading.Lock()

    def one(k: int) -> Episode:
        episode = run_episode(task, make_backend(), evaluator, out / f"episode-{k}", config=config, model=model,
                              sandbox=sandbox, on_turn=(lambda entry: on_turn(k, entry)) if on_turn else None)
        with lock:
            append_jsonl(out / "trajectories.jsonl", episode.record | {"episode": k})
        return episode

    with ThreadPoolExecutor(max_workers=episodes) as pool:
        results = list(pool.map(one, range(episodes)))
    write_outputs(out, task, results)
    return results


def best_episode(results: list[Episode]) -> tuple[int, Episode] | None:
    scored = [(k, e) for k, e in enumerate(results) if e.best is not None]
    if not scored:
        return None
    return max(scored, key=lambda ke: ke[1].best.rank())


def write_outputs(out: Path, task: Task, results: list[Episode]) -> None:
    chosen = best_episode(results)
    lines = [f"# cuda-agent optimize: {task.name}", "",
             "| episode | turns | ended | final status | final reward | best reward | best x eager | best x compile |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    for k, e in enumerate(results):
        best = e.best.result if e.best else {}
        lines.append(f"| {k} | {len(e.record['turns'])} | {e.end_reason[:40]} | {e.final.get('status')} | "
                     f"{e.reward} | {e.best_reward} | {_x(best.get('speedup_eager'))} | {_x(best.get('speedup_compile'))} |")
    if chosen is None:
        lines += ["", "No episode reached a correct solution: see trajectories.jsonl (`cuda-agent show`)."]
    else:
        k, episode = chosen
        best = episode.best
        save_solution(best.files, out / "solution")
        (out / "result.json").write_text(json.dumps(best.result, indent=1) + "\n")
        times = best.result.get("times", {})
        lines += ["", f"## Best solution: episode {k}, {best.command} at turn {best.turn}", "",
                  f"Correct on {sum(1 for c in best.result.get('checks', []) if c.get('ok'))} checks "
                  f"(policy `{best.result.get('policy', {}).get('name')}`), reward {best.result.get('reward')}.", "",
                  "| | median ms |", "|---|---:|"]
        for which in ("candidate", "eager", "compile"):
            if which in times:
                lines.append(f"| {which} | {times[which]['median_ms']:.4f} |")
        lines += ["", f"Speedup: {_x(best.result.get('speedup_eager'))} vs eager, "
                      f"{_x(best.result.get('speedup_compile'))} vs torch.compile.", "",
                  "Use it: build `solution/` with `cuda-agent eval model.py solution/` (it verifies and times it "
                  "again), or import `ModelNew` from `solution/model_new.py` once `cuda_extension` is built."]
        if best.result.get("counters"):
            # What the agent last read of it through utils/profile.py: where the remaining time goes.
            lines += ["", "## Hardware counters of the best solution", "", "```",
                      CounterReport.from_dict(best.result["counters"]).text(), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
