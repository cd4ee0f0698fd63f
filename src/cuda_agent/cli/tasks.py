"""``cuda-agent tasks``, ``degenerate``, ``synth``, ``catalog`` and ``baselines``: task sets, listed, checked,
synthesised and timed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.cli.common import (TASKS_HELP, _chat_backend, _continue, _kernelbench_default, _memory_limit, _plural,
    _timeouts, add_cache_option, add_device_option, add_level_option, add_memory_option, add_policy_option,
    add_quiet_option, add_sandbox_option, add_timeout_option, clip, out_dir, say)
from cuda_agent.evaluate import Evaluator, Policy, resolve_device
from cuda_agent.tasks import load_tasks


def cmd_tasks(args: argparse.Namespace) -> int:
    tasks = load_tasks(args.source, levels=args.level)
    for task in tasks:
        print(f"{task.name}\t{task.digest[:12]}\t{task.source}")
    print(_plural(len(tasks), "task"), file=sys.stderr)
    return 0


def cmd_degenerate(args: argparse.Namespace) -> int:
    """Flag tasks that trivial candidates pass under the chosen policy."""
    tasks = load_tasks(args.source, levels=args.level)
    evaluator = Evaluator(args.device, policy=Policy.preset(args.policy), cache_dir=args.cache_dir, sandbox=args.sandbox,
                          timeouts=_timeouts(args), memory_limit=_memory_limit(args))
    flagged = 0
    for index, task in enumerate(tasks, 1):
        if not args.json:
            say(f"[{index}/{len(tasks)}] {task.name}")
        report = evaluator.check_degenerate(task)
        flagged += report.degenerate
        print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    print(f"{flagged} of {_plural(len(tasks), 'task')} degenerate under policy {args.policy}", file=sys.stderr)
    return 1 if flagged else 0


def cmd_synth(args: argparse.Namespace) -> int:
    from cuda_agent.synth.catalog import default_catalog
    from cuda_agent.synth.pipeline import SynthConfig, synthesize

    out_dir(args.out, what="the task set is")
    device = resolve_device(args.device)
    kernelbench = None if args.no_decontaminate else (args.kernelbench or _kernelbench_default())
    if kernelbench is None and not args.no_decontaminate:
        # A note, not an error: a first CPU run should work as the README shows; the similarity filter
        # within the set still runs.
        print("synth: note: no KernelBench programs given (--kernelbench PATH) or found ($KERNELBENCH_DATA, "
              "../shared/data/kernelbench/kernelbench.jsonl): the tasks are NOT decontaminated against KernelBench; "
              "give --kernelbench before training on them for a KernelBench evaluation.", file=sys.stderr)
    llm = {}
    if args.composer == "llm":
        if not args.model or not args.base_url:
            raise ValueError("--composer llm needs --model NAME and --base-url URL (an OpenAI-compatible endpoint).")
        _chat_backend(args)  # a server that is down fails now, not as every candidate's verdict
        llm = {"model": args.model, "base_url": args.base_url, "api_key_env": args.api_key_env}
    config = SynthConfig(n=args.n, out=args.out, device=device, composer=args.composer,
                         seed=args.seed, workers=args.workers, window_ms=tuple(args.window_ms) if args.window_ms else None,
                         max_candidates=args.max_candidates, kernelbench=kernelbench, sandbox=args.sandbox,
                         ray=args.ray, cache_dir=args.cache_dir, language=args.language,
                         **({"timeout_s": args.timeout} if args.timeout is not None else {}))
    catalog = default_catalog(transformers=not args.no_transformers)
    summary = synthesize(config, catalog, progress=not args.quiet, **llm)
    print(f"{_plural(summary['accepted'], 'task')} accepted of {_plural(summary['candidates'], 'candidate')} -> {args.out}/tasks.jsonl "
          f"(report: {args.out}/report.md)")
    return 0 if summary["accepted"] >= args.n else 1


def cmd_catalog(args: argparse.Namespace) -> int:
    from cuda_agent.synth.catalog import build_catalog, default_catalog

    catalog = build_catalog(transformers=not args.no_transformers) if args.out else \
        default_catalog(transformers=not args.no_transformers, refresh=args.refresh)
    if args.out:
        catalog.save(args.out)
    print(catalog.summary())
    if args.verbose:
        for op in catalog.operators:
            state = f"ranks {op.ranks}" + (" stochastic" if op.stochastic else "") if op.usable else f"unusable: {op.reason}"
            print(f"{op.name:<48} {op.family:<12} {state}")
    return 0


def cmd_baselines(args: argparse.Namespace) -> int:
    from cuda_agent.bench.baselines import measure_baselines, read_table, render_table_report

    tasks = load_tasks(args.source, levels=args.level)
    start = time.monotonic()

    def show(done: int, total: int, row: dict) -> None:
        if args.quiet:
            return
        if "error" in row:
            state = f"ERROR {clip(row['error'], 120)}"
        else:
            compiled = f"{row['compile_ms']:.4g} ms" if row.get("compile_ms") else "failed"
            state = (f"eager {row['eager_ms']:.4g} ms, compile {compiled}"
                     + (", DEGENERATE" if row.get("degenerate") else "") + (" (cached)" if row.get("cached") else ""))
        say(f"[{time.monotonic() - start:7.0f}s {done}/{total}] {row['name']}: {state}")

    options = {"policy": Policy.preset(args.policy), "sandbox": args.sandbox, "cache_dir": args.cache_dir,
               "timeouts": _timeouts(args), "memory_limit": _memory_limit(args)}
    measure_baselines(tasks, args.out, device=resolve_device(args.device), gpus=args.gpus, per_gpu=args.per_gpu,
                      degenerate=not args.no_degenerate, evaluator_options=options, progress=show,
                      deadline_s=args.deadline_s)
    rows = read_table(args.out)
    report = render_table_report(rows, args.published)
    args.out.with_suffix(".md").write_text(report)
    print(report)
    missing = len({t.digest for t in tasks} - {r["digest"] for r in rows})
    if missing:
        print(f"{_plural(missing, 'task')} not timed yet: run the same command again to continue", file=sys.stderr)
    return 0 if not missing else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
    p = sub.add_parser("tasks", help="list the tasks of a source (name, digest, origin)")
    p.add_argument("source", help=TASKS_HELP)
    add_level_option(p)
    p.set_defaults(func=cmd_tasks)

    # `export`: the whole command lives in integrations.export (arguments and behaviour); this block only registers it.
    from cuda_agent.integrations import export as export_command
    p = sub.add_parser("export", help="write a task source as an RL stack's dataset (trl, verl, verifiers, openenv)",
                       description=export_command.DESCRIPTION)
    export_command.add_arguments(p)
    p.set_defaults(func=export_command.main)

    p = sub.add_parser("degenerate", help="flag tasks that zeros, a constant or an input passes")
    p.add_argument("source", help=TASKS_HELP)
    add_level_option(p)
    add_policy_option(p)
    add_device_option(p)
    add_cache_option(p)
    p.add_argument("--json", action="store_true", help="one JSON record per task")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_degenerate,
                   kept=lambda a: "the tasks reported above are checked; run the command again for the rest")

    p = sub.add_parser("synth", help="synthesise a task set: compose operators, filter by execution, decontaminate")
    p.add_argument("--n", type=int, required=True, help="accepted tasks wanted")
    p.add_argument("--out", type=Path, required=True, help="output directory (a rerun resumes it)")
    p.add_argument("--composer", default="program", choices=("program", "llm"),
                   help="program (default: random compositions from the catalog, no model) or llm (an "
                        "OpenAI-compatible endpoint writes them: --model, --base-url)")
    add_device_option(p, "screen candidates")
    p.add_argument("--workers", type=int, default=2, help="parallel screening processes (default 2)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="screen on a Ray cluster ('auto', ray://HOST:PORT, or 'local'; default: local processes); "
                        "needs the [ray] extra, pip install -e '.[ray]'")
    p.add_argument("--seed", type=int, default=0, help="composition seed (default 0; a rerun resumes only with the same)")
    p.add_argument("--window-ms", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   help="eager runtime window (default: 1 100 on cuda, as the paper; 0.2 200 on cpu)")
    p.add_argument("--max-candidates", type=int, default=None, help="stop after this many (default 50 x --n)")
    p.add_argument("--kernelbench", type=Path, default=None,
                   help="KernelBench programs to decontaminate against (default: $KERNELBENCH_DATA or "
                        "../shared/data/kernelbench/, where there)")
    p.add_argument("--no-decontaminate", action="store_true", help="skip the comparison with KernelBench")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers layers out of the catalog")
    p.add_argument("--model", default=None, help="LLM composer: model name (no default; needed with --composer llm)")
    p.add_argument("--base-url", default=None, help="LLM composer: OpenAI-compatible endpoint (no default; needed "
                                                   "with --composer llm)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="LLM composer: variable holding the API key "
                                                                  "(default OPENAI_API_KEY)")
    add_quiet_option(p, "no progress bar")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="bound each screening step of a candidate (runs, timing, torch.compile) to this many "
                        "seconds (default: 300)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="where the screeners keep torch.compile's cache, DIR/inductor, shared with evaluations "
                        "and later runs (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda-agent)")
    add_sandbox_option(p)
    p.add_argument("--language", default="cuda", choices=LANGUAGES,
                   help="the kernels the tasks are for (default cuda; a column of tasks.jsonl, which prompts made "
                        "from it follow)")
    p.set_defaults(func=cmd_synth, kept=_continue(lambda a: f"verdicts and accepted tasks so far are in {a.out}"))

    p = sub.add_parser("baselines", help="time eager and torch.compile for every task here (resumable table)")
    p.add_argument("source", help=TASKS_HELP)
    p.add_argument("--out", type=Path, required=True, help="the table (JSONL; a rerun continues it; report beside it as .md)")
    add_level_option(p)
    add_device_option(p, "time")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices to spread over (default: all)")
    p.add_argument("--per-gpu", type=int, default=1,
                   help="tasks in flight per GPU: they load and compile at once, time one at a time (default 1)")
    add_policy_option(p)
    p.add_argument("--no-degenerate", action="store_true", help="skip the degenerate-task check")
    p.add_argument("--deadline-s", type=float, default=None, help="take no new task after this many seconds "
                                                                  "(default: no deadline)")
    p.add_argument("--published", type=Path, default=None,
                   help="KernelBench data dir with the published H100 times to compare with (default: none)")
    add_cache_option(p)
    add_quiet_option(p)
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_baselines, kept=_continue(lambda a: f"the tasks timed so far are in {a.out}"))

    p = sub.add_parser("catalog", help="the operator catalog the composers read (crawled from torch/transformers)")
    p.add_argument("--out", type=Path, default=None, help="build it afresh and write it here as JSON (default: "
                                                          "read the cached one)")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers layers out")
    p.add_argument("--refresh", action="store_true", help="rebuild the cached catalog")
    p.add_argument("--verbose", action="store_true", help="one line per operator")
    p.set_defaults(func=cmd_catalog)
