"""The evaluator's own clock on honest candidates: rewards, stability and what the clock leaves unseen.

    python benchmarks/clock_agreement.py --device cuda --kernelbench KB.jsonl --release RELEASE --repeats 3 --out rows.jsonl

Every honest solution found (the examples, tests/gpu/kernelbench_solutions, benchmarks/solutions_kb, and with
``--release`` the CUDA Agent release's own axpby workspace) is built (in parallel) and evaluated ``--repeats`` times
(after the first, warm). Each row keeps its status, reward, speedups and the clock's record
(``result.timing["regions"]``): the median region by the evaluator's clock, what the candidate's process reported
(``agreement``: their ratio), and the stated ``allowance``, ``uncertainty`` and ``resolution`` (shares of a region).
The summary is one Markdown row per solution: correct / evaluations, the rewards seen, the speedup's CV over the
evaluations, the largest allowance and uncertainty, and how many failed as ``clock``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.bench.solutions import task_of
from cuda_agent.tasks import load_tasks

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_DIRS = (ROOT / "tests" / "gpu" / "kernelbench_solutions", ROOT / "benchmarks" / "solutions_kb")


def honest_solutions(device: str, kernelbench: Path | None) -> list[tuple[str, object, Path]]:
    found = []
    for example in sorted((ROOT / "examples").iterdir()):
        if (example / "solution").is_dir() and example.name.startswith("cuda_" if device == "cuda" else "cpu_"):
            found.append((example.name, load_task(example / "model.py"), example / "solution"))
    if kernelbench is not None:
        tasks = {(t.level, t.problem_id): t for t in load_tasks(kernelbench)}
        for root in SOLUTION_DIRS:
            for folder in sorted(root.glob("level*")) if root.is_dir() else []:
                key = task_of(Path(folder.name))
                if folder.is_dir() and key in tasks and not folder.name.startswith("wrong"):
                    found.append((folder.name, tasks[key], folder))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--kernelbench", type=Path, default=None, help="kernelbench.jsonl (for the KernelBench solutions)")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--only", nargs="*", default=None, help="solution names to run")
    parser.add_argument("--skip", nargs="*", default=(), help="solution names to leave out")
    parser.add_argument("--release", type=Path, default=None,
                        help="the CUDA Agent release's agent_workdir (its axpby workspace is evaluated as it is)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per solution, appended as they finish")
    parser.add_argument("--repeats", type=int, default=1,
                        help="evaluations of each solution, one after another (after the first, warm): how often an "
                             "honest one is refused or failed, not just whether it was once")
    parser.add_argument("--region-memory-share", type=float, default=None,
                        help="TimingConfig.region_memory_share: the share of the GPU's memory a region's calls may keep "
                             "alive (longer regions for calls of gigabytes)")
    args = parser.parse_args()

    solutions = honest_solutions(args.device, args.kernelbench)
    if args.release is not None:
        solutions.insert(0, ("axpby", load_task(args.release / "model.py"), args.release))
    solutions = [s for s in solutions if (not args.only or s[0] in args.only) and s[0] not in args.skip]
    print(f"{len(solutions)} honest solutions", flush=True)
    cache = Path(tempfile.mkdtemp(prefix="cuda-agent-agreement-"))
    rows = []
    # No spare processes, no kept references: the largest tasks (6 GiB outputs) need the card to themselves.
    timing = TimingConfig() if args.region_memory_share is None else TimingConfig(
        region_memory_share=args.region_memory_share)
    with Evaluator(args.device, cache_dir=cache, time_compile=args.compile, timing=timing) as evaluator:
        candidates = {name: load_candidate(path) for name, _, path in solutions}
        with ThreadPoolExecutor(8) as pool:  # the builds in parallel, the evaluations one at a time
            builds = dict(zip(candidates, pool.map(evaluator.build, candidates.values())))
        for (name, task, _), repeat in ((solution, r) for solution in solutions for r in range(args.repeats)):
            result = evaluator.evaluate(task, candidates[name], builds[name])
            regions = result.timing.get("regions") or {}
            row = {
                "solution": name, "repeat": repeat, "task": task.name, "status": result.status, "reward": result.reward,
                "rule": result.rule, "reason": (result.reason or "")[:300],
                "candidate_ms": (result.times.get("candidate") or {}).get("median_ms"),
                "speedup_eager": result.speedup_eager, "regions": regions,
                "quiet_us": result.timing.get("quiet_us"),  # the longest quiet probe (evaluate.protocol.quiet)
                "attempts": result.attempts, "durations": result.durations,
                "plans": result.timing.get("plans"), "rounds": (result.decision or {}).get("rounds"),
                "device": result.environment.get("gpu") or platform.processor(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            rows.append(row)
            with open(args.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(f"{name:22s} {result.status:8s} reward {result.reward}  call {row['candidate_ms'] or 0:.4f} ms  "
                  f"x{result.speedup_eager or 0:.3f} eager  region {regions.get('outside_ms', 0):.3f} ms (reported "
                  f"{regions.get('reported_ms', 0):.3f})  allowance {regions.get('allowance', 0):.2%}  uncertainty "
                  f"{regions.get('uncertainty', 0):.2%}  resolution {regions.get('resolution', 0):.2%}  blind "
                  f"{regions.get('blind_ms', 0):.3f} ms  {row['rule'] or ''} {row['reason'][:120] if row['rule'] or result.status == 'error' else ''}",
                  flush=True)
    summary(rows)


def summary(rows: list[dict]) -> None:
    """One Markdown row per solution (module docstring)."""
    print("\n| solution | correct | rewards | call ms | speedup vs eager (CV) | allowance max | uncertainty max | "
          "agreement | clock |\n|---|---|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["solution"] for r in rows):
        mine = [r for r in rows if r["solution"] == name]
        done = [r for r in mine if r["status"] == "correct"]
        speedups = [r["speedup_eager"] for r in done if r["speedup_eager"]]
        regions = [r["regions"] for r in done if r["regions"]]
        print(f"| {name} | {len(done)}/{len(mine)} | {sorted(set(r['reward'] for r in mine), key=str)} | "
              f"{statistics.median(r['candidate_ms'] for r in done) if done else 0:.4f} | "
              f"{statistics.median(speedups) if speedups else 0:.3f} ({cv(speedups):.2%}) | "
              f"{max((g.get('allowance', 0) for g in regions), default=0):.2%} | "
              f"{max((g.get('uncertainty', 0) for g in regions), default=0):.2%} | "
              f"{statistics.median(g.get('agreement', 0) for g in regions) if regions else 0:.3f} | "
              f"{sum(r['rule'] == 'clock' for r in mine)} |", flush=True)


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


if __name__ == "__main__":
    sys.exit(main())
