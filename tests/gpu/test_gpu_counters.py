"""Hardware counters on the GPU (issue 16): Nsight Compute in the sandbox names the bottleneck of a
memory-bound elementwise kernel, a naive GEMM and a launch-bound tiny kernel, and the agent reads the
report through utils/profile.py.

``CUDA_AGENT_COUNTERS_FIXTURES=DIR`` keeps each case's raw ncu CSV and task facts under DIR/NAME: the
fixtures of tests/evaluate/test_counters.py were captured so.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from cuda_agent.agent.commands import CommandServer
from cuda_agent.agent.workspace import create_workspace
from cuda_agent.candidates import load_candidate
from cuda_agent.evaluate import Evaluator
from cuda_agent.evaluate.counters import times_of
from cuda_agent.tasks import load_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = Path(__file__).parent / "counters_cases"
SOLUTIONS = Path(__file__).parent / "kernelbench_solutions"


@pytest.fixture(scope="module")
def evaluator(cache_dir):
    with Evaluator("cuda", cache_dir=cache_dir, prestart=True) as evaluator:
        yield evaluator


def profiled(evaluator, task, candidate, name):
    result = evaluator.evaluate(task, candidate)
    assert result.status == "correct", result.summary() + result.output
    keep = os.environ.get("CUDA_AGENT_COUNTERS_FIXTURES")
    report = evaluator.counters(task, candidate, times_of(result), raw_to=Path(keep) / name if keep else None)
    text = report.text()
    print(f"\n{name}: profile took {report.seconds} s, evaluation {result.durations.get('total')} s\n{text}")
    path = os.environ.get("CUDA_AGENT_GPU_REPORT")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"counters_case": name, "seconds": report.seconds,
                                     "evaluation_s": result.durations.get("total"), "report": report.to_dict()}) + "\n")
    assert report.available, report.reason
    assert len(text.splitlines()) <= 40
    return report


def own(report):
    kernels = [k for k in report.kernels if k.origin == "own"]
    assert kernels, [(k.name, k.origin) for k in report.kernels]
    return kernels[0]


def test_memory_bound_elementwise_kernel(examples, evaluator):
    task, candidate = load_task(examples / "cuda_gelu" / "model.py"), load_candidate(examples / "cuda_gelu" / "solution")
    report = profiled(evaluator, task, candidate, "cuda_gelu")
    kernel = own(report)
    assert kernel.bound == "memory", kernel
    assert kernel.dram_pct > 60, kernel  # 1 GiB in, 1 GiB out: DRAM is the bottleneck
    sol = report.speed_of_light
    assert sol.limit == "memory" and sol.bytes == 2 * 16384 * 16384 * 4
    assert report.share("own") > 0.95


def test_naive_gemm(evaluator):
    task = load_task(CASES / "naive_gemm" / "model.py")
    report = profiled(evaluator, task, load_candidate(CASES / "naive_gemm" / "solution.py"), "naive_gemm")
    kernel = own(report)
    # No tiling: every operand comes through L1 again and again (97% of its peak on the H200), DRAM
    # stays far from its peak and the FLOPs far from theirs.
    assert kernel.bound == "memory" and "tile it" in kernel.why, kernel
    assert kernel.dram_pct < 50, kernel
    assert report.speed_of_light.limit == "compute"
    assert report.speed_of_light.flops == 2 * 2048**3
    assert report.times_ms["candidate"] * 1e3 > 3 * report.speed_of_light.time_us


def test_launch_bound_tiny_kernel(evaluator):
    task = load_task(CASES / "tiny_scale" / "model.py")
    report = profiled(evaluator, task, load_candidate(CASES / "tiny_scale" / "solution.py"), "tiny_scale")
    kernel = own(report)
    assert kernel.bound == "launch", kernel
    assert "launch-bound" in report.verdict
    assert "one kernel launch" in report.text()  # 2 KB at 4.8 TB/s is no floor; a launch is


@pytest.mark.parametrize("folder", ["level1_19", "level2_76"])
def test_kernelbench_solutions(folder, kernelbench_jsonl, evaluator):
    level, problem = folder.removeprefix("level").split("_")
    task = load_task(f"{kernelbench_jsonl}#{level}/{problem}")
    report = profiled(evaluator, task, load_candidate(SOLUTIONS / folder), folder)
    assert own(report).bound in ("memory", "compute", "latency", "launch")
    assert report.speed_of_light is not None and report.speed_of_light.time_us > 0


def test_agent_reads_counters_through_profile(examples, evaluator, tmp_path):
    task = load_task(examples / "cuda_gelu" / "model.py")
    workspace = create_workspace(tmp_path / "ws", task, evaluator.policy, "cuda")
    solution = examples / "cuda_gelu" / "solution"
    (workspace.root / "model_new.py").write_text((solution / "model_new.py").read_text())
    for source in (solution / "kernels").iterdir():
        (workspace.root / "kernels" / source.name).write_text(source.read_text())
    with CommandServer(workspace.root, task, evaluator) as server:
        text, code = server.run("profile")
    print(text)
    assert code == 0, text
    assert "counters (" in text and "speed of light" in text and "own" in text
    counters = server.evaluations[-1].result["counters"]  # structured, in the trajectory
    assert counters["available"] is True
    assert counters["kernels"][0]["origin"] == "own" and counters["kernels"][0]["bound"] == "memory"
