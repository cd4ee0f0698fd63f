"""``cuda-agent train``: the paper's training stages (ours or on verl), the demo and plots."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cuda_agent.cli.common import EXIT_NO_VERDICT, _continue, add_device_option, add_quiet_option, out_dir, say
from cuda_agent.evaluate import resolve_device
from cuda_agent.paths import install_hint


def cmd_train_demo(args: argparse.Namespace) -> int:
    from cuda_agent.train.demo import DemoConfig, NoVerdictStep, run_demo

    out_dir(args.out)
    require_train_extra("train demo")
    device = resolve_device(args.device)
    config = DemoConfig(device=device, batch=args.batch, seed=args.seed)
    try:
        rows = run_demo(args.out, steps=args.steps, config=config, quiet=args.quiet)
    except NoVerdictStep as exc:
        say(f"cuda-agent: {exc}")
        return EXIT_NO_VERDICT
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    menu = json.loads((args.out / "menu.json").read_text()) if (args.out / "menu.json").exists() else {}
    rewards = ", ".join(f"{name} {entry['reward']:+.2f}" if entry.get("reward") is not None else f"{name} none"
                        for name, entry in menu.items()) or "none evaluated"
    print(f"{len(rows)} steps: mean reward {first:+.2f} at step 1, {last:+.2f} at step {len(rows)} "
          f"(fast answered {rows[-1]['answers'].get('fast', 0):.0%}); the candidates' rewards: {rewards}; "
          f"{args.out / 'metrics.jsonl'}, {args.out / 'curves.png'}, {args.out / 'rewards.png'}")
    return 0


def require_train_extra(command: str) -> None:
    """Training's models and configs come from the [train] extra: said before anything starts, not as a
    traceback from deep inside the first step."""
    missing = []
    for module in ("transformers", "yaml"):
        try:
            __import__(module)
        except ImportError:
            missing.append("pyyaml" if module == "yaml" else module)
    if missing:
        raise ValueError(f"`cuda-agent {command}` needs {' and '.join(missing)}, from the [train] extra: "
                         f"{install_hint('train')}")


def cmd_train_verl(args: argparse.Namespace) -> int:
    """The stage on verl: the command from the packaged override files (``train.verl.launch``), run here."""
    import shlex
    import subprocess

    from cuda_agent.train.verl.launch import verl_command

    if args.stage in ("collect", "value"):
        raise ValueError(f"`train {args.stage}` has no verl stage (verl has no offline value pretraining, and "
                         "collection is our agent loop): run it without --engine verl; its output feeds the verl "
                         "stages by path (data.train_files for rft, critic.model.path for agentic ppo).")
    stage = "rft" if args.stage == "rft" else ("ppo-single-turn" if args.single_turn else "ppo-agentic")
    command = verl_command(stage, args.config, args.out, args.overrides)
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(command).returncode


def cmd_train_stage(args: argparse.Namespace) -> int:
    from cuda_agent.train import stages
    from cuda_agent.train.config import check_models, load_config
    from cuda_agent.train.distributed import leave_group

    out_dir(args.out)
    if args.engine == "verl":
        return cmd_train_verl(args)
    if args.overrides or args.dry_run:
        raise ValueError("--set and --dry-run are for --engine verl; our stages read everything from --config.")
    if args.config is None:
        raise ValueError(f"`train {args.stage}` needs --config FILE (examples/train/ has one per stage).")
    require_train_extra(f"train {args.stage}")
    config = load_config(args.config, args.stage)
    check_models(config, args.config)
    report = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)  # torchrun: rank 0 reports
    if args.stage == "ppo":
        rows = stages.run_ppo(config, args.out, single_turn=args.single_turn)
        if rows:
            report(f"{len(rows)} steps: mean reward {rows[0]['reward_mean']:+.2f} at step 1, "
                   f"{rows[-1]['reward_mean']:+.2f} at step {len(rows)}; checkpoint {args.out / 'checkpoint'}")
    elif args.stage == "collect":
        report(stages.run_collect(config, args.out))
    elif args.stage == "rft":
        stages.run_rft(config, args.out)
        report(f"actor for agentic PPO: {args.out / 'checkpoint' / 'actor'}")
    else:
        rows = stages.run_value(config, args.out)
        report(f"critic for agentic PPO: {args.out / 'checkpoint' / 'critic'} (held-out explained variance "
               f"{rows[-1]['heldout_explained_variance']:.3f})")
    leave_group()
    return 0


def cmd_train_plot(args: argparse.Namespace) -> int:
    from cuda_agent.train.run import plot_metrics

    for path in plot_metrics(args.run):
        print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
    p = sub.add_parser("train", help="RL training of kernel agents: the paper's four stages, a demo, plots",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="RL training of kernel agents (one node), the paper's recipe in order:\n"
                                   "  1. ppo --single-turn  PPO on the base model: kernels in one reply, no tools\n"
                                   "  2. collect            agent trajectories from the stage-1 checkpoint\n"
                                   "  3. rft                rejection fine-tuning of the actor on the good ones\n"
                                   "  4. value              critic pretraining on the same trajectories\n"
                                   "  5. ppo                agentic PPO from the RFT actor and pretrained critic\n"
                                   "Each reads a config file (examples/train/*.yaml), writes RUN/metrics.jsonl,\n"
                                   "checkpoints and plots, and resumes RUN after an interruption.\n"
                                   "demo: PPO on a tiny model with real rewards; plot: a run's curves.")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    stage_help = {
        "ppo": "PPO: stage 1 with --single-turn (one reply, no tools), stage 3 without (the agent loop)",
        "collect": "agent trajectories (with token traces) from model.actor, for rft and value",
        "rft": "rejection fine-tuning: keep reward > 0, drop redundant loops and invalid tool calls, SFT",
        "value": "critic pretraining on trajectories, GAE targets from the critic itself; held-out explained variance",
    }
    kept_steps = _continue(lambda a: f"finished steps are checkpointed in {a.out}")
    for name, text in stage_help.items():
        q = stages.add_parser(name, help=text, description=text)
        q.add_argument("--config", type=Path, default=None,
                       help="the stage's YAML or JSON config (examples/train/); with --engine verl, an override file "
                            "for verl's trainer (default: the packaged one, cuda_agent/train/verl/configs/)")
        q.add_argument("--out", type=Path, required=True, help="run directory (resumed if it holds the same run)")
        if name == "ppo":
            q.add_argument("--single-turn", action="store_true",
                           help="stage 1: the model writes the whole solution in one reply, no tools")
        q.add_argument("--engine", choices=("ours", "verl"), default="ours",
                       help="ours (default: one node, torchrun + FSDP2) or verl (clusters; ppo and rft; "
                            "needs the [verl] extra, pip install -e '.[verl]')")
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="--engine verl: a hydra override for verl's trainer (repeatable, default none), e.g. "
                            "trainer.nnodes=4")
        q.add_argument("--dry-run", action="store_true", help="--engine verl: print the command, run nothing")
        q.set_defaults(func=cmd_train_stage, single_turn=False, kept=kept_steps)
    text = "PPO on a tiny model learns to pick the fastest correct kernel (real rewards, a few minutes on a CPU)"
    q = stages.add_parser("demo", help=text, description=text + ".")
    q.add_argument("--out", type=Path, required=True, help="run directory (resumed if it holds the same run)")
    add_device_option(q, "train and evaluate")
    q.add_argument("--steps", type=int, default=40, help="steps in total (default 40; a resumed run continues to "
                                                         "this many)")
    q.add_argument("--batch", type=int, default=16, help="episodes per step, one PPO update each (default 16)")
    q.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and sampling (default 0)")
    add_quiet_option(q, "no line per step")
    q.set_defaults(func=cmd_train_demo, kept=kept_steps)
    text = "draw curves.png and rewards.png of a run directory"
    q = stages.add_parser("plot", help=text, description=text[0].upper() + text[1:] + ".")
    q.add_argument("run", type=Path, help="a run directory (a train stage's or the demo's --out)")
    q.set_defaults(func=cmd_train_plot)
