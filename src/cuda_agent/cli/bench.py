"""``cuda-agent bench``, ``report`` and ``compare``: a solution set (or a live agent) over a benchmark, its
reports, and two runs side by side."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.cli.common import (EXIT_CORRECT, EXIT_NO_VERDICT, EXIT_USAGE, StageProgress, _chat_backend, _continue,
    _memory_limit, _plural, _retry, _timeouts, add_cache_option, add_device_option, add_level_option,
    add_memory_option, add_policy_option, add_quiet_option, add_retries_option, add_sandbox_option,
    add_timeout_option, add_verbose_option, clip, heartbeat, out_dir, say)
from cuda_agent.evaluate import Policy, TimingConfig, resolve_device
from cuda_agent.evaluate.result import BUSY_ADVICE
from cuda_agent.tasks import load_tasks

BEAT_S = 15.0  # how often bench says what is running while no entry finishes


def cmd_bench(args: argparse.Namespace) -> int:
    from cuda_agent.bench.baselines import read_table
    from cuda_agent.bench.report import write_report
    from cuda_agent.bench.run import (
        language_settings, read_results, run_agent_bench, run_bench, seed_baselines, without_verdict,
    )
    from cuda_agent.bench.solutions import find_solutions
    from cuda_agent.paths import cache_root

    if (args.solutions is None) == (args.model is None):
        raise ValueError("give --solutions DIR (evaluate a solution set) or --model NAME (run the agent live).")
    out_dir(args.out)
    if args.baselines:
        args.baselines = _baselines_table(args.baselines)
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
        verb = "names" if len(solutions.unmatched) == 1 else "name"
        say(f"{_plural(len(tasks), 'task')}; {len(solutions.by_task)} with solutions "
            f"({_plural(len(solutions.entries()), 'entry', 'entries')}); "
            f"{_plural(len(solutions.unmatched), 'entry', 'entries')} "
            f"{verb} no task" + (f": {unmatched}" if unmatched else ""))
        if not solutions.entries():
            raise ValueError(f"--solutions {args.solutions}: no entry names a task of {args.source} "
                             f"({_plural(len(tasks), 'task')}"
                             + (f", level {', '.join(map(str, args.level))}" if args.level else "")
                             + "); an entry is named for its task's level and number: level1_19/ (model_new.py + "
                               "kernels/), level_1_problem_19_sample_0_kernel.py or level1/19_ReLU.py"
                             + (f" ({unmatched} {verb} no task of it)" if unmatched else ""))
    cache_dir = args.cache_dir or cache_root()
    degenerate: list[str] = []
    if args.baselines:
        seeded = seed_baselines(args.baselines, cache_dir, policy, device)
        degenerate = sorted(r["name"] for r in read_table(args.baselines) if r.get("degenerate"))
        say(f"{_plural(seeded, 'baseline')} from {args.baselines} in the cache; {_plural(len(degenerate), 'task')} "
            "flagged degenerate")
    start = time.monotonic()
    state = {"done": 0, "total": len(solutions.entries()) if args.model is None else len(tasks), "said": start}
    # What the evaluations are doing, for the heartbeat; every stage's line with --verbose.
    stages = StageProgress(verbose=args.verbose, silent=args.quiet or not args.verbose)

    def show(done: int, total: int, row: dict) -> None:
        state.update(done=done, total=total, said=time.monotonic())
        if not args.quiet:
            speed = f", {row['speedup_compile']:.2f}x vs compile" if row.get("speedup_compile") else ""
            reason = f" ({clip(row['reason'], 100)})" if row.get("reason") else ""
            say(f"[{time.monotonic() - start:6.0f}s {done}/{total}] {row['task']['name']} {row['entry']}: "
                f"{row['status']}{speed}{reason}")

    def still_running() -> str:
        doing = "waiting on the service" if remote is not None else stages.last
        return f"[{time.monotonic() - start:6.0f}s {state['done']}/{state['total']}] running: {doing}"

    options = {"policy": policy, "sandbox": args.sandbox, "cache_dir": cache_dir, "timeouts": _timeouts(args),
               "memory_limit": _memory_limit(args), "retry": _retry(args), "on_stage": stages}
    if args.baselines:
        # The table's baselines stand (a run over all of KernelBench compiles and times none again); the
        # candidate alone is timed in rounds. Without a table, baselines are timed beside each candidate.
        options["timing"] = TimingConfig(baselines="cached")
    settings = {"device": device, "policy": policy.name, "degenerate": degenerate} | language_settings(args.language)
    if not args.quiet:
        work = (f"evaluating {_plural(state['total'], 'entry', 'entries')}" if args.model is None
                else f"running the agent on {_plural(state['total'], 'task')}")
        say(f"{work} on {device}" + (f" through {args.remote}" if remote is not None else "")
            + f": a line as each finishes, and what is running every {BEAT_S:g} s until then")
    with heartbeat(still_running, BEAT_S, lambda: state["said"]) if not args.quiet else contextlib.nullcontext():
        if args.model is None:
            run_bench(args.out, tasks, solutions, device, gpus=args.gpus, evaluator_options=options,
                      settings=settings, progress=show, evaluator=remote, concurrency=concurrency,
                      language=args.language)
        else:
            from cuda_agent.agent.loop import AgentConfig

            config = AgentConfig(max_turns=args.max_turns, language=args.language or "cuda")
            run_agent_bench(args.out, tasks, backend, device, model=args.model, gpus=args.gpus,
                            evaluator_options=options, config=config, sandbox=args.sandbox,
                            settings=settings | {"max_turns": args.max_turns}, progress=show, evaluator=remote,
                            concurrency=concurrency)
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


def _baselines_table(path: Path) -> Path:
    """``--baselines`` as the table file it names; a directory holding exactly one table stands for it."""
    if path.is_dir():
        tables = sorted(path.glob("*.jsonl"))
        if len(tables) == 1:
            say(f"--baselines {path}: reading the table in it, {tables[0].name}")
            return tables[0]
        held = f"holds {len(tables)} .jsonl tables ({', '.join(t.name for t in tables[:5])})" if tables else \
            "holds no .jsonl table"
        raise ValueError(f"--baselines {path} is a directory that {held}: give the table file itself, the one "
                         "`cuda-agent baselines SOURCE --out TABLE.jsonl` wrote")
    if not path.is_file():
        raise ValueError(f"--baselines {path}: no such file; give the table `cuda-agent baselines SOURCE --out "
                         "TABLE.jsonl` wrote on this machine, or leave --baselines out to time the baselines beside "
                         "each candidate")
    return path


def cmd_report(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import write_report

    write_report(args.run, exclude_degenerate=args.exclude_degenerate, levels=args.level)
    print((args.run / "report.md").read_text())
    return 0


def _same_tasks(a: Path, b: Path, levels: list[int] | None, force: bool) -> None:
    """Two runs are compared over one task set: runs that share no task are refused, and runs over different sets
    unless ``force`` (each run's tasks alone then count as absent in the other)."""
    from cuda_agent.bench.report import run_table

    ka, kb = (set(run_table(run, levels).outcomes) for run in (a, b))
    scope = f" of level {', '.join(map(str, levels))}" if levels else ""

    def named(keys: set) -> str:
        shown = ", ".join(f"level{level}/{number}" for level, number in sorted(keys)[:3])
        return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    if not ka & kb:
        raise ValueError(f"{a} ({_plural(len(ka), 'task')}{scope}) and {b} ({_plural(len(kb), 'task')}) share no task, "
                         "so there is nothing to compare: give two runs of `cuda-agent bench` over the same tasks")
    if ka != kb and not force:
        raise ValueError(f"{a} and {b} are runs over different task sets{scope}: {_plural(len(ka - kb), 'task')} only "
                         f"in the first ({named(ka - kb) or 'none'}), {len(kb - ka)} only in the second "
                         f"({named(kb - ka) or 'none'}). Compare runs over the same tasks (--level picks a common "
                         "part), or give --force to compare anyway")


def cmd_compare(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import compare_runs

    _same_tasks(args.a, args.b, args.level, args.force)
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
    p.add_argument("--language", default=None, choices=LANGUAGES,
                   help="the kernels' language: solutions are read as cuda or triton candidates, and the live agent "
                        "writes that language (default: each solution's own, read from its sources; the agent: cuda)")
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
    add_verbose_option(p)
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
    p.add_argument("--force", action="store_true",
                   help="compare even where the runs' task sets or a task's code differ (default: refused; runs that "
                        "share no task are refused still)")
    p.set_defaults(func=cmd_compare)
