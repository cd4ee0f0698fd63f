"""``cuda-agent export``: one task source written in each stack's format with the reward's settings, read back by
each stack's loader where it is installed here (``datasets`` for TRL, pyarrow for verl, our task loader), and by the
reward functions' settings reader. No evaluation."""

from __future__ import annotations

import json

import pytest

from cuda_agent.cli import main as cli
from cuda_agent.tasks import load_tasks
from cuda_agent.tasks.rows import task_from_row
from cuda_agent.train.evaluators import options_from_settings
from cuda_agent.train.single_turn import single_turn_messages


def export(examples, tmp_path, fmt, *extra):
    out = tmp_path / fmt
    assert cli(["export", str(examples), "--format", fmt, "--out", str(out), *extra]) == 0
    return out


def test_trl_rows_load_with_datasets_and_carry_the_task_and_the_settings(examples, tmp_path, task):
    datasets = pytest.importorskip("datasets")
    out = export(examples, tmp_path, "trl", "--device", "cpu", "--no-compile", "--service", "http://h:1")
    train = datasets.load_dataset(str(out))["train"]  # what `trl grpo --dataset_name OUT` does
    (row,) = [r for r in train if r["name"] == task.name]
    assert row["prompt"] == single_turn_messages(task) and task_from_row(row) == task
    options = options_from_settings(row["reward_settings"], environ={})
    assert (options.device, options.time_compile, options.service, options.policy) == ("cpu", False, "http://h:1",
                                                                                         "fair")
    multi = export(examples, tmp_path / "m", "trl", "--multi-turn")
    first = json.loads((multi / "train.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and first["prompt"][1]["content"] == ""


def test_verl_rows_hold_the_settings_in_extra_info(examples, tmp_path, task):
    pq = pytest.importorskip("pyarrow.parquet")
    rows = pq.read_table(export(examples, tmp_path, "verl", "--policy", "strict") / "train.parquet").to_pylist()
    (row,) = [r for r in rows if r["extra_info"]["name"] == task.name]
    assert row["agent_name"] == "single_turn_agent" and task_from_row(row["extra_info"]) == task
    assert options_from_settings(row["extra_info"]["reward_settings"], environ={}).policy == "strict"
    agentic = pq.read_table(export(examples, tmp_path / "m", "verl", "--multi-turn") / "train.parquet").to_pylist()
    assert {r["agent_name"] for r in agentic} == {"cuda_agent"}


def test_verifiers_and_openenv_get_a_task_table_and_their_settings_file(examples, tmp_path):
    vf = export(examples, tmp_path, "verifiers", "--sandbox", "none")
    assert [t.name for t in load_tasks(vf / "tasks.jsonl")] == [t.name for t in load_tasks(examples)]
    config = (vf / "vf-eval.toml").read_text()
    assert 'id = "cuda-agent-kernels"' in config and "single_turn = true" in config and 'sandbox = "none"' in config
    oe = export(examples, tmp_path, "openenv", "--service", "http://h:2")
    values = dict(line.split("=", 1) for line in (oe / "openenv.env").read_text().splitlines())
    assert load_tasks(values["CUDA_AGENT_TASKS"]) == load_tasks(oe / "tasks.jsonl")
    assert options_from_settings(environ=values).service == "http://h:2"


def test_an_unknown_format_is_refused_by_argparse(examples, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli(["export", str(examples), "--format", "rllib", "--out", str(tmp_path)])
    assert "invalid choice: 'rllib'" in capsys.readouterr().err
