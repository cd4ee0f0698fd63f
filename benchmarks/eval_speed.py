"""Seconds per evaluation (cold build, cached build, cached baselines) and the
repeat-measurement spread of the speedup.

    python benchmarks/eval_speed.py --device cuda --out results.json

For each example, one long-lived evaluator (``prestart``, as the agent and bench use):
(1) cold: empty cache, so build + baselines + verify + profile; (2) cached build,
baselines re-measured; (3) everything cached, right after the previous evaluation
(its processes still starting); (4) everything cached after ``--gap`` seconds (the
processes started and idle, as after an agent's turn), ``--repeats`` times: the
target is <= 5 s end to end; the CV of these speedups is the spread a user of the
cache sees (target <= 2% for kernels of 0.5 ms and longer). (5) ``--remeasured``
evaluations with the baselines re-measured each time: the spread of the whole
protocol, baselines included. Rows are appended to ``--out`` as they finish.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from common import cv, examples, timed

from cuda_agent import Evaluator, Policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--examples", nargs="*", default=None, help="example folder names (default: all of the device's)")
    parser.add_argument("--repeats", type=int, default=5, help="evaluations with everything cached")
    parser.add_argument("--remeasured", type=int, default=5, help="evaluations with the baselines re-measured")
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between evaluations in (4)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument("--outside-inputs", default=None, choices=("cpu", "all", "off"),
                        help="Policy.outside_inputs (default: the policy's own; leave out for trees without it)")
    args = parser.parse_args()
    policy = {} if args.outside_inputs is None else {"policy": Policy().with_(outside_inputs=args.outside_inputs)}

    rows = []
    for name, task, candidate in examples(args.device, args.examples):
        cache = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-"))
        with Evaluator(args.device, cache_dir=cache, prestart=True, **policy) as evaluator:
            cold, first = timed(evaluator, task, candidate)
            shutil.rmtree(cache / "baselines", ignore_errors=True)
            cached_build, _ = timed(evaluator, task, candidate)
            back_to_back, _ = timed(evaluator, task, candidate)
            warm = [repeat(evaluator, task, candidate, args.gap) for _ in range(args.repeats)]
            remeasured = []
            for _ in range(args.remeasured):
                shutil.rmtree(cache / "baselines", ignore_errors=True)
                remeasured.append(repeat(evaluator, task, candidate, 0.0))
        last = warm[-1]["result"]
        row = {
            "example": name,
            "eager_ms": last.times["eager"]["median_ms"],
            "compile_ms": last.times["compile"]["median_ms"],
            "seconds_cold": cold,
            "build_seconds_cold": first.build["seconds"],
            "seconds_cached_build": cached_build,
            "seconds_all_cached_back_to_back": back_to_back,
            "seconds_all_cached_warm": [w["seconds"] for w in warm],
            "durations_all_cached_warm": [w["result"].durations for w in warm],
            "cached": summary(warm),
            "remeasured": summary(remeasured) if remeasured else None,
            "reward": last.reward,
            "notes": last.notes,
        }
        rows.append(row)
        shutil.rmtree(cache, ignore_errors=True)
        print(json.dumps(row), file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps(report(rows, last, args), indent=1))

    print("\n| example | cand ms | eager ms | compile ms | cold s | cached build s | all cached s (back to back) | "
          "all cached s (warm, median) | CV vs eager / compile (cached) | CV vs eager / compile (re-measured) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, m = r["cached"], r["remeasured"] or {}
        print(f"| {r['example']} | {c['candidate_ms']:.3f} | {r['eager_ms']:.3f} | {r['compile_ms']:.3f} | "
              f"{r['seconds_cold']:.1f} | {r['seconds_cached_build']:.1f} | {r['seconds_all_cached_back_to_back']:.1f} | "
              f"{statistics.median(r['seconds_all_cached_warm']):.1f} | {100 * c['cv_speedup_eager']:.2f}% / "
              f"{100 * c['cv_speedup_compile']:.2f}% | {100 * m.get('cv_speedup_eager', 0):.2f}% / "
              f"{100 * m.get('cv_speedup_compile', 0):.2f}% |")


def repeat(evaluator: Evaluator, task, candidate, gap: float) -> dict:
    time.sleep(gap)
    seconds, result = timed(evaluator, task, candidate)
    print(f"  {task.name}: {seconds:.1f} s, {result.speedup_eager:.3f}x eager, {result.speedup_compile:.3f}x compile",
          file=sys.stderr)
    return {"seconds": seconds, "result": result}


def summary(runs: list[dict]) -> dict:
    results = [r["result"] for r in runs]
    eager = [r.speedup_eager for r in results]
    compiled = [r.speedup_compile for r in results]
    return {"candidate_ms": statistics.median(r.times["candidate"]["median_ms"] for r in results),
            "candidate_ms_all": [r.times["candidate"]["median_ms"] for r in results],
            "speedup_eager": eager, "speedup_compile": compiled,
            "cv_speedup_eager": cv(eager), "cv_speedup_compile": cv(compiled)}


def report(rows: list[dict], last, args: argparse.Namespace) -> dict:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": args.device,
            "environment": last.environment, "platform": platform.platform(), "timing": last.timing,
            "gap_s": args.gap, "rows": rows}


if __name__ == "__main__":
    main()
