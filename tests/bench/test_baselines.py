"""The baselines table: measured with the evaluation core, resumable, compared with published times."""

from __future__ import annotations

import json
import shutil

import pytest

from cuda_agent.bench.baselines import (compare_published, load_published, measure_baselines, read_table,
                                        render_table_report, spearman)
from cuda_agent.tasks import load_task

SANDBOX = "auto" if shutil.which("bwrap") else "none"


@pytest.mark.slow
def test_table_is_measured_resumed_and_reported(tmp_path, examples, cache_dir):
    second = tmp_path / "tanh_sum.py"
    second.write_text("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
                      "        return torch.tanh(x).sum(dim=1)\n\n\ndef get_inputs():\n    return [torch.randn(64, 512)]\n\n\n"
                      "def get_init_inputs():\n    return []\n")
    tasks = [load_task(examples / "cpu_swish" / "model.py"), load_task(second)]
    options = {"sandbox": SANDBOX, "cache_dir": cache_dir, "time_compile": False}
    out = tmp_path / "baselines.jsonl"
    # A deadline of 0 takes no task: nothing is written, and the rerun does everything.
    assert measure_baselines(tasks, out, device="cpu", evaluator_options=options, deadline_s=0) == []
    seen = []
    rows = measure_baselines(tasks[:1], out, device="cpu", evaluator_options=options,
                             progress=lambda done, total, row: seen.append((done, total)))
    assert len(rows) == 1 and seen == [(1, 1)] and rows[0]["eager_ms"] > 0 and rows[0]["degenerate"] is False
    assert rows[0]["environment"]["torch"] and rows[0]["timing"]["method"] == "host"
    with out.open("a") as handle:
        handle.write('{"key": "half a li')  # a run killed mid-write
    again = measure_baselines(tasks, out, device="cpu", evaluator_options=options)
    assert [r["name"] for r in again] == [t.name for t in tasks[1:]]
    table = read_table(out)
    assert len(table) == len(tasks) and len({r["key"] for r in table}) == len(tasks)
    report = render_table_report(table)
    assert "tasks timed" in report and "| level |" in report


def test_spearman_and_published_comparison(tmp_path):
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties share a rank
    assert spearman([1, 2], [1, 2]) is None
    published = {"level1": {f"{i}_Op.py": {"mean": float(i)} for i in range(1, 7)}}
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(published))
    table = load_published(path)
    assert table[(1, "3_Op")] == 3.0
    # Ours are half the H100 times, except one task that is 10x slower than that.
    rows = [{"name": f"level1/{i}_Op", "level": 1, "eager_ms": i / 2 * (10 if i == 4 else 1)} for i in range(1, 7)]
    result = compare_published(rows, table)
    assert result["matched"] == 6 and result["median_ratio"] == pytest.approx(0.5)
    assert result["disagreements"][0]["name"] == "level1/4_Op"
    assert result["disagreements"][0]["vs_typical"] == pytest.approx(10.0)
    assert compare_published([{"name": "x", "level": 9, "eager_ms": 1.0}], table) == {"matched": 0}
