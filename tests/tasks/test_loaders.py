import json
import sys

import pytest

from cuda_agent.tasks import Task, TaskError, load_task, load_tasks
from cuda_agent.tasks.loaders import load_hf_dataset

GOOD = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)

def get_inputs():
    return [torch.randn(4, 4)]

def get_init_inputs():
    return []
"""


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_single_file(tmp_path):
    task = load_task(write(tmp_path / "relu.py", GOOD))
    assert task.name == "relu" and task.code == GOOD and task.level is None
    assert len(task.digest) == 64


def test_model_py_is_named_after_its_folder(examples):
    assert load_task(examples / "cpu_swish" / "model.py").name == "cpu_swish"


@pytest.mark.parametrize(
    "code, message",
    [
        ("def broken(:\n", "syntax error at line 1"),
        (GOOD.replace("class Model", "class Other"), "missing Model"),
        (GOOD.replace("def get_inputs", "def other_inputs"), "missing get_inputs"),
        (GOOD.replace("def get_init_inputs", "def other"), "missing get_init_inputs"),
        (GOOD.replace("class Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)", "Model = 3"), "must be a class"),
    ],
)
def test_malformed_file_names_file_and_problem(tmp_path, code, message):
    path = write(tmp_path / "bad.py", code)
    with pytest.raises(TaskError) as info:
        load_task(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_kernelbench_checkout(tmp_path):
    for level, pid, name in [(1, 2, "2_B"), (1, 10, "10_C"), (1, 1, "1_A"), (2, 1, "1_D")]:
        write(tmp_path / "KernelBench" / f"level{level}" / f"{name}.py", GOOD)
    write(tmp_path / "KernelBench" / "level1" / "helper.py", "x = 1\n")  # not a problem file
    tasks = load_tasks(tmp_path)
    assert [t.name for t in tasks] == ["level1/1_A", "level1/2_B", "level1/10_C", "level2/1_D"]
    assert [t.problem_id for t in tasks] == [1, 2, 10, 1]
    assert [t.name for t in load_tasks(tmp_path, levels=[2])] == ["level2/1_D"]
    assert len(load_tasks(tmp_path / "KernelBench" / "level1")) == 3


def test_kernelbench_checkout_malformed(tmp_path):
    write(tmp_path / "level1" / "1_A.py", GOOD)
    bad = write(tmp_path / "level1" / "2_B.py", GOOD.replace("def get_inputs", "def nope"))
    with pytest.raises(TaskError, match=f"{bad}: missing get_inputs"):
        load_tasks(tmp_path)
    with pytest.raises(TaskError, match="not a KernelBench checkout"):
        load_tasks(write(tmp_path / "empty" / "README", "x").parent)


def kernelbench_rows():
    return [
        {"level": 1, "problem_id": 19, "name": "19_ReLU", "code": GOOD},
        {"level": 2, "problem_id": 3, "name": "3_Fused", "code": GOOD},
    ]


def test_jsonl_table_and_selectors(tmp_path):
    table = tmp_path / "kb.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in kernelbench_rows()) + "\n")
    tasks = load_tasks(table)
    assert [t.name for t in tasks] == ["level1/19_ReLU", "level2/3_Fused"]
    assert load_task(f"{table}#2/3").name == "level2/3_Fused"
    assert load_task(f"{table}#19_ReLU").problem_id == 19
    with pytest.raises(TaskError, match="matched 0 tasks"):
        load_task(f"{table}#9/9")
    with pytest.raises(TaskError, match="holds 2 tasks"):
        load_task(table)
    # Every task source takes a selector, not only load_task: `tasks`, `degenerate`, `bench`, ...
    assert [t.name for t in load_tasks(f"{table}#1/19")] == ["level1/19_ReLU"]
    assert [t.name for t in load_tasks(f"{table}#3_Fused", levels=[2])] == ["level2/3_Fused"]
    with pytest.raises(TaskError, match="'3_Fused' matched 0 tasks"):
        load_tasks(f"{table}#3_Fused", levels=[1])
    with pytest.raises(TaskError, match="matched 2 tasks"):
        load_task(f"{write(tmp_path / 'twice.jsonl', table.read_text() * 2)}#1/19")


def test_parquet_table(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "kb.parquet"
    pq.write_table(pa.Table.from_pylist(kernelbench_rows()), path)
    assert [t.level for t in load_tasks(path)] == [1, 2]


def test_ops6k_table(tmp_path):
    rows = [{"code": GOOD, "ops": '["nn.ReLU", "torch.diag"]', "data_source": "torch#2"},
            {"code": GOOD, "ops": ["nn.LayerNorm"], "data_source": "torch#1"}]
    path = tmp_path / "ops.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tasks = load_tasks(path)
    assert [t.name for t in tasks] == ["ops6k/0", "ops6k/1"]
    assert tasks[0].metadata == {"ops": ["nn.ReLU", "torch.diag"], "data_source": "torch#2"}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"level": 1, "problem_id": 1, "name": "x", "code": "def f(:"}], "kb.jsonl:1: syntax error"),
        ([{"level": 1, "problem_id": 1, "name": "x", "code": GOOD}, {"level": 1, "problem_id": 2, "name": "y", "code": "import torch\n"}],
         "kb.jsonl:2: missing Model, get_inputs, get_init_inputs"),
        ([{"level": 1, "problem_id": 1, "name": "x", "code": ""}], "kb.jsonl:1: the `code` column is empty"),
        ([{"prompt": "x"}], "unknown table columns"),
    ],
)
def test_malformed_table_rows(tmp_path, rows, message):
    path = tmp_path / "kb.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(TaskError, match=message):
        load_tasks(path)


def test_invalid_json_line(tmp_path):
    path = tmp_path / "kb.jsonl"
    path.write_text('{"level": 1}\nnot json\n')
    with pytest.raises(TaskError, match="kb.jsonl:2: invalid JSON"):
        load_tasks(path)


def test_shared_kernelbench_data(kernelbench_jsonl):
    tasks = load_tasks(kernelbench_jsonl)
    assert len(tasks) == 270
    assert sum(t.level == 1 for t in tasks) == 100
    relu = load_task(f"{kernelbench_jsonl}#1/19")
    assert relu.name == "level1/19_ReLU" and "torch.relu" in relu.code


def test_hf_dataset_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TaskError, match=r"needs the `datasets` package.*pip install -e '\.\[data\]'"):
        load_hf_dataset("ScalingIntelligence/KernelBench")


def test_hf_dataset_rows_through_the_same_checks(monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(name, split=None):
            return {"level_1": kernelbench_rows()[:1], "level_2": [{**kernelbench_rows()[1], "code": "x = 1"}]}

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(TaskError, match=r"org/kb\[level_2\]:1: missing Model"):
        load_tasks("org/kb")


def test_missing_path():
    with pytest.raises(TaskError, match="no such file"):
        load_tasks("/nonexistent/path.py")


def test_task_is_plain_data():
    task = Task(name="a", code=GOOD, source="a.py")
    assert task.to_dict()["digest"] == task.digest


def test_binary_file_names_the_file(tmp_path):
    binary = tmp_path / "model.py"
    binary.write_bytes(b"import torch\n\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(TaskError, match=rf"{binary}: not UTF-8 text \(byte 0x89 at offset 13\)"):
        load_task(binary)
    table = tmp_path / "kb.jsonl"
    table.write_bytes(b'{"level": 1}\n\xff\n')
    with pytest.raises(TaskError, match=rf"{table}: not UTF-8 text"):
        load_tasks(table)


def test_a_folder_of_task_files_is_a_task_source(tmp_path):
    # examples/' layout (a folder per task with model.py, its solution beside it) and a flat folder of tasks
    write(tmp_path / "swish" / "model.py", GOOD)
    write(tmp_path / "swish" / "solution" / "model_new.py", "class ModelNew: pass\n")
    write(tmp_path / "relu.py", GOOD)
    assert [t.name for t in load_tasks(tmp_path)] == ["relu", "swish"]
