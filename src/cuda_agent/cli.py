"""The ``cuda-agent`` command line (thin: every command calls the library)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cuda_agent.build import compile_only
from cuda_agent.candidates import CandidateError, load_candidate
from cuda_agent.evaluate import Evaluator, Policy, TimingConfig
from cuda_agent.tasks import TaskError, load_task, load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _status_line(quiet: bool):
    start = time.monotonic()

    def show(stage: str, detail: str) -> None:
        if not quiet:
            print(f"[{time.monotonic() - start:6.1f}s] {stage:<9} {detail}", file=sys.stderr, flush=True)

    return show


def cmd_eval(args: argparse.Namespace) -> int:
    task = load_task(args.task)
    candidate = load_candidate(args.candidate)
    policy = Policy(checks=args.checks, atol=args.atol, rtol=args.rtol, reward=args.reward)
    timing = TimingConfig(method=args.timing)
    evaluator = Evaluator(
        args.device,
        policy=policy,
        timing=timing,
        cache_dir=args.cache_dir,
        time_compile=not args.no_compile,
        on_stage=_status_line(args.json),
    )
    result = evaluator.evaluate(task, candidate)
    print(result.to_json() if args.json else result.summary())
    return 0 if result.status == "correct" else 1


def cmd_compile(args: argparse.Namespace) -> int:
    candidate = load_candidate(args.candidate)
    result = compile_only(candidate, args.backend, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for diag in result.diagnostics:
            print(diag)
        print(("ok" if result.ok else f"FAILED: {result.error}") + (" (cached)" if result.cached else ""))
    return 0 if result.ok else 1


def cmd_tasks(args: argparse.Namespace) -> int:
    tasks = load_tasks(args.source, levels=args.level)
    for task in tasks:
        print(f"{task.name}\t{task.digest[:12]}\t{task.source}")
    print(f"{len(tasks)} tasks", file=sys.stderr)
    return 0


def cmd_example(args: argparse.Namespace) -> int:
    """Evaluate a bundled example: the CUDA one when a GPU is visible, else the CPU one."""
    from cuda_agent.evaluate import resolve_device

    device = resolve_device(args.device)
    name = args.name or ("cuda_gelu" if device == "cuda" else "cpu_swish")
    root = EXAMPLES / name
    if not root.is_dir():
        available = ", ".join(sorted(p.name for p in EXAMPLES.iterdir())) if EXAMPLES.is_dir() else "none"
        raise SystemExit(f"no example {name!r}; available: {available}")
    ns = argparse.Namespace(
        task=str(root / "model.py"), candidate=str(root / "solution"), device=device, checks=5,
        atol=1e-2, rtol=1e-2, reward="milestone", timing="auto", cache_dir=args.cache_dir,
        no_compile=False, json=args.json,
    )
    return cmd_eval(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuda-agent", description="Verified, timed, rewarded CUDA kernels for PyTorch programs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("eval", help="evaluate a candidate against a task")
    p.add_argument("task", help="task .py file, or TABLE#LEVEL/ID / TABLE#NAME")
    p.add_argument("candidate", help="candidate directory (model_new.py + kernels/) or KernelBench-style .py")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--checks", type=int, default=5, help="verification checks on fresh inputs (default 5)")
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-2)
    p.add_argument("--reward", default="milestone", choices=("milestone", "speedup"))
    p.add_argument("--timing", default="auto", choices=("auto", "events", "host", "profiler"))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the summary")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("compile", help="compile-only check of a candidate's sources (no GPU needed)")
    p.add_argument("candidate")
    p.add_argument("--backend", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("tasks", help="list the tasks of a source")
    p.add_argument("source", help=".py, KernelBench dir, .jsonl/.parquet table or HF dataset name")
    p.add_argument("--level", type=int, action="append")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("example", help="evaluate a bundled example (CPU when no GPU is visible)")
    p.add_argument("name", nargs="?", default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_example)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TaskError, CandidateError, ValueError) as exc:
        print(f"cuda-agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
