"""How closely the evaluator's region brackets agree with the times honest candidates report (issue 31).

    python benchmarks/clock_agreement.py --device cuda --kernelbench KB.jsonl --out agreement.jsonl

Every honest solution found (the examples, tests/gpu/kernelbench_solutions, benchmarks/solutions_kb) is
built (in parallel) and evaluated once; each row keeps its status and reward and the brackets' verdict
(``result.timing["regions"]``): the agreement (median of bracket less the run-queue wait and the brackets'
calibrated cost, over the reported region; 1.0 when the clocks agree), the median excess against its limit,
and the bound on a forged time that follows: a report may fall short of the truth by at most
``limit - excess`` of a region before it fails as ``clock`` (as a share of the region: ``forgeable``).
torch.compile is not timed (``--compile`` to time it): the brackets are the candidate's alone.
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
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per solution, appended as they finish")
    parser.add_argument("--repeats", type=int, default=1,
                        help="evaluations of each solution, one after another (after the first, warm): how often an "
                             "honest one is refused or failed, not just whether it was once")
    args = parser.parse_args()

    solutions = [s for s in honest_solutions(args.device, args.kernelbench) if not args.only or s[0] in args.only]
    print(f"{len(solutions)} honest solutions", flush=True)
    cache = Path(tempfile.mkdtemp(prefix="cuda-agent-agreement-"))
    rows = []
    # No spare processes, no kept references: the largest tasks (6 GiB outputs) need the card to themselves.
    with Evaluator(args.device, cache_dir=cache, time_compile=args.compile) as evaluator:
        candidates = {name: load_candidate(path) for name, _, path in solutions}
        with ThreadPoolExecutor(8) as pool:  # the builds in parallel, the evaluations one at a time
            builds = dict(zip(candidates, pool.map(evaluator.build, candidates.values())))
        for (name, task, _), repeat in ((solution, r) for solution in solutions for r in range(args.repeats)):
            result = evaluator.evaluate(task, candidates[name], builds[name])
            regions = result.timing.get("regions") or {}
            reported = regions.get("reported_ms") or 0.0
            row = {
                "solution": name, "repeat": repeat, "task": task.name, "status": result.status, "reward": result.reward,
                "rule": result.rule, "reason": (result.reason or "")[:300],
                "candidate_ms": (result.times.get("candidate") or {}).get("median_ms"),
                "speedup_eager": result.speedup_eager, "regions": regions,
                "forgeable": regions.get("margin") if reported else None,
                "quiet_us": result.timing.get("quiet_us"),  # the longest quiet probe (evaluate.quiet)
                "device": result.environment.get("gpu") or platform.processor(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            rows.append(row)
            with open(args.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            print(f"{name:28s} {result.status:9s} reward {result.reward}  call {row['candidate_ms'] or 0:.4f} ms  "
                  f"region {reported:.3f} ms  agreement {regions.get('agreement', 0):.3f}  excess "
                  f"{regions.get('excess_ms', 0):+.4f} / limit {regions.get('limit_ms', 0):.4f} ms  forgeable "
                  f"{row['forgeable']}  spread {regions.get('spread_share', 0):.2f}  let-go cpu "
                  f"{regions.get('let_go_cpu_ms', 0):.3f} ms  after DONE {regions.get('after_done_ms', 0):.3f} "
                  f"({regions.get('after_done_excess_ms', 0):+.3f} / {regions.get('after_done_limit_ms', 0):.3f}) ms, "
                  f"blind {regions.get('blind_ms', 0):.3f} ms  waited {regions.get('waited_ms', 0):.3f}  quiet probe "
                  f"{row['quiet_us']} us",
                  flush=True)
    judged = [r for r in rows if r["regions"]]
    if judged:
        agreement = [r["regions"]["agreement"] for r in judged]
        forgeable = [r["forgeable"] for r in judged if r["forgeable"] is not None]
        print(f"\n{len(judged)} judged, {sum(r['status'] == 'correct' for r in rows)} correct, "
              f"{sum(r['rule'] == 'clock' for r in rows)} failed as clock; agreement median "
              f"{statistics.median(agreement):.3f} (min {min(agreement):.3f}, max {max(agreement):.3f}); forgeable "
              f"median {statistics.median(forgeable):.3f}, max {max(forgeable):.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
