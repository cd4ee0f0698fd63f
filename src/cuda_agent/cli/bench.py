"""``cuda-agent bench``, ``report`` and ``compare``: a solution set (or a live agent) over a benchmark, its
reports, and two runs side by side."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cuda_agent.cli.common import (EXIT_CORRECT, EXIT_NO_VERDICT, EXIT_USAGE, _chat_backend, _continue, _memory_limit,
    _plural, _retry, _timeouts, add_cache_option, add_device_option, add_level_option, add_memory_option,
    add_policy_option, add_quiet_option, add_retries_option, add_sandbox_option, add_timeout_option, say)
from cuda_agent.evaluate import Policy, TimingConfig, resolve_device
from cuda_agent.evaluate.result import BUSY_ADVICE
from cuda_agent.tasks import load_tasks


def cmd_bench(args: argparse.Namespace) -> int:
    from cuda_agent.bench.baselines import read_table
    from cuda_agent.bench.report import write_report
    from cuda_agent.bench.run import read_results, run_agent_bench, run_bench, seed_baselines, without_verdict
    from cuda_agent.bench.solutions import find_solutions
    from cuda_agent.paths import cache_root

    if (args.solutions is None) == (args.model is None):
        raise ValueError("give --solutions DIR (evaluate a solution set) or --model NAME (run the agent live).")
    tasks = load_tasks(args.source, levels=args.level)
    remote = None
    if args.remote:
        from cuda_agent.service import RemoteEvaluator

        if args.baselines:
            raise ValueError("--baselines seeds this machine's cache; with --remote the service times and caches its "
                             "own (seed its --cache-dir instead, or drop --baselines).")
        remote = RemoteEvaluator(args.remote)
        remote.require_policy(Policy.preset(args.policy), "--policy")
    device = remote.device if remote is not None else resolve_device(args.device)
    backend = _chat_backend(args) if args.model is not None else None  # before any baseline or evaluation
    policy = remote.policy if remote is not None else Policy.preset(args.policy)
    # Enough jobs in flight to keep every slot of the service busy while replies travel back.
    concurrency = args.concurrency or (2 * remote.info.get("slots_total", 1) if remote is not None else 1)
    if args.solutions is not None:
        solutions = find_solutions(tasks, args.solutions)
        unmatched = ", ".join(str(p.relative_to(solutions.root)) for p in solutions.unmatched[:10])
        say(f"{_plural(len(tasks), 'task')}; {len(solutions.by_task)} with solutions "
            f"({_plural(len(solutions.entries()), 'entry', 'entries')}); "
            f"{_plural(len(solutions.unmatched), 'entry', 'entries')} name no task" + (f": {unmatched}" if unmatched else ""))
    cache_dir = args.cache_dir or cache_root()
    degenerate: list[str] = []
    if args.baselines:
        seeded = seed_baselines(args.baselines, cache_dir, policy, device)
        degenerate = sorted(r["name"] for r in read_table(args.baselines) if r.get("degenerate"))
        say(f"{_plural(seeded, 'baseline')} from {args.baselines} in the cache; {_plural(len(degenerate), 'task')} "
            "flagged degenerate")
    start = time.monotonic()

    def show(done: int, total: int, row: dict) -> None:
        if not args.quiet:
            speed = f", {row['speedup_compile']:.2f}x vs compile" if row.get("speedup_compile") else ""
            reason = f" ({row['reason'][:100]})" if row.get("reason") else ""
            say(f"[{time.monotonic() - start:6.0f}s {done}/{total}] {row['task']['name']} {row['entry']}: "
                f"{row['status']}{speed}{reason}")

    options = {"policy": policy, "sandbox": args.sandbox, "cache_dir": cache_dir, "timeouts": _timeouts(args),
               "memory_limit": _memory_limit(args), "retry": _retry(args)}
    if args.baselines:
        # The table's baselines stand (a run over all of KernelBench compiles and times none again); the
        # candidate alone is timed in rounds. Without a table, baselines are timed beside each candidate.
        options["timing"] = TimingConfig(baselines="cached")
    settings = {"device": device, "policy": policy.name, "degenerate": degenerate}
    if args.model is None:
        run_bench(args.out, tasks, solutions, device, gpus=args.gpus, evaluator_options=options, settings=settings,
                  progress=show, evaluator=remote, concurrency=concurrency)
    else:
        from cuda_agent.agent.loop import AgentConfig

        config = AgentConfig(max_turns=args.max_turns)
        run_agent_bench(args.out, tasks, backend, device, model=args.model, gpus=args.gpus, evaluator_options=options,
                        config=config, sandbox=args.sandbox, settings=settings | {"max_turns": args.max_turns},
                        progress=show, evaluator=remote, concurrency=concurrency)
    write_report(args.out, exclude_degenerate=args.exclude_degenerate)
    print((args.out / "report.md").read_text().split("\n## ")[0])
    print(f"reports in {args.out}: report.md, metrics.json, levels.csv, per_task.csv, *.png", file=sys.stderr)
    undecided = without_verdict(read_results(args.out))
    if undecided:
        # Not failures: a rerun of the same command evaluates exactly these again.
        say(f"cuda-agent: {_plural(len(undecided), 'entry', 'entries')} ended without a verdict (not failures; "
            f"{BUSY_ADVICE}); run the same command again to evaluate them again")
        return EXIT_NO_VERDICT
    return EXIT_CORRECT


def cmd_report(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import write_report

    write_report(args.run, exclude_degenerate=args.exclude_degenerate, levels=args.level)
    print((args.run / "report.md").read_text())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import compare_runs

    text = compare_runs(args.a, args.b, exclude_degenerate=args.exclude_degenerate, levels=args.level,
                        force=args.force)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
    p = sub.add_parser("bench", help="evaluate a solution set over KernelBench tasks; the paper's metrics, reports, plots",
                       epilog=f"exit status: {EXIT_CORRECT} every entry has a verdict (correct or not), {EXIT_USAGE} a "
                              f"usage error, {EXIT_NO_VERDICT} some entries ended without a verdict (a busy host, or "
                              "the harness failed: not failures; the same command evaluates them again), 130 "
                              "interrupted")
    p.add_argument("source", help="the tasks: KernelBench dir or .jsonl/.parquet table (or HF dataset name); "
                                  "TABLE#LEVEL/ID picks one")
    p.add_argument("--solutions", type=Path, default=None,
                   help="one entry per task: level1_19/ (model_new.py + kernels/), level_1_problem_19_sample_0_kernel.py, "
                        "level1/19_ReLU.py; several entries of a task count with the best (no default: this or "
                        "--model)")
    p.add_argument("--model", default=None, help="run the agent live on each task with this model instead "
                                                 "(best evaluation of each trajectory; default: --solutions)")
    p.add_argument("--base-url", default=None, help="live: the OpenAI-compatible endpoint (default: the OpenAI API)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="live: variable holding the API key "
                                                                  "(default OPENAI_API_KEY)")
    p.add_argument("--tool-format", default="native", choices=("native", "hermes"),
                   help="live: native tool calls (default), or <tool_call> text for servers without a tool parser")
    p.add_argument("--max-turns", type=int, default=200, help="live: turns per episode (default 200, as the paper "
                                                              "evaluates)")
    p.add_argument("--out", type=Path, required=True, help="run directory (a rerun continues it, retrying error rows)")
    add_level_option(p)
    add_device_option(p)
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices, one evaluator each (default: all)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="evaluate on an evaluation service (cuda-agent serve) at URL instead of local evaluators "
                        "(default: local)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="with --remote: evaluations (or agent episodes) in flight (default: twice the service's slots)")
    add_policy_option(p)
    p.add_argument("--baselines", type=Path, default=None,
                   help="a table from `cuda-agent baselines` on this machine: its times are reused, its degenerate "
                        "tasks flagged (default: baselines timed beside each candidate)")
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    add_cache_option(p)
    add_quiet_option(p)
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    add_retries_option(p)
    p.set_defaults(func=cmd_bench, kept=_continue(lambda a: f"finished entries are in {a.out}/results.jsonl"))

    p = sub.add_parser("report", help="remake a benchmark run's reports and plots")
    p.add_argument("run", type=Path, help="a run directory of `cuda-agent bench` (its --out)")
    add_level_option(p)
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="two benchmark runs side by side: metrics and the tasks that changed")
    p.add_argument("a", type=Path, help="the first run directory (`cuda-agent bench --out`): the before")
    p.add_argument("b", type=Path, help="the second run directory: the after")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here (default: print only)")
    add_level_option(p)
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    p.add_argument("--force", action="store_true", help="compare even where a task's code differs between the runs")
    p.set_defaults(func=cmd_compare)
