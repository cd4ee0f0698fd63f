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
from cuda_agent.evaluate.policy import PRESETS
from cuda_agent.sandbox import SANDBOX_CHOICES, SandboxUnavailable
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
    overrides = {k: getattr(args, k) for k in ("checks", "atol", "rtol", "reward") if getattr(args, k) is not None}
    policy = Policy.preset(args.policy, **overrides)
    timing = TimingConfig(method=args.timing)
    evaluator = Evaluator(
        args.device,
        policy=policy,
        timing=timing,
        cache_dir=args.cache_dir,
        sandbox=args.sandbox,
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


def cmd_degenerate(args: argparse.Namespace) -> int:
    """Flag tasks that trivial candidates pass under the chosen policy."""
    tasks = load_tasks(args.source, levels=args.level)
    evaluator = Evaluator(args.device, policy=Policy.preset(args.policy), cache_dir=args.cache_dir, sandbox=args.sandbox)
    flagged = 0
    for index, task in enumerate(tasks, 1):
        if not args.json:
            print(f"[{index}/{len(tasks)}] {task.name}", file=sys.stderr, flush=True)
        report = evaluator.check_degenerate(task)
        flagged += report.degenerate
        print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    print(f"{flagged} of {len(tasks)} tasks degenerate under policy {args.policy}", file=sys.stderr)
    return 1 if flagged else 0


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
        task=str(root / "model.py"), candidate=str(root / "solution"), device=device, policy="fair",
        checks=None, atol=None, rtol=None, reward=None, timing="auto", cache_dir=args.cache_dir,
        no_compile=False, json=args.json, sandbox=args.sandbox,
    )
    return cmd_eval(ns)


def add_sandbox_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox", default="auto", choices=SANDBOX_CHOICES,
                   help="auto/bwrap: bubblewrap + seccomp (default); none: no isolation, for trusted code only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuda-agent", description="Verified, timed, rewarded CUDA kernels for PyTorch programs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("eval", help="evaluate a candidate against a task")
    p.add_argument("task", help="task .py file, or TABLE#LEVEL/ID / TABLE#NAME")
    p.add_argument("candidate", help="candidate directory (model_new.py + kernels/) or KernelBench-style .py")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--policy", default="fair", choices=sorted(PRESETS),
                   help="precision and correctness preset: fair (default), strict, or paper (the paper's protocol)")
    p.add_argument("--checks", type=int, default=None, help="verification checks on fresh inputs (preset: 5)")
    p.add_argument("--atol", type=float, default=None, help="override the preset's absolute tolerance")
    p.add_argument("--rtol", type=float, default=None, help="override the preset's relative tolerance")
    p.add_argument("--reward", default=None, choices=("milestone", "speedup"))
    p.add_argument("--timing", default="auto", choices=("auto", "events", "host", "profiler"))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the summary")
    add_sandbox_option(p)
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
    add_sandbox_option(p)
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("degenerate", help="flag tasks that zeros, a constant or an input passes")
    p.add_argument("source", help=".py, KernelBench dir, .jsonl/.parquet table or HF dataset name")
    p.add_argument("--level", type=int, action="append")
    p.add_argument("--policy", default="fair", choices=sorted(PRESETS))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="one JSON record per task")
    add_sandbox_option(p)
    p.set_defaults(func=cmd_degenerate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TaskError, CandidateError, SandboxUnavailable, ValueError) as exc:
        print(f"cuda-agent: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
