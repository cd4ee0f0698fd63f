"""The Triton solutions of KernelBench tasks (``tests/gpu/triton_solutions``, evaluated on the GPU by
``tests/gpu/test_gpu_triton.py``) computed through Triton's interpreter on the CPU, on each task's program
with its sizes cut down (the module's size constants), against the task's own Model: a wrong kernel, or a torch
operator in forward that the evaluator's guard would refuse, shows here, without a GPU. One fresh interpreter for
all of them (Triton reads TRITON_INTERPRET as it is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "tests" / "gpu" / "triton_solutions"
# Each task's size constants, cut down so that the interpreter (Python per program) takes seconds; sizes not
# multiples of the kernels' blocks, so that the masks are exercised.
SMALL = {"batch_size": 3, "dim": 5000, "dim1": 37, "dim2": 301, "in_features": 70, "out_features": 150}

PROBE = r'''
import importlib.util, json, sys, types
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from cuda_agent.evaluate.worker.triton_runtime import prepare_triton
from cuda_agent.guard.runtime import ALLOWED_ATEN


class Compute(TorchDispatchMode):
    """The torch operators forward runs beyond allocation and views: what the evaluator's guard refuses."""
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in ALLOWED_ATEN:
            self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


prepare_triton("cpu", None)  # as the candidate's process on the CPU backend: the interpreter, first configs
solutions, kernelbench, small = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rows = {(r["level"], r["problem_id"]): r for r in map(json.loads, open(kernelbench))}
report = {}
for folder in sorted(json.loads(sys.argv[4])):
    level, problem = folder.removeprefix("level").split("_")
    task = types.ModuleType("task")
    exec(rows[(int(level), int(problem))]["code"], task.__dict__)
    for name, value in small.items():
        if name in task.__dict__:
            task.__dict__[name] = value
    if "bias_shape" in task.__dict__:
        task.bias_shape = (task.out_features,)
    spec = importlib.util.spec_from_file_location(f"solution_{folder}", f"{solutions}/{folder}/model_new.py")
    solution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(solution)
    torch.manual_seed(0)
    model = task.Model(*task.get_init_inputs())
    new = solution.ModelNew(*task.get_init_inputs())
    new.load_state_dict(model.state_dict(), strict=True)
    inputs = [torch.randn_like(x) * 3 for x in task.get_inputs()]  # signed: ReLU-like kernels are not the identity
    with torch.no_grad():
        expected = model(*inputs)
        with Compute() as compute:
            got = new(*inputs)
    scale = float(expected.pow(2).mean().sqrt()) or 1.0
    report[folder] = {"shape": list(got.shape) == list(expected.shape),
                      "error": float((got - expected).abs().max()) / scale, "torch": sorted(compute.seen)}
print(json.dumps(report))
'''


def test_every_triton_solution_matches_its_task_through_the_interpreter(kernelbench_jsonl):
    folders = sorted(p.name for p in SOLUTIONS.iterdir() if (p / "model_new.py").is_file())
    assert len(folders) >= 10
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    ran = subprocess.run([sys.executable, "-c", PROBE, str(SOLUTIONS), str(kernelbench_jsonl), json.dumps(SMALL),
                          json.dumps(folders)], env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    wrong = {k: v for k, v in report.items() if not v["shape"] or v["error"] > 1e-4 or v["torch"]}
    assert sorted(report) == folders and not wrong, wrong
