"""Do the host's clocks and the GPU's event timer run at the same rate?

Over 81 honest results on the H200 (2026-11-28/29) the outside clock's wall bound exceeded the regions the
candidate's events reported by 0.001 ms + 0.86% of the region (one call a region, so no per-call cost), and
the H100's long regions of 2026-11-27 by 0.9-2.6%. Either the host clock the brackets use (``time.time_ns``
and ``SO_TIMESTAMPNS``: CLOCK_REALTIME) runs at another rate than the GPU's timer (a guest's TSC calibrated
off, or the clock slewed by NTP/chrony on a freshly started machine), or the GPU spends ~1% of each region
outside the events. This tells the two apart, without the evaluator:

- the kernel's clock discipline (``adjtimex``: frequency and tick adjustment, status) and clocksource;
- CLOCK_REALTIME and CLOCK_MONOTONIC against CLOCK_MONOTONIC_RAW (unslewed) over ``--host-s`` seconds;
- on a GPU, spin kernels (``torch.cuda._sleep``) of several lengths between two events, bracketed by each host
  clock around the launch and the event's synchronise: the slope of host time over event time, fitted over
  the lengths, is the rate ratio (the fixed launch and wake-up latencies fall into the intercept).

    python3 experiments/probes/clock_rate_probe.py [--lengths-ms 2 5 10 20 40] [--repeats 5] [--out rate.json]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import time
from pathlib import Path

CLOCKS = {"realtime": time.CLOCK_REALTIME, "monotonic": time.CLOCK_MONOTONIC, "raw": time.CLOCK_MONOTONIC_RAW}


class _Timex(ctypes.Structure):
    # struct timex (x86_64 Linux): the fields read here come first; the rest is padding for the kernel to fill.
    _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
                ("time_sec", ctypes.c_long), ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
                ("rest", ctypes.c_long * 20)]


def discipline() -> dict:
    """What the kernel does to the clocks now: ``freq`` in ppm, ``tick`` in us per tick (10000 nominal at 100 Hz:
    each 1 off is 100 ppm), and the clocksource."""
    timex = _Timex()
    state = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).adjtimex(ctypes.byref(timex))
    source = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    return {"adjtimex_state": state, "offset": timex.offset, "freq_ppm": round(timex.freq / 65536, 3),
            "tick": timex.tick, "status": timex.status,
            "clocksource": source.read_text().strip() if source.exists() else None}


def host_rates(seconds: float) -> dict:
    """Each slewable clock's rate against CLOCK_MONOTONIC_RAW, in ppm off."""
    start = {name: time.clock_gettime_ns(clock) for name, clock in CLOCKS.items()}
    time.sleep(seconds)
    end = {name: time.clock_gettime_ns(clock) for name, clock in CLOCKS.items()}
    raw = end["raw"] - start["raw"]
    return {f"{name}_ppm": round(((end[name] - start[name]) / raw - 1) * 1e6, 2) for name in ("realtime", "monotonic")}


def gpu_rates(lengths_ms: list[float], repeats: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": "none"}
    torch.cuda.init()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def spin(cycles: int) -> tuple[float, dict[str, float]]:
        before = {name: time.clock_gettime_ns(clock) for name, clock in CLOCKS.items()}
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        after = {name: time.clock_gettime_ns(clock) for name, clock in CLOCKS.items()}
        return start.elapsed_time(end), {name: (after[name] - before[name]) / 1e6 for name in CLOCKS}

    spin(1_000_000)  # the context, the module, the clocks up
    probe_cycles = 20_000_000
    per_ms = probe_cycles / statistics.median(spin(probe_cycles)[0] for _ in range(3))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CLOCKS}
    rows = []
    for _ in range(repeats):
        for length in lengths_ms:
            event_ms, host_ms = spin(int(length * per_ms))
            rows.append({"event_ms": round(event_ms, 5)} | {name: round(v, 5) for name, v in host_ms.items()})
            for name in CLOCKS:
                samples[name].append((event_ms, host_ms[name]))
    fits = {}
    for name, points in samples.items():
        ratio, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
        fits[name] = {"ratio": round(ratio, 6), "off_percent": round((ratio - 1) * 100, 4),
                      "intercept_ms": round(intercept, 5)}
    return {"gpu": torch.cuda.get_device_name(), "cycles_per_ms": round(per_ms), "fits": fits, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths-ms", type=float, nargs="+", default=[2, 5, 10, 20, 40])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-s", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "discipline": discipline(),
              "host": host_rates(args.host_s), **gpu_rates(args.lengths_ms, args.repeats)}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
