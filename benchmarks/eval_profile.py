"""Where the seconds of one evaluation go: every request to the two worker processes (wall time in
the evaluator, time the worker spent on it) and the evaluator's own steps, as a timeline.

    python benchmarks/eval_profile.py --device cuda --example cuda_gelu --evaluations 3 --gap 8 --out profile.json
    python benchmarks/eval_profile.py --solution level1_20 --kernelbench .data/kernelbench/kernelbench.jsonl

Evaluations run on one long-lived evaluator (``prestart``) with ``--gap`` seconds between them, as
after an agent's turn; the first fills the build and baseline caches. The timeline of the last one
is printed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import time
from pathlib import Path

from common import ROOT, examples, kernelbench_tasks, timed

from cuda_agent import Evaluator, load_candidate
from cuda_agent.sandbox.process import WorkerProcess

# The package's ``evaluate`` name is the function, so the module is reached by its full name.
evaluator_module = importlib.import_module("cuda_agent.evaluate.evaluator")
stages = importlib.import_module("cuda_agent.evaluate.stages")
processes = importlib.import_module("cuda_agent.evaluate.processes")
reference_process = importlib.import_module("cuda_agent.evaluate.reference_process")
checks = importlib.import_module("cuda_agent.evaluate.checks")
brackets = importlib.import_module("cuda_agent.evaluate.brackets")
EVENTS: list[dict] = []
_START = [0.0]


def now() -> float:
    return time.perf_counter() - _START[0]


def _role(worker: WorkerProcess) -> str:
    argv = list(worker.argv)
    return argv[argv.index("--role") + 1] if "--role" in argv else "worker"


def trace_workers() -> None:
    send, receive = WorkerProcess.send, WorkerProcess.receive

    def traced_send(self, message):
        self.__dict__.setdefault("_ops", []).append((message.get("op"), now()))
        return send(self, message)

    def traced_receive(self, timeout_s):
        op, sent = self.__dict__.get("_ops", [("?", now())]).pop(0)
        reply = receive(self, timeout_s)
        EVENTS.append({"what": f"{_role(self)}:{op}", "start": sent, "end": now(), "worker_s": reply.get("seconds")})
        return reply

    WorkerProcess.send, WorkerProcess.receive = traced_send, traced_receive


def trace(owner, name: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        start = now()
        try:
            return original(*args, **kwargs)
        finally:
            EVENTS.append({"what": name, "start": start, "end": now()})

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    setattr(owner, name, staticmethod(traced) if static else traced)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--example", default="cuda_gelu")
    parser.add_argument("--solution", default=None, metavar="FOLDER",
                        help="a benchmarks/solutions_kb folder (level1_20) instead of --example, with --kernelbench")
    parser.add_argument("--kernelbench", type=Path, default=None, help="kernelbench.jsonl, for --solution")
    parser.add_argument("--evaluations", type=int, default=3)
    parser.add_argument("--gap", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trace_workers()
    for name in ("describe_environment", "check_candidate", "audit_symbols", "take_workers", "start_workers",
                 "copy_modules"):
        trace(evaluator_module, name)
    for name in ("baseline_key", "share_output_memory", "cached_baseline"):
        trace(reference_process, name)
    for name in ("build", "toolchain_imports"):
        trace(Evaluator, name)
    trace(processes.Workers, "close")
    for name in ("check_rerun", "compare"):
        trace(checks, name)
    for name in ("own_kernels", "run_checks", "check_timed_outputs"):  # imported by name there
        trace(stages, name)
    trace(brackets.CandidateBrackets, "keep_checked")

    if args.solution:
        [task] = kernelbench_tasks(args.kernelbench, [args.solution])
        candidate = load_candidate(ROOT / "benchmarks" / "solutions_kb" / args.solution)
    else:
        [(_, task, candidate)] = list(examples(args.device, [args.example]))
    runs = []
    with Evaluator(args.device, prestart=True) as evaluator:
        for index in range(args.evaluations):
            if index:
                time.sleep(args.gap)
            EVENTS.clear()
            _START[0] = time.perf_counter()
            seconds, result = timed(evaluator, task, candidate)
            runs.append({"seconds": seconds, "durations": result.durations, "notes": result.notes,
                         "candidate_ms": result.median_ms("candidate"), "events": list(EVENTS)})
            print(f"evaluation {index + 1}: {seconds:.2f} s {result.durations}")
    print(f"\ntimeline of the last evaluation ({runs[-1]['seconds']:.2f} s):")
    print(f"{'start':>7} {'end':>7} {'wall':>6} {'worker':>6}  what")
    for event in sorted(runs[-1]["events"], key=lambda e: e["start"]):
        worker = f"{event['worker_s']:.3f}" if event.get("worker_s") is not None else ""
        print(f"{event['start']:7.3f} {event['end']:7.3f} {event['end'] - event['start']:6.3f} {worker:>6}  {event['what']}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
