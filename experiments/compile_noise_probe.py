"""Where does torch.compile's baseline move? Measures an example's eager and torch.compile baselines
(``Evaluator.baseline(refresh=True)``: interleaved rounds until each side's per-round spread is small)
again and again: back to back in one reference process, then with gaps in it, then in fresh
reference processes (each compiles anew). Prints and appends one JSON row per measurement, with the
compile-to-eager ratio, so the spread of that ratio within one process, over time, and between
compilations can be told apart.

    python experiments/compile_noise_probe.py --examples cuda_gelu cuda_row_softmax --out probe.jsonl
"""

from __future__ import annotations

import sys
import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import cv, examples  # noqa: E402

from cuda_agent import Evaluator


def measure(evaluator: Evaluator, task, phase: str, process: int) -> dict:
    start = time.perf_counter()
    record = evaluator.baseline(task, refresh=True)
    eager, compiled = record["eager"]["median_ms"], record["compile"]["median_ms"]
    return {"phase": phase, "process": process, "eager_ms": eager, "compile_ms": compiled,
            "ratio": round(compiled / eager, 5), "rounds": record.get("rounds"), "spread": record.get("spread"),
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["cuda_gelu", "cuda_row_softmax"])
    parser.add_argument("--back-to-back", type=int, default=12)
    parser.add_argument("--gapped", type=int, default=5)
    parser.add_argument("--gap", type=float, default=3.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--per-process", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        for name, task, _ in examples("cuda", args.examples):
            rows = []

            def keep(row: dict) -> None:
                row["example"] = name
                rows.append(row)
                print(json.dumps(row), flush=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")

            with Evaluator("cuda", cache_dir=cache, prestart=True) as evaluator:
                evaluator.baseline(task, refresh=True)  # the reference started and compiled
                for _ in range(args.back_to_back):
                    keep(measure(evaluator, task, "back-to-back", 0))
                for _ in range(args.gapped):
                    time.sleep(args.gap)
                    keep(measure(evaluator, task, f"gap {args.gap:g}s", 0))
            for process in range(1, args.processes + 1):
                with Evaluator("cuda", cache_dir=cache, prestart=True) as evaluator:
                    for _ in range(args.per_process):
                        keep(measure(evaluator, task, "fresh process", process))
            for phase in dict.fromkeys(r["phase"] for r in rows):
                ratios = [r["ratio"] for r in rows if r["phase"] == phase]
                print(f"{name} {phase}: compile/eager {min(ratios):.4f}-{max(ratios):.4f}, CV {cv(ratios):.2%}")
            per_process = [statistics.median(r["ratio"] for r in rows if r["process"] == p)
                           for p in range(args.processes + 1)]
            print(f"{name} per-process medians: {', '.join(f'{m:.4f}' for m in per_process)}")


if __name__ == "__main__":
    main()
