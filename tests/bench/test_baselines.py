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
    third = tmp_path / "relu_max.py"
    third.write_text(second.read_text().replace("torch.tanh(x).sum(dim=1)", "torch.relu(x).amax(dim=1)"))
    tasks.append(load_task(third))
    # Two tasks in flight on the one device: both land, once each.
    again = measure_baselines(tasks, out, device="cpu", per_gpu=2, evaluator_options=options)
    assert sorted(r["name"] for r in again) == sorted(t.name for t in tasks[1:])
    assert all(r["per_gpu"] == 2 and r["durations"]["baseline"] > 0 for r in again)
    table = read_table(out)
    assert len(table) == len(tasks) and len({r["key"] for r in table}) == len(tasks)
    report = render_table_report(table)
    assert "tasks timed" in report and "| level |" in report and "measure again" not in report
    # A row whose degenerate check could not run (out of memory on a shared GPU) is measured again,
    # and the new row replaces it.
    with out.open("a") as handle:
        handle.write(json.dumps(table[0] | {"degenerate_error": "CUDA out of memory"}) + "\n")
    assert "1 tasks to measure again" in render_table_report(read_table(out))
    retried = measure_baselines(tasks, out, device="cpu", evaluator_options=options)
    assert [r["name"] for r in retried] == [table[0]["name"]] and "degenerate_error" not in retried[0]
    final = read_table(out)
    assert len(final) == len(tasks) and final[-1]["name"] == table[0]["name"]


def test_rows_timed_by_another_method_are_timed_again(tmp_path, examples):
    """The committed H200 table was timed with fixed holds; the default now covers the baselines'
    first calls, so resuming that table must time every task again, and rows of the same method
    (written resolved: method "events") count as done."""
    from cuda_agent.bench.baselines import task_key, to_measure
    from cuda_agent.evaluate.protocol.policy import TimingConfig

    task = load_task(examples / "cpu_swish" / "model.py")
    out = tmp_path / "baselines.jsonl"
    old = TimingConfig(baseline_hold="fixed").resolved("cuda").to_dict()
    out.write_text(json.dumps({"key": task_key(task), "timing": old, "eager_ms": 1.0}) + "\n")
    assert to_measure([task], out, TimingConfig(), "cuda") == [task]
    assert to_measure([task], out, TimingConfig(baseline_hold="fixed"), "cuda") == []
    # On the CPU a hold changes nothing: the same row serves either setting.
    cpu = TimingConfig(baseline_hold="fixed").resolved("cpu").to_dict()
    out.write_text(json.dumps({"key": task_key(task), "timing": cpu, "eager_ms": 1.0}) + "\n")
    assert to_measure([task], out, TimingConfig(), "cpu") == []
    assert to_measure([task], out, TimingConfig(rounds_min=7), "cpu") == [task]


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


class _RecordingLock:
    def __init__(self):
        self.entered = 0
        self.held = False

    def __enter__(self):
        assert not self.held
        self.entered += 1
        self.held = True

    def __exit__(self, *exc):
        self.held = False


@pytest.mark.slow
def test_baseline_times_and_checks_under_the_timing_lock(examples, cache_dir):
    from cuda_agent.evaluate.evaluator import Evaluator

    lock = _RecordingLock()
    evaluator = Evaluator("cpu", sandbox=SANDBOX, cache_dir=cache_dir, time_compile=False, timing_lock=lock)
    record = evaluator.baseline(load_task(examples / "cpu_swish" / "model.py"), refresh=True, degenerate=True)
    # Once for the timing, once for the degenerate check's model calls; never left held.
    assert lock.entered == 2 and not lock.held
    assert record["eager"]["median_ms"] > 0 and set(record["durations"]) == {"load", "baseline", "degenerate"}
    with pytest.raises(ValueError, match="per_gpu"):
        measure_baselines([], cache_dir / "t.jsonl", device="cpu", per_gpu=0)
