"""GPU tests: run on a CUDA machine with `pytest -m gpu` (see README).

Evaluates the CUDA examples and CUDA solutions written for KernelBench level 1
and 2 tasks end to end, and a deliberately wrong solution that must fail.
Set CUDA_AGENT_GPU_REPORT=path.jsonl to keep every record.
"""

import json
import os
from pathlib import Path

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.build import compile_only
from cuda_agent.evaluate.pool import evaluate_many

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SOLUTIONS = Path(__file__).parent / "kernelbench_solutions"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# KernelBench task folder name -> its solution; level 1 / 23 (row softmax) is solved by the example itself.
SOLUTION_DIRS = {p.name: p for p in SOLUTIONS.glob("level*") if p.is_dir()} | {
    "level1_23": EXAMPLES / "cuda_row_softmax" / "solution",
}
KERNELBENCH_SOLUTIONS = sorted(SOLUTION_DIRS)


def record(result):
    path = os.environ.get("CUDA_AGENT_GPU_REPORT")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(result.to_dict()) + "\n")
    print("\n" + result.summary())


@pytest.fixture(scope="module")
def evaluator(cache_dir):
    # Long-lived, as in the agent and bench: each evaluation starts the next one's processes.
    with Evaluator("cuda", cache_dir=cache_dir, prestart=True) as evaluator:
        yield evaluator


def kernelbench_task(jsonl, folder):
    level, problem = folder.removeprefix("wrong_").removeprefix("level").split("_")
    return load_task(f"{jsonl}#{level}/{problem}")


@pytest.mark.parametrize("folder", KERNELBENCH_SOLUTIONS)
def test_kernelbench_solution(folder, kernelbench_jsonl, evaluator):
    task = kernelbench_task(kernelbench_jsonl, folder)
    result = evaluator.evaluate(task, load_candidate(SOLUTION_DIRS[folder]))
    record(result)
    assert result.status == "correct", result.summary() + (result.traceback or "") + result.output
    assert result.reward >= 1.0
    assert result.times["candidate"]["method"] == "events"
    assert not [n for n in result.notes if "through files" in n]  # outputs came through shared, pinned memory
    assert result.environment.get("gpu")


def test_wrong_solution_fails_verification(kernelbench_jsonl, evaluator):
    task = kernelbench_task(kernelbench_jsonl, "wrong_level1_19")
    result = evaluator.evaluate(task, load_candidate(SOLUTIONS / "wrong_level1_19"))
    record(result)
    assert result.status == "incorrect" and result.reward == -1.0
    assert result.checks and not result.checks[-1]["ok"]


def test_cuda_examples_through_the_pool(examples, cache_dir):
    names = sorted(p.name for p in examples.glob("cuda_*"))
    pairs = [(load_task(examples / n / "model.py"), load_candidate(examples / n / "solution")) for n in names]
    results = evaluate_many(pairs, "cuda", cache_dir=cache_dir)
    for result in results:
        record(result)
    assert [r.status for r in results] == ["correct"] * len(names), [r.reason for r in results]


def test_compile_only_and_profiler_timing(examples, cache_dir):
    candidate = load_candidate(examples / "cuda_gelu" / "solution")
    assert compile_only(candidate, "cuda", cache_dir=cache_dir).ok
    from cuda_agent import TimingConfig

    result = Evaluator("cuda", cache_dir=cache_dir, timing=TimingConfig(method="profiler")).evaluate(
        load_task(examples / "cuda_gelu" / "model.py"), candidate
    )
    record(result)
    assert result.status == "correct" and result.times["candidate"]["method"] == "profiler"
    assert result.times["candidate"]["median_ms"] > 0


def test_illegal_memory_access_is_a_record(examples, cache_dir, tmp_path, evaluator):
    """A kernel that faults kills only its own process; the next evaluation works."""
    root = tmp_path / "oob"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "oob.cu").write_text(
        "#include <cuda_runtime.h>\n"
        "__global__ void oob(float* y) { y[(size_t)1 << 40] = 1.0f; }\n"
        'extern "C" void oob_launch(float* y) { oob<<<1, 1>>>(y); }\n'
    )
    (root / "kernels" / "oob_binding.cpp").write_text(
        '#include "../binding_registry.h"\n'
        'extern "C" void oob_launch(float* y);\n'
        "static torch::Tensor run(torch::Tensor x) { auto y = torch::empty_like(x); oob_launch(y.data_ptr<float>()); return y; }\n"
        'static void reg(pybind11::module& m) { m.def("oob", &run); }\n'
        "REGISTER_BINDING(oob, reg)\n"
    )
    (root / "model_new.py").write_text(
        "import torch.nn as nn\nimport cuda_extension\n"
        "class ModelNew(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "    def forward(self, x):\n        return cuda_extension.oob(x)\n"
    )
    task = load_task(examples / "cuda_gelu" / "model.py")
    result = evaluator.evaluate(task, load_candidate(root))
    record(result)
    assert result.status == "failed" and result.reward == -1.0
    good = evaluator.evaluate(task, load_candidate(examples / "cuda_gelu" / "solution"))
    assert good.status == "correct"
