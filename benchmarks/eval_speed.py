"""Seconds per evaluation (cold build, cached build, cached baselines) and the
repeat-measurement spread of the speedup.

    python benchmarks/eval_speed.py --device cuda --out results.json

For each example: (1) cold: empty cache, so build + baselines + verify + profile;
(2) cached build, baselines re-measured; (3) everything cached (the target is
<= 5 s end to end). Then the same candidate is evaluated ``--repeats`` times with
baselines re-measured each time, and the coefficient of variation of the
speedups is reported (target <= 2% for kernels of 0.5 ms and longer).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from common import examples, timed

from cuda_agent import Evaluator


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--examples", nargs="*", default=None, help="example folder names (default: all of the device's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    args = parser.parse_args()

    rows = []
    for name, task, candidate in examples(args.device, args.examples):
        cache = Path(tempfile.mkdtemp(prefix="cuda-agent-bench-"))
        evaluator = Evaluator(args.device, cache_dir=cache)
        cold, first = timed(evaluator, task, candidate)
        shutil.rmtree(cache / "baselines")
        cached_build, _ = timed(evaluator, task, candidate)
        all_cached, last = timed(evaluator, task, candidate)
        assert last.build["cached"] and last.baseline_cached
        speedups_eager, speedups_compile, cand_ms = [], [], []
        for i in range(args.repeats):
            shutil.rmtree(cache / "baselines")  # re-measure the baselines too: the full spread
            _, result = timed(evaluator, task, candidate)
            speedups_eager.append(result.speedup_eager)
            speedups_compile.append(result.speedup_compile)
            cand_ms.append(result.times["candidate"]["median_ms"])
            print(f"  {name} repeat {i + 1}: {result.speedup_eager:.3f}x eager, {result.speedup_compile:.3f}x compile", file=sys.stderr)
        row = {
            "example": name,
            "candidate_ms": statistics.median(cand_ms),
            "eager_ms": last.times["eager"]["median_ms"],
            "compile_ms": last.times["compile"]["median_ms"],
            "seconds_cold": cold,
            "seconds_cached_build": cached_build,
            "seconds_all_cached": all_cached,
            "build_seconds_cold": first.build["seconds"],
            "durations_all_cached": last.durations,
            "speedup_eager": speedups_eager,
            "speedup_compile": speedups_compile,
            "cv_speedup_eager": cv(speedups_eager),
            "cv_speedup_compile": cv(speedups_compile),
            "reward": last.reward,
        }
        rows.append(row)
        shutil.rmtree(cache, ignore_errors=True)
        print(json.dumps(row), file=sys.stderr)

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "environment": last.environment,
        "platform": platform.platform(),
        "timing": last.timing,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print("\n| example | cand ms | eager ms | compile ms | cold s | cached build s | all cached s | CV speedup eager | CV speedup compile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['example']} | {r['candidate_ms']:.3f} | {r['eager_ms']:.3f} | {r['compile_ms']:.3f} | {r['seconds_cold']:.1f} | "
            f"{r['seconds_cached_build']:.1f} | {r['seconds_all_cached']:.1f} | {100 * r['cv_speedup_eager']:.2f}% | "
            f"{100 * r['cv_speedup_compile']:.2f}% |"
        )


if __name__ == "__main__":
    main()
