"""How the candidate's timing moves over successive evaluations on one machine, next to the GPU's
clocks: is the first timing on a fresh machine slow, and why?

    python experiments/timing_drift.py --examples cuda_gelu cuda_row_softmax --evaluations 6 --out DIR

Every evaluation after the first reuses the cached build and baselines. Writes DIR/drift.json (one
row per evaluation: candidate median, spread, in-run drift, stage seconds) and DIR/clocks.csv
(``nvidia-smi`` read every 100 ms while it runs: SM and memory clocks, power, temperature,
performance state, throttle reasons). Reading these never changes a setting of the card.
"""

from __future__ import annotations

import sys
import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import examples, timed  # noqa: E402

from cuda_agent import Evaluator

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,pstate,clocks_throttle_reasons.active,utilization.gpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", nargs="*", default=["cuda_gelu", "cuda_row_softmax"])
    parser.add_argument("--evaluations", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "clocks.csv", "w") as log:
        clocks = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv", "-lms", "100"], stdout=log)
        try:
            rows = run(args)
        finally:
            clocks.terminate()
    (args.out / "drift.json").write_text(json.dumps(rows, indent=1))
    for name in args.examples:
        ms = [r["candidate_ms"] for r in rows if r["example"] == name]
        later = ms[1:]
        print(f"{name}: first {ms[0]:.4f} ms, later median {statistics.median(later):.4f} ms "
              f"(first/later {ms[0] / statistics.median(later):.3f}), later CV {statistics.pstdev(later) / statistics.fmean(later):.2%}")


def run(args: argparse.Namespace) -> list[dict]:
    evaluator = Evaluator("cuda")
    rows = []
    for name, task, candidate in examples("cuda", args.examples):
        for index in range(args.evaluations):
            started = time.time()
            seconds, result = timed(evaluator, task, candidate)
            stats = result.times["candidate"]
            row = {"example": name, "evaluation": index, "started": started, "seconds": round(seconds, 2),
                   "candidate_ms": stats["median_ms"], "cv": stats["cv"], "drift": stats.get("drift"),
                   "trials": stats["trials"], "eager_ms": result.median_ms("eager"),
                   "compile_ms": result.median_ms("compile"), "speedup_eager": result.speedup_eager,
                   "reward": result.reward, "durations": result.durations}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
