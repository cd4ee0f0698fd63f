"""The episode core under every adapter, and the converters from a folder of task files (no RL library needed)."""

from __future__ import annotations

import inspect
import json

import pyarrow.parquet as pq
import pytest

from cuda_agent.agent.session import AgentConfig
from cuda_agent.agent.commands import Evaluation
from cuda_agent.candidates import CandidateError
from cuda_agent.integrations.core import (completion_text, feedback, load_task_rows, rollout_metrics, row_language,
                                          task_columns, task_from_row)
from cuda_agent.integrations.tool_functions import tool_function, tool_schemas
from cuda_agent.tasks import TaskError
from cuda_agent.train.verl.data import main as verl_data


def test_verls_converter_takes_a_folder_of_task_files(examples, tmp_path, capsys):
    """``python -m cuda_agent.train.verl.data examples/ out.parquet`` (it ended in a traceback: a folder of task
    files was not a task source)."""
    verl_data([str(examples), str(tmp_path / "out.parquet")])
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["extra_info"]["name"] for r in rows) == ["cpu_swish", "cuda_bias_scale_tanh", "cuda_gelu",
                                                            "cuda_row_softmax", "triton_swish"]
    assert {r["extra_info"]["language"] for r in rows} == {"cuda"}
    assert capsys.readouterr().out.strip() == str(tmp_path / "out.parquet")


def test_a_row_carries_its_task_in_columns_or_in_extra_info(examples, task):
    (row,) = [r for r in load_task_rows(examples) if r["name"] == task.name]
    assert task_from_row(row) == task
    assert task_from_row({"extra_info": task_columns(task)}) == task
    with pytest.raises(TaskError, match="name and code"):
        task_from_row({"prompt": "no task here"})


def test_completions_in_either_trl_format_are_text():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == "a\nb"


def test_tool_functions_carry_the_schema_and_forward_their_arguments():
    calls = []
    schemas = {s["function"]["name"]: s for s in tool_schemas(AgentConfig(max_output_chars=1234))}
    assert "1234" in schemas["bash"]["function"]["description"]  # the episode's limits are in the text
    read = tool_function(schemas["read"], lambda name, arguments: calls.append((name, arguments)) or "ok")
    params = inspect.signature(read).parameters
    assert list(params)[0] == "path" and params["path"].default is inspect.Parameter.empty
    assert params["offset"].default is None  # optional: the tool's own default applies when left out
    assert read("model.py", limit=5) == "ok"
    assert calls == [("read", {"path": "model.py", "limit": 5})]


def test_rollout_metrics_are_kernelbenchs_fast_p_the_speedups_and_the_rewards_parts():
    final = {"status": "correct", "speedup_eager": 1.5, "speedup_compile": 0.9, "reward": 2.0,
             "decision": {"speedups": {"eager": {"beats": True}, "compile": {"beats": False}}}}
    assert rollout_metrics(final) == {"correct": 1.0, "no_verdict": 0.0, "speedup_eager": 1.5, "speedup_compile": 0.9,
                                      "beats_eager": 1.0, "beats_compile": 0.0, "fast_0": 1.0, "fast_1": 1.0,
                                      "fast_2": 0.0}
    wrong = rollout_metrics({"status": "incorrect", "speedup_eager": 3.0})  # a wrong kernel's speed counts for nothing
    assert wrong["correct"] == wrong["fast_0"] == wrong["speedup_eager"] == 0.0
    assert rollout_metrics(None)["correct"] == 0.0 and rollout_metrics({"status": "error"})["no_verdict"] == 1.0


def test_feedback_says_what_an_evaluation_said_and_why_there_was_no_verdict():
    failed = feedback(Evaluation("compile", 3, 1.0, {"status": "failed", "stage": "build", "reason": "nvcc: error"}))
    assert failed == {"command": "compile", "turn": 3, "status": "failed", "stage": "build", "reason": "nvcc: error"}
    busy = feedback(Evaluation("verify", 4, 1.0, {"status": "error", "stage": "profile", "reason": "busy",
                                                  "attempts": 3}))
    assert busy["no_verdict"] and busy["reason"].startswith("no verdict") and "after 3 attempts" in busy["reason"]


def test_rows_ask_for_the_language_given_or_the_one_a_synthesised_task_names(examples, tmp_path):
    code = (examples / "cpu_swish" / "model.py").read_text()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"code": code, "ops": ["sigmoid"], "data_source": "synth", "language": "triton"}) + "\n"
                     + json.dumps({"code": code, "ops": ["sigmoid"], "data_source": "synth"}) + "\n")
    rows = load_task_rows(tasks)
    assert [r["language"] for r in rows] == ["triton", "cuda"]
    assert "@triton.jit" in rows[0]["prompt"][0]["content"] and "@triton.jit" not in rows[1]["prompt"][0]["content"]
    assert {r["language"] for r in load_task_rows(tasks, language="cuda")} == {"cuda"}
    assert row_language({"language": None}) == "cuda"
    with pytest.raises(CandidateError, match="unknown candidate language"):
        row_language({"language": "fortran"})
    verl_data([str(tasks), str(tmp_path / "t.parquet"), "--language", "triton"])
    (first, _) = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert first["extra_info"]["language"] == "triton" and "@triton.jit" in first["prompt"][0]["content"]
