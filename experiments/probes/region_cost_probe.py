"""Where a warm evaluation's seconds go, by wall clock (cProfile's own cost distorts these small steps): the
evaluator's steps around each timed region timed in place (stops and let-gos of the candidate, the reference's
reads, writes and quiet probes, its requests by type, the signal watcher), and each region's phases from its
brackets (the candidate's prep before READY, the evaluator's hold before GO, the region, the hold after DONE).

    python experiments/probes/region_cost_probe.py --examples cuda_gelu --evaluations 4 --out rows.jsonl

One long-lived evaluator per example; the first evaluation is cold and left out of the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from cuda_agent import Evaluator, Policy, load_candidate
from cuda_agent.evaluate import long_lived
from cuda_agent.evaluate import reference_process, watchers
from cuda_agent.evaluate.protocol import channel, regions
from cuda_agent.sandbox import process

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from clock_agreement import honest_solutions  # noqa: E402

SPENT: dict[str, list[float]] = defaultdict(list)  # step -> wall ms of each call, this evaluation
PHASES: dict[str, list[float]] = defaultdict(list)  # region phase -> ms of each region, this evaluation
HANDLED: list[float] = []  # the seconds the worker said it spent on the last reply received


def _handled() -> None:
    original = channel.Channel.receive

    @functools.wraps(original)
    def receive(self, *args, **kwargs):
        reply = original(self, *args, **kwargs)
        if isinstance(reply, dict) and isinstance(reply.get("seconds"), float):
            HANDLED.append(reply["seconds"])
        return reply

    channel.Channel.receive = receive


def _timed(owner: object, name: str, label: str | None = None, by_request: bool = False) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        HANDLED.clear()
        result = None
        try:
            result = original(*args, **kwargs)
            return result
        finally:
            key = label or name
            if by_request and len(args) >= 3:
                key = f"{key}:{type(args[2]).__name__}"
                if HANDLED:  # the worker's own time on the request, the rest is the way there and back
                    SPENT[f"{key} (handled)"].append(HANDLED[-1] * 1e3)
                for step, ms in (getattr(result, "steps_ms", None) or {}).items():
                    SPENT[f"{key} . {step}"].append(ms)
            SPENT[key].append((time.perf_counter() - begin) * 1e3)

    setattr(owner, name, wrapper)


def _phases(owner: object) -> None:
    original = owner.serve

    @functools.wraps(original)
    def serve(self, *args, **kwargs):
        brackets = original(self, *args, **kwargs)
        for b in brackets:
            PHASES["prep (CONT to READY)"].append((b.ready_ns - b.start_ns) / 1e6)
            PHASES["before GO (READY to GO)"].append((b.go_ns - b.ready_ns) / 1e6)
            PHASES["region (GO to DONE)"].append((b.done_ns - b.go_ns) / 1e6)
        PHASES["regions served"].append(float(len(brackets)))
        return brackets

    owner.serve = serve


def instrument() -> None:
    _timed(process.WorkerProcess, "pause")
    _timed(process.WorkerProcess, "resume")
    _timed(process.WorkerProcess, "stop_known", "stop known (at DONE)")
    _timed(reference_process.ReferenceGpu, "after_done", "probe asked (before GO)")
    _timed(reference_process.ArmedProbe, "answer", "probe answer (after DONE)")
    _timed(reference_process.ReferenceGpu, "keep", "reference keep (a round's last output)")
    _timed(regions.Bell, "_chunks", "allocations received (FDS)")
    _timed(reference_process.ReferenceGpu, "write", "reference write (GPU inputs)")
    _timed(reference_process.ReferenceGpu, "read", "reference read (GPU outputs)")
    _timed(watchers.Signals, "check", "signals watcher")
    _timed(channel.Channel, "ask_typed", "ask", by_request=True)
    _handled()
    _phases(regions.Bell)


def summary(rows: list[dict]) -> str:
    lines = ["| step | calls an evaluation | ms a call, median | ms an evaluation, median |", "|---|---|---|---|"]
    keys = sorted({k for r in rows for k in r["spent"]}, key=lambda k: -statistics.median(
        [sum(r["spent"].get(k, [0.0])) for r in rows]))
    for key in keys:
        calls = statistics.median(len(r["spent"].get(key, [])) for r in rows)
        each = statistics.median([v for r in rows for v in r["spent"].get(key, [])] or [0.0])
        total = statistics.median(sum(r["spent"].get(key, [0.0])) for r in rows)
        lines.append(f"| {key} | {calls:g} | {each:.3f} | {total:.1f} |")
    lines += ["", "| region phase | regions an evaluation | ms, median | ms an evaluation, median |", "|---|---|---|---|"]
    for key in sorted({k for r in rows for k in r["phases"]} - {"regions served"}):
        values = [v for r in rows for v in r["phases"].get(key, [])]
        total = statistics.median(sum(r["phases"].get(key, [0.0])) for r in rows)
        count = statistics.median(len(r["phases"].get(key, [])) for r in rows)
        lines.append(f"| {key} | {count:g} | {statistics.median(values or [0.0]):.3f} | {total:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--examples", nargs="+", default=["cuda_gelu"], help="solution names (clock_agreement's)")
    parser.add_argument("--kernelbench", type=Path, default=None, help="kernelbench.jsonl (KernelBench solutions)")
    parser.add_argument("--evaluations", type=int, default=4, help="in a row per example, the first one cold")
    parser.add_argument("--gap-s", type=float, default=3.0, help="between evaluations")
    parser.add_argument("--pause-poll-ms", type=float, nargs="+", default=None,
                        help="sandbox.process.PAUSE_POLL_S for each evaluation in turn (an A/B in one evaluator)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    instrument()
    found = {name: (task, folder) for name, task, folder in honest_solutions(args.device, args.kernelbench)}
    missing = [name for name in args.examples if name not in found]
    if missing:
        raise SystemExit(f"no honest solution named {', '.join(missing)} (known: {', '.join(sorted(found))})")
    for name in args.examples:
        task, folder = found[name]
        candidate = load_candidate(folder)
        warm: dict[float | None, list[dict]] = defaultdict(list)
        with Evaluator(args.device, policy=Policy(), **long_lived(args.device)) as evaluator:
            for number in range(args.evaluations):
                poll = args.pause_poll_ms[number % len(args.pause_poll_ms)] if args.pause_poll_ms else None
                if poll is not None:
                    process.PAUSE_POLL_S = poll / 1e3
                SPENT.clear()
                PHASES.clear()
                result = evaluator.evaluate(task, candidate)
                row = {"label": args.label, "example": name, "evaluation": number, "status": result.status,
                       "reward": result.reward, "durations": result.durations,
                       "pause_poll_ms": process.PAUSE_POLL_S * 1e3,
                       "spent": {k: [round(v, 3) for v in vs] for k, vs in SPENT.items()},
                       "phases": {k: [round(v, 3) for v in vs] for k, vs in PHASES.items()}}
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} #{number}: {result.status} reward {result.reward} {result.durations}", flush=True)
                if number:
                    warm[poll].append(row)
                time.sleep(args.gap_s)
        for poll, rows in warm.items():
            totals = sorted(r["durations"]["total"] for r in rows)
            print(f"\n{name}, {len(rows)} warm evaluations" + (f", pause poll {poll:g} ms" if poll else "")
                  + f": total s {totals}\n" + summary(rows), flush=True)


if __name__ == "__main__":
    main()
