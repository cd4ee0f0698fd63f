"""Replay the outside clock's wall limit on every honest result on record, for other values of region_slack.

The wall limit is ``region_slack * region + region_us + 3 * spread`` (``evaluate.region_clock.judge``); a smaller
``region_slack`` lowers the forgery floor of sub-millisecond regions, and fails an honest result whose wall excess
(or the wall excess with the probe's excess after DONE added, ``past-done``) goes over it. This counts those, from
the results ``benchmarks/clock_agreement.py`` wrote (benchmarks/results/*agreement*.jsonl), without a GPU.

    python3 experiments/probes/limit_replay.py --slack 0.10 0.05 0.03 [--only 2026-11-28]
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def honest_rows(only: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(str(RESULTS / "*agreement*.jsonl"))):
        if only not in Path(path).name:
            continue
        for line in Path(path).read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            regions = row.get("regions") or {}
            if row.get("status") != "correct" or not regions.get("reported_ms") or "overhead" not in regions:
                continue
            past_done = regions.get("past_done_excess_ms")
            if past_done is None:  # recorded before past-done existed: the same two medians
                probed = bool(regions.get("after_done_limit_ms"))
                past_done = regions["excess_ms"] + (max(0.0, regions.get("after_done_excess_ms", 0.0)) if probed else 0.0)
            rows.append({"file": Path(path).name, "solution": row["solution"], "region_ms": regions["reported_ms"],
                         "excess_ms": max(regions["excess_ms"], past_done),
                         "spread_ms": regions["overhead"].get("spread_ms", 0.0)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slack", type=float, nargs="+", default=[0.10, 0.05, 0.03])
    parser.add_argument("--region-us", type=float, default=50.0)
    parser.add_argument("--only", default="", help="only result files whose name contains this (e.g. a date)")
    args = parser.parse_args()
    rows = honest_rows(args.only)
    if not rows:
        raise SystemExit(f"no honest results with regions under {RESULTS} matching {args.only!r}")
    print(f"{len(rows)} honest results\n\n| region_slack | over the limit | largest share of it | where |\n|---|---|---|---|")
    for slack in args.slack:
        shares = sorted(((r["excess_ms"] / (slack * r["region_ms"] + args.region_us / 1e3 + 3 * r["spread_ms"]), r)
                         for r in rows), key=lambda item: item[0], reverse=True)
        top, row = shares[0]
        print(f"| {slack:.2f} | {sum(share > 1 for share, _ in shares)} | {top:.2f} | {row['solution']} "
              f"({row['region_ms']:.3f} ms region), {row['file']} |")


if __name__ == "__main__":
    main()
