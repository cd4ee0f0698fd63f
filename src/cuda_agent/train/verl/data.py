"""Tasks as verl's training data: one parquet row per task, in the shape ``verl.utils.dataset.RLHFDataset`` reads.

    data_source   a name for verl's per-source metrics
    prompt        chat messages (``data.prompt_key``): the single-turn prompt of the task
                  (``single_turn.single_turn_messages``). verl's single-turn loop samples from it; our agent loop
                  builds its own conversation (system prompt, SKILL.md, the task) and only reads ``extra_info``
    ability       "cuda"
    reward_model  {"style": "rule", "ground_truth": the task's digest}: verl's reward managers read
                  ``ground_truth``; the judge is the evaluator, so it only names the task's content
    extra_info    the task itself (``tasks.rows.task_columns``; ``task_from_row`` reads it back) and ``index``
                  (verl's sample index)
    agent_name    the agent loop verl runs for the row: ``cuda_agent`` (``agent_loop.CudaAgentLoop``), or
                  ``single_turn_agent`` (verl's own, with ``reward.compute_score``)

``python -m cuda_agent.train.verl.data SOURCE OUT.parquet`` converts from the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable

from cuda_agent.candidates.triton import LANGUAGES
from cuda_agent.tasks import Task, load_tasks
from cuda_agent.tasks.rows import task_columns
from cuda_agent.train.single_turn import single_turn_messages

AGENT_NAME = "cuda_agent"  # the name CudaAgentLoop is registered under
SINGLE_TURN_AGENT = "single_turn_agent"  # verl's single-turn loop (verl/experimental/agent_loop)


def task_row(task: Task, index: int, *, agent_name: str = AGENT_NAME, data_source: str = "cuda_agent",
             split: str = "train", reward_settings: str | None = None, language: str = "cuda") -> dict[str, Any]:
    """One dataset row for ``task``, asking for kernels in ``language`` (``extra_info.language``);
    ``reward_settings`` (JSON, ``train.evaluators.settings_of``) in its ``extra_info`` for ``reward.compute_score``."""
    return {
        "data_source": data_source,
        "prompt": single_turn_messages(task, language),
        "ability": language,
        "reward_model": {"style": "rule", "ground_truth": task.digest},
        "extra_info": {"index": index, "split": split, "language": language, **task_columns(task),
                       "reward_settings": reward_settings},
        "agent_name": agent_name,
    }


def tasks_to_parquet(source: str | Path, out_path: str | Path, *, levels: Iterable[int] | None = None,
                     agent_name: str = AGENT_NAME, data_source: str = "cuda_agent", split: str = "train",
                     language: str = "cuda") -> Path:
    """Every task of ``source`` (anything ``tasks.load_tasks`` reads) as a verl dataset at ``out_path``."""
    return write_parquet(load_tasks(source, levels), out_path, agent_name=agent_name, data_source=data_source,
                         split=split, language=language)


def write_parquet(tasks: Iterable[Task], out_path: str | Path, *, agent_name: str = AGENT_NAME,
                  data_source: str = "cuda_agent", split: str = "train", reward_settings: str | None = None,
                  language: str = "cuda") -> Path:
    """``tasks`` as a verl dataset at ``out_path`` (``cuda-agent export --format verl`` writes through it)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        from cuda_agent.paths import install_hint
        raise ImportError(f"writing verl's parquet needs pyarrow: {install_hint('verl')}") from None
    rows = [task_row(task, i, agent_name=agent_name, data_source=data_source, split=split,
                     reward_settings=reward_settings, language=language) for i, task in enumerate(tasks)]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_schema(pa)), out)
    return out


def _schema(pa: Any) -> Any:
    # Stated, not inferred: a file whose tasks have no level would get a null column, and verl concatenates
    # its data files, which needs one schema.
    text = pa.string()
    return pa.schema([
        ("data_source", text),
        ("prompt", pa.list_(pa.struct([("role", text), ("content", text)]))),
        ("ability", text),
        ("reward_model", pa.struct([("style", text), ("ground_truth", text)])),
        ("extra_info", pa.struct([("index", pa.int64()), ("split", text), ("language", text), ("name", text),
                                  ("code", text), ("source", text), ("level", pa.int64()),
                                  ("problem_id", pa.int64()), ("reward_settings", text)])),
        ("agent_name", text),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cuda_agent.train.verl.data", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="tasks: a .py file, a folder of task files, a KernelBench directory, JSONL/parquet, a hub dataset")
    parser.add_argument("out", help="the parquet file to write (verl's data.train_files / data.val_files)")
    parser.add_argument("--levels", type=int, nargs="*", help="only these KernelBench levels")
    parser.add_argument("--agent", default=AGENT_NAME,
                        help=f"the agent loop per row: {AGENT_NAME} (agentic) or {SINGLE_TURN_AGENT} (single-turn)")
    parser.add_argument("--data-source", default="cuda_agent")
    parser.add_argument("--split", default="train")
    parser.add_argument("--language", default="cuda", choices=LANGUAGES, help="the kernels each row asks for")
    args = parser.parse_args(argv)
    out = tasks_to_parquet(args.source, args.out, levels=args.levels or None, agent_name=args.agent,
                           data_source=args.data_source, split=args.split, language=args.language)
    print(out)


if __name__ == "__main__":
    main()
