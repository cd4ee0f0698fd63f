"""Does where a streaming kernel's output lands in device memory change its time? (The cuda_gelu
candidate's median moves between about 0.565 and 0.61 ms from one evaluation to the next.)

    python experiments/placement_probe.py --out placement.json

Times ``torch.add(x, 1, out=y)`` (1 GiB in, 1 GiB out, like cuda_gelu) with the evaluator's timing
method, for outputs placed after spacers of different sizes, and with a fresh output per call as the
timing loop draws them. Prints the median per placement.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.timing import measure

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = TimingConfig(method="events", target_ms=300, max_trials=100)
    x = torch.randn(16384, 16384, device="cuda")
    rows = []
    for round_ in range(args.rounds):
        for spacer_mib in (0, 2, 6, 32, 66, 130, 258, 514):
            spacer = torch.empty(spacer_mib * MIB, dtype=torch.uint8, device="cuda") if spacer_mib else None
            y = torch.empty_like(x)
            stats = measure(lambda y=y: torch.add(x, 1, out=y), "cuda", config)
            rows.append({"round": round_, "spacer_mib": spacer_mib, "offset_mib": (y.data_ptr() - x.data_ptr()) / MIB,
                         "median_ms": stats.median_ms, "cv": stats.cv})
            print(json.dumps(rows[-1]), flush=True)
            del y, spacer
            torch.cuda.empty_cache()
        fresh = measure(lambda: torch.add(x, 1), "cuda", config)  # a new output every call
        rows.append({"round": round_, "spacer_mib": None, "median_ms": fresh.median_ms, "cv": fresh.cv})
        print(json.dumps(rows[-1]), flush=True)
    medians = [r["median_ms"] for r in rows]
    print(f"medians: min {min(medians):.4f} max {max(medians):.4f} ms, spread {max(medians) / min(medians) - 1:.1%}, "
          f"CV {statistics.pstdev(medians) / statistics.fmean(medians):.2%}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
