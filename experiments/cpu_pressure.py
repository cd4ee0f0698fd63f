"""A busy host against the CPU backend's timing: an honest candidate evaluated on a quiet host, then with N busy
processes beside it (one ``while True: pass`` each), the rewards and speedups a busy host gives, and each side's
waits for a CPU over its timing rounds (``timing.cpu_waits``: the share of it in which the thread that runs its
calls waited runnable for a CPU). What ``TimingConfig.wait_max`` is set from.

    python3 experiments/cpu_pressure.py --busy 0 1 2 --repeats 2 --out /tmp/cpu_pressure.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers

from common import ROOT  # noqa: E402

from cuda_agent import Evaluator, load_candidate, load_task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", default="cpu_swish")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside, per pass")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--wait-max", type=float, default=1.0,
                        help="TimingConfig.wait_max for these runs (1.0: never refuse, to see the rewards a busy "
                             "host would have given)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/cpu_pressure.json"))
    args = parser.parse_args()
    from cuda_agent.evaluate import TimingConfig

    root = ROOT / "examples" / args.example
    task, candidate = load_task(root / "model.py"), load_candidate(root / "solution")
    rows = []
    with Evaluator("cpu", references=1, timing=TimingConfig(wait_max=args.wait_max)) as evaluator:
        evaluator.evaluate(task, candidate)  # builds, reference and torch.compile warm: not measured
        for busy in args.busy:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                for repeat in range(args.repeats):
                    started = time.monotonic()
                    result = evaluator.evaluate(task, candidate)
                    row = {"busy": busy, "repeat": repeat, "status": result.status, "reward": result.reward,
                           "speedups": [result.speedup_eager, result.speedup_compile], "waits": result.timing.get("cpu_waits"), "totals": result.timing.get("cpu_waits_total"),
                           "reason": result.reason if result.status == "error" else None,
                           "seconds": round(time.monotonic() - started, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    args.out.write_text(json.dumps({"cpus": os.cpu_count(), "example": args.example, "rows": rows,
                                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    print("\n| busy processes | reward | speedup vs eager / compile | waits: candidate / eager / compile |\n|---|---|---|---|")
    for row in rows:
        w = row["waits"] or {}
        speed = " / ".join(f"{x:.2f}x" if x else "-" for x in row["speedups"])
        print(f"| {row['busy']} | {row['reward']} | {speed} | {w.get('candidate', 0):.1%} / {w.get('eager', 0):.1%} / "
              f"{w.get('compile', 0):.1%} |")

if __name__ == "__main__":
    main()
