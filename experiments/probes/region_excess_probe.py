"""Each evaluation's region brackets against its limit, evaluation after evaluation (issue 31's honest
examples): one long-lived evaluator per example, ``--evaluations`` in a row, the first one cold.

    python experiments/probes/region_excess_probe.py --examples cuda_gelu --evaluations 6 --out rows.jsonl
    python experiments/probes/region_excess_probe.py --examples level1_12 --kernelbench K --delay pause --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cuda_agent import Evaluator, Policy, load_candidate
from cuda_agent.evaluate import long_lived
from cuda_agent.sandbox.process import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from clock_agreement import honest_solutions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--examples", nargs="+", default=["cuda_gelu"], help="solution names (clock_agreement's)")
    parser.add_argument("--kernelbench", type=Path, default=None, help="kernelbench.jsonl (KernelBench solutions)")
    parser.add_argument("--evaluations", type=int, default=6)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--delay", default=None, choices=("pause", "resume"),
                        help="an experiment: wait --delay-ms before every stop (pause) or every resume of a worker")
    parser.add_argument("--delay-ms", type=float, default=35.0)
    parser.add_argument("--outside-inputs", default=None, choices=("cpu", "all", "off"),
                        help="Policy.outside_inputs (where timed inputs' values are written from outside)")
    args = parser.parse_args()
    if args.delay:
        _delay(args.delay, args.delay_ms / 1e3)
    found = {name: (task, folder) for name, task, folder in honest_solutions(args.device, args.kernelbench)}
    missing = [name for name in args.examples if name not in found]
    if missing:
        raise SystemExit(f"no honest solution named {', '.join(missing)} (known: {', '.join(sorted(found))}; "
                         "KernelBench ones need --kernelbench)")
    for name in args.examples:
        task, folder = found[name]
        candidate = load_candidate(folder)
        policy = Policy() if args.outside_inputs is None else Policy().with_(outside_inputs=args.outside_inputs)
        with Evaluator(args.device, policy=policy, **long_lived(args.device)) as evaluator:
            for number in range(args.evaluations):
                started = time.monotonic()
                result = evaluator.evaluate(task, candidate)
                regions = (result.timing or {}).get("regions") or {}
                row = {"label": args.label, "example": name, "evaluation": number, "status": result.status,
                       "reward": result.reward, "rule": result.rule, "seconds": round(time.monotonic() - started, 2),
                       "durations": result.durations, "regions": {k: v for k, v in regions.items() if k != "overhead"},
                       "overhead": regions.get("overhead"), "reason": (result.reason or "")[:300]}
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{args.label} {name} #{number}: {result.status} reward {result.reward} {row['seconds']} s; "
                      f"excess {regions.get('excess_ms')} limit {regions.get('limit_ms')} agreement "
                      f"{regions.get('agreement')} overhead {regions.get('overhead_ms')} let-go {regions.get('let_go_ms')} "
                      f"profile {result.durations.get('profile')} s", flush=True)
                time.sleep(1.0)


def _delay(method: str, seconds: float) -> None:
    """Every worker's ``pause`` or ``resume`` waits first: what the time between a region's DONE and the stop
    (36 ms before the process tree was listed from the children lists), or between the read and the resume,
    does to the next region."""
    original = getattr(WorkerProcess, method)

    def delayed(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)
    setattr(WorkerProcess, method, delayed)


if __name__ == "__main__":
    main()
