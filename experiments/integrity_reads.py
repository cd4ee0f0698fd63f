"""What a defence costs: seconds per evaluation and the candidate's measured time, with it and without it.
``--defence read`` (the default): the outside read at a random moment of each timing round
(``IntegrityWatch.read_sometime``); ``--defence rerun``: a recorded timed call run again under check and
matched bit for bit (``checks.check_rerun``, rule ``unwatched-compute``).

    python experiments/integrity_reads.py --device cpu --repeats 6 --out results.json
    python experiments/integrity_reads.py --device cpu --defence rerun --repeats 6

One warm evaluator (``prestart``: the reward service's steady state) per example; evaluations with and
without the read alternate, so that a slow spell of the machine falls on both. The read runs in a
thread of the evaluator while the candidate's round runs: on a host with few cores it competes with
the candidate's own threads, which is what the candidate's median would show.
"""

from __future__ import annotations

import sys
import argparse
import contextlib
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks' shared helpers
from common import examples  # noqa: E402

from cuda_agent import Evaluator
from cuda_agent.evaluate import checks
from cuda_agent.guard.integrity import IntegrityWatch


@contextlib.contextmanager
def _no_read(self: IntegrityWatch, within_s: float):
    yield []


def _no_rerun(*args: object) -> None:
    return None


# (class or module, function, its stand-in that does nothing) for each defence
DEFENCES = {"read": (IntegrityWatch, "read_sometime", _no_read), "rerun": (checks, "check_rerun", _no_rerun)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--examples", nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=6, help="evaluations of each kind per example")
    parser.add_argument("--defence", default="read", choices=sorted(DEFENCES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    owner, method, stand_in = DEFENCES[args.defence]
    real = getattr(owner, method)
    rows = []
    for name, task, candidate in examples(args.device, args.examples):
        on, off = args.defence, f"no {args.defence}"
        runs: dict[str, list[tuple[float, float | None, float | None]]] = {on: [], off: []}
        with Evaluator(args.device, prestart=True) as evaluator:
            evaluator.evaluate(task, candidate)  # build, baselines and reference process: not counted
            for i in range(2 * args.repeats):
                kind = on if i % 2 == 0 else off
                setattr(owner, method, real if kind == on else stand_in)
                try:
                    began = time.perf_counter()
                    result = evaluator.evaluate(task, candidate)
                    seconds = time.perf_counter() - began
                finally:
                    setattr(owner, method, real)
                median = (result.times.get("candidate") or {}).get("median_ms")
                runs[kind].append((seconds, median, result.reward))
                print(f"{name} {kind:8s} {seconds:6.2f} s  candidate {median} ms  reward {result.reward}  "
                      f"{result.status}", flush=True)
        summary = {kind: {"seconds_median": statistics.median(s for s, _, _ in r),
                          "candidate_ms_median": statistics.median(m for _, m, _ in r if m is not None),
                          "rewards": [w for _, _, w in r]} for kind, r in runs.items()}
        rows.append({"example": name, "runs": runs, "summary": summary})
    print("\n| example | kind | s per evaluation (median) | candidate ms (median) | rewards |\n|---|---|---|---|---|")
    for row in rows:
        for kind, s in row["summary"].items():
            print(f"| {row['example']} | {kind} | {s['seconds_median']:.2f} | {s['candidate_ms_median']:.4f} | "
                  f"{','.join(str(w) for w in s['rewards'])} |")
    if args.out:
        args.out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                        "machine": platform.platform(), "device": args.device, "defence": args.defence,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
