"""``cuda-agent optimize`` and ``show``: the agent on one task, and its trajectories rendered."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.cli.common import (_chat_backend, _memory_limit, _timeouts, add_device_option, add_memory_option,
    add_policy_option, add_quiet_option, add_sandbox_option, add_timeout_option, out_dir, say)
from cuda_agent.evaluate import Evaluator, Policy, long_lived, resolve_device
from cuda_agent.evaluate.device_lock import DeviceLock
from cuda_agent.tasks import load_task


def cmd_optimize(args: argparse.Namespace) -> int:
    from cuda_agent.agent.loop import AgentConfig
    from cuda_agent.agent.optimize import best_episode, optimize

    out_dir(args.out, what="the episodes' trajectories and report are")
    task = load_task(args.task)
    device = resolve_device(args.device)
    backend = _chat_backend(args)
    # On a GPU machine, the processes of the agent's next evaluation start while it thinks.
    evaluator = Evaluator(device, policy=Policy.preset(args.policy), sandbox=args.sandbox, timeouts=_timeouts(args),
                          memory_limit=_memory_limit(args), timing_lock=DeviceLock(), **long_lived(device))
    config = AgentConfig(max_turns=args.max_turns, context_tokens=args.context_tokens,
                         wall_clock_s=args.wall_clock_s, counters=not args.no_counters, language=args.language)
    start = time.monotonic()

    def show(episode: int, entry: dict) -> None:
        if not args.quiet:
            calls = ", ".join(c["name"] + ("!" if c["error"] else "") for c in entry["tool_calls"]) or "(no tool call)"
            say(f"[{time.monotonic() - start:6.0f}s] episode {episode} turn {entry['turn']}: {calls}")

    with evaluator:  # its kept reference and started processes end with the command
        episodes = optimize(task, backend, args.out, evaluator, episodes=args.episodes, config=config,
                            model=args.model, sandbox=args.sandbox, on_turn=show)
    print((args.out / "report.md").read_text())
    failed = [e.end_reason for e in episodes if e.end_reason.startswith("backend_error")]
    if len(failed) == len(episodes):
        print(f"cuda-agent: error: every episode ended on a model backend error; the first: "
              f"{failed[0].removeprefix('backend_error: ')}", file=sys.stderr)
        return 1
    if best_episode(episodes) is None:
        # Scripts chaining `optimize && deploy` must not take the task's own code for a solution.
        say(f"cuda-agent: no episode reached a correct solution; what each agent did: cuda-agent show {args.out}")
        return 1
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from cuda_agent.agent.trajectory import read_trajectories, render_html, render_text

    records = read_trajectories(args.trajectory)
    if not 0 <= args.episode < len(records):
        raise ValueError(f"{args.trajectory} holds {len(records)} episode(s); --episode is 0..{len(records) - 1}.")
    record = records[args.episode]
    if args.html:
        args.html.write_text(render_html(record))
        print(f"wrote {args.html}", file=sys.stderr)
    else:
        print(render_text(record, width=args.width))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
    p = sub.add_parser("optimize", help="run the agent on a PyTorch model: a verified, faster CUDA extension")
    p.add_argument("task", help="model.py in KernelBench format (Model, get_inputs, get_init_inputs), or "
                                "TABLE#LEVEL/ID / TABLE#NAME")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                                                   "(vLLM, SGLang); default: the OpenAI API")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="variable holding the API key (default "
                                                                  "OPENAI_API_KEY)")
    p.add_argument("--tool-format", default="native", choices=("native", "hermes"),
                   help="native tool calls (default), or <tool_call> text for servers without a tool parser")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--out", type=Path, default=Path("optimized"), help="output directory (default: optimized/)")
    p.add_argument("--episodes", type=int, default=1, help="episodes run at once; the best solution is kept "
                                                           "(default 1)")
    p.add_argument("--max-turns", type=int, default=150, help="model turns per episode (default 150)")
    p.add_argument("--language", default="cuda", choices=LANGUAGES,
                   help="the kernels the agent writes: cuda (a C++/CUDA extension, default) or triton")
    p.add_argument("--context-tokens", type=int, default=128_000,
                   help="context budget; past it the oldest turns go, the system prompt and task stay (default 128000)")
    p.add_argument("--wall-clock-s", type=float, default=None, help="end an episode after this many seconds "
                                                                    "(default: no limit)")
    add_device_option(p)
    add_policy_option(p)
    p.add_argument("--no-counters", action="store_true",
                   help="utils/profile.py without the Nsight Compute counters (GPU: saves 10-14 s per profile)")
    add_quiet_option(p, "no progress lines (one per turn)")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_optimize, kept=lambda a: f"finished episodes are in {a.out}/trajectories.jsonl; "
                                                     "run again with a new --out")

    p = sub.add_parser("show", help="render an agent trajectory (terminal, or --html)")
    p.add_argument("trajectory", type=Path, help="trajectories.jsonl or an optimize output directory")
    p.add_argument("--episode", type=int, default=0, help="which episode of the file, from 0 (default 0)")
    p.add_argument("--html", type=Path, default=None, help="write a self-contained HTML page here (default: the "
                                                           "terminal)")
    p.add_argument("--width", type=int, default=2000, help="cut messages longer than this (default 2000)")
    p.set_defaults(func=cmd_show)
