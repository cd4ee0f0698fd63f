"""``cuda-agent export``: a task source written in each RL stack's own dataset format, with the reward's settings.

One command for every stack, instead of a Python call per stack. The source is anything ``tasks.load_tasks``
reads (a task file, a folder of them, a KernelBench tree or table, JSONL/parquet, a ``cuda-agent synth``
output, a hub dataset); the reward's settings (``--service``, ``--device``, ``--policy``, ``--sandbox``,
``--no-compile``) travel with the data in the place each stack reads them from, and the environment
(``CUDA_AGENT_SERVICE``, ``CUDA_AGENT_REWARD_*``) still overrides them where the trainer runs:

    trl        OUT/train.jsonl: the conversational ``prompt``, the task's columns and ``reward_settings`` (JSON),
               which ``trl grpo --dataset_name OUT`` loads (``datasets``' JSON builder) and TRL passes to
               ``integrations.trl.kernel_reward``; ``--multi-turn``: the prompt ``KernelEnvironment`` fills in
    verl       OUT/train.parquet: verl's ``RLHFDataset`` rows (``train.verl.data``), the settings in each row's
               ``extra_info.reward_settings`` for ``compute_score``; each row names verl's single-turn agent loop
               (stage 1), with ``--multi-turn`` ours (``cuda_agent``)
    verifiers  OUT/tasks.jsonl (the task rows ``--env.taskset.tasks`` reads) and OUT/vf-eval.toml, a config
               for ``vf-eval @ OUT/vf-eval.toml`` naming the taskset, the tasks and the harness's settings
               (``single_turn`` unless ``--multi-turn``)
    openenv    OUT/tasks.jsonl and OUT/openenv.env: the variables the OpenEnv package's server reads
               (``CUDA_AGENT_TASKS`` and the reward's), for ``docker run --env-file`` or ``set -a; . FILE``

Single-turn (one reply writes the whole solution) is the default; ``--multi-turn`` writes the agentic episode's
rows. Every JSONL written here is itself a task source (``cuda-agent tasks OUT/tasks.jsonl``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable

from cuda_agent.tasks import Task, load_tasks
from cuda_agent.tasks.rows import task_columns
from cuda_agent.train.evaluators import SETTINGS_ENV, EvaluatorOptions, settings_of
from cuda_agent.train.single_turn import single_turn_messages

FORMATS = ("trl", "verl", "verifiers", "openenv")
DESCRIPTION = ("Write a task source as an RL stack's dataset (TRL, verl, verifiers, OpenEnv), with the reward's "
               "settings; the environment (CUDA_AGENT_SERVICE, CUDA_AGENT_REWARD_*) overrides them at run time.")
TASKSET_ID = "cuda-agent-kernels"  # verifiers' id of our taskset (integrations.verifiers, without importing it)
TASKS_ENV = "CUDA_AGENT_TASKS"  # the OpenEnv package's task source


def multi_turn_prompt() -> list[dict[str, str]]:
    """The prompt of a multi-turn row: our system prompt and an empty user message, which the environment's
    ``reset`` fills with SKILL.md and the task (TRL appends its observation to the last user message)."""
    from cuda_agent.agent.session import SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ""}]


def trl_rows(tasks: Iterable[Task], options: EvaluatorOptions | None = None, *,
             multi_turn: bool = False) -> list[dict[str, Any]]:
    """TRL's prompt rows: ``prompt`` (conversational), the task's columns and, with ``options``, the reward's
    settings as JSON text (one type in every row, whatever the settings hold)."""
    rows = []
    for task in tasks:
        row = {"prompt": multi_turn_prompt() if multi_turn else single_turn_messages(task), **task_columns(task)}
        if options is not None:
            row["reward_settings"] = json.dumps(settings_of(options), sort_keys=True)
        rows.append(row)
    return rows


def export(source: str | Path, fmt: str, out: str | Path, *, levels: Iterable[int] | None = None,
           options: EvaluatorOptions | None = None, multi_turn: bool = False) -> list[Path]:
    """Write the tasks of ``source`` under the folder ``out`` in ``fmt``'s format; returns the files written."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    options = options or EvaluatorOptions()
    tasks = load_tasks(source, levels)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "trl":
        return [_write_jsonl(out / "train.jsonl", trl_rows(tasks, options, multi_turn=multi_turn))]
    if fmt == "verl":
        return [_write_verl(tasks, out / "train.parquet", options, multi_turn)]
    table = _write_jsonl(out / "tasks.jsonl", [task_columns(task) for task in tasks])
    if fmt == "verifiers":
        return [table, _write_vf_config(out / "vf-eval.toml", table, options, multi_turn)]
    settings = {SETTINGS_ENV[k]: v for k, v in settings_of(options).items() if v is not None}
    lines = [f"{TASKS_ENV}={table.resolve()}"] + [f"{k}={_env_value(v)}" for k, v in settings.items()]
    env_file = out / "openenv.env"
    env_file.write_text("\n".join(lines) + "\n")
    return [table, env_file]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_verl(tasks: list[Task], path: Path, options: EvaluatorOptions, multi_turn: bool) -> Path:
    from cuda_agent.train.verl.data import AGENT_NAME, SINGLE_TURN_AGENT, write_parquet

    settings = json.dumps(settings_of(options), sort_keys=True)
    return write_parquet(tasks, path, agent_name=AGENT_NAME if multi_turn else SINGLE_TURN_AGENT,
                         reward_settings=settings)


def _write_vf_config(path: Path, table: Path, options: EvaluatorOptions, multi_turn: bool) -> Path:
    harness = {"id": TASKSET_ID, "single_turn": not multi_turn,
               **{k: v for k, v in settings_of(options).items() if v is not None}}
    lines = [f"# vf-eval @ {path} -m MODEL --client.base-url URL  (--env.agent.harness.NAME=VALUE overrides a setting)",
             "[env.taskset]", f"id = {_toml(TASKSET_ID)}", f"tasks = {_toml(str(table.resolve()))}", "",
             "[env.agent.harness]"] + [f"{k} = {_toml(v)}" for k, v in harness.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


def _env_value(value: Any) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``export`` command's arguments (the CLI registers the subparser and calls ``main``)."""
    from cuda_agent.evaluate.protocol.policy import PRESETS
    from cuda_agent.sandbox import SANDBOX_CHOICES

    parser.add_argument("source", help="tasks: a task file, a folder of them, a KernelBench tree or table, "
                                       "JSONL/parquet, a synth output, a hub dataset")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="fmt", help="the RL stack's dataset format")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--level", type=int, action="append", dest="levels",
                        help="only this KernelBench level (repeatable; default: every task)")
    parser.add_argument("--multi-turn", action="store_true",
                        help="the agentic episode's rows (trl: for KernelEnvironment; verl: our agent loop; "
                             "verifiers: the agentic harness); default: single-turn")
    parser.add_argument("--service", help="the reward's evaluation service (cuda-agent serve URL; default: none, "
                                          "evaluators in the trainer's process)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="local evaluators' device, where no service is used (default: auto)")
    parser.add_argument("--policy", default="fair", choices=sorted(PRESETS),
                        help="the evaluation policy (default: fair)")
    parser.add_argument("--sandbox", default="auto", choices=SANDBOX_CHOICES,
                        help="local evaluators' sandbox (default: auto)")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not time the torch.compile baseline (no reward for beating it)")


def main(args: argparse.Namespace) -> int:
    options = EvaluatorOptions(args.service, args.device, args.policy, args.sandbox, time_compile=not args.no_compile)
    written = export(args.source, args.fmt, args.out, levels=args.levels, options=options,
                     multi_turn=args.multi_turn)
    for path in written:
        print(path)
    return 0
