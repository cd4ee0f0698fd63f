"""How long the GPU hold before a timed region really lasts (issue 31, the sub-ms ``clock`` false positives).

The hold is ``torch.cuda._sleep(cycles)``: a count of SM cycles, so its length follows the SM clock, which
drops while the GPU idles between regions (the stop, the read from outside, the next inputs). Timed here
after idle gaps of different lengths, by CUDA events, beside a hold that waits on the GPU's global timer
(nanoseconds, whatever the clock) compiled at run time (``torch.cuda.jiterator``).

    python experiments/probes/hold_clock_probe.py --out hold.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

TIMER_HOLD = """
template <typename T> T timer_hold(T x, T ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)ns);
    return x;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hold-us", type=float, default=200.0)
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 3, 10, 30, 100])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rate_khz = torch.cuda.get_device_properties(0).clock_rate
    cycles = int(args.hold_us * rate_khz / 1e3)
    timer = torch.cuda.jiterator._create_jit_fn(TIMER_HOLD, ns=0.0)
    one = torch.zeros(1, device="cuda")
    holds = {"cycles": lambda: torch.cuda._sleep(cycles), "timer": lambda: timer(one, ns=args.hold_us * 1e3)}
    for hold in holds.values():
        hold()
    torch.cuda.synchronize()
    rows = []
    for gap in args.gaps_ms:
        for name, hold in holds.items():
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                time.sleep(gap / 1e3)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                hold()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            row = {"gap_ms": gap, "hold": name, "nominal_us": args.hold_us, "median_us": round(statistics.median(times), 1),
                   "min_us": round(min(times), 1), "max_us": round(max(times), 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "clock_rate_khz": rate_khz,
                                    "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
