"""Which end of the timed region gives the same reward every time? Evaluates each example's unchanged
candidate ``--repeats`` times with one warm evaluator per timing variant, and reports, per variant, the
spread of the candidate's time and of the speedups between evaluations, and the rewards.

    python experiments/timing_stability.py --examples cuda_gelu cuda_row_softmax --repeats 6 --out stab.jsonl

Variants (``TimingConfig``): ``device`` (the end event after a host-side device-wide synchronise, so
the host's wake-up latency is inside every region), ``stream`` (the end event in stream order, with a
fence after the synchronise that catches work left running past it), ``stream+hold`` (the same, and
the GPU kept busy for ``hold_us`` before the start event so the host's launches are queued when it
starts). Rows are appended to ``--out`` as each variant finishes.
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
from common import cv, examples, timed  # noqa: E402

from cuda_agent import Evaluator
from cuda_agent.evaluate.protocol.policy import TimingConfig

VARIANTS = {
    "device": TimingConfig(end_fence="device"),
    "stream": TimingConfig(end_fence="stream"),
    "stream+hold": TimingConfig(end_fence="stream", hold_us=50.0),
    "stream+hold200": TimingConfig(end_fence="stream", hold_us=200.0),
    "stream+hold500": TimingConfig(end_fence="stream", hold_us=500.0),
}


def run(name: str, task, candidate, variant: str, repeats: int, gap: float, cache: Path) -> dict:
    rows = []
    with Evaluator("cuda", cache_dir=cache, timing=VARIANTS[variant], prestart=True) as evaluator:
        timed(evaluator, task, candidate)  # the reference and spares started, baselines compiled
        for _ in range(repeats):
            time.sleep(gap)
            seconds, result = timed(evaluator, task, candidate)
            speedups = result.decision["speedups"] if result.decision else {}
            clock = result.timing.get("clock") or {}
            rows.append({"seconds": round(seconds, 2), "reward": result.reward, "status": result.status,
                         "rule": result.rule, "clock_unexplained_ms": clock.get("unexplained_ms"),
                         "clock_limit_ms": clock.get("limit_ms"),
                         "candidate_ms": result.times.get("candidate", {}).get("median_ms"),
                         "eager_ms": result.times.get("eager", {}).get("median_ms"),
                         "compile_ms": result.times.get("compile", {}).get("median_ms"),
                         "speedups": {side: round(s["estimate"], 4) for side, s in speedups.items()},
                         "confident": result.decision["confident"] if result.decision else None,
                         "rounds": result.decision["rounds"] if result.decision else None})
    summary = {
        "example": name, "variant": variant, "repeats": repeats,
        "rewards": [r["reward"] for r in rows],
        "candidate_ms_cv": round(cv([r["candidate_ms"] for r in rows if r["candidate_ms"]]), 4),
        "candidate_ms_median": statistics.median([r["candidate_ms"] for r in rows if r["candidate_ms"]] or [0.0]),
        "eager_ms_cv": round(cv([r["eager_ms"] for r in rows if r["eager_ms"]]), 4),
        "speedup_cv": {side: round(cv([r["speedups"][side] for r in rows if side in r["speedups"]]), 4)
                       for side in ("eager", "compile")},
        "seconds_median": statistics.median(r["seconds"] for r in rows),
        "evaluations": rows,
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", nargs="*", default=["cuda_gelu", "cuda_row_softmax"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="cuda-agent-stab-"))
    for name, task, candidate in examples("cuda", args.examples):
        for variant in args.variants:
            summary = run(name, task, candidate, variant, args.repeats, args.gap, cache)
            print(f"{name:18s} {variant:12s} rewards {summary['rewards']} candidate CV {summary['candidate_ms_cv']:.2%} "
                  f"eager CV {summary['eager_ms_cv']:.2%} speedup CV {summary['speedup_cv']} "
                  f"median {summary['seconds_median']} s", flush=True)
            if args.out:
                with args.out.open("a") as handle:
                    handle.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
