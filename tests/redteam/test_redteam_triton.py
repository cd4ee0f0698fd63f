"""Triton candidates on the CPU backend, through the real evaluator and Triton's interpreter: the example is
correct, the red team's cases that the CPU can show are rejected by the runtime layer alone (static checks
off), and bad Triton gets one line that says what is wrong. The cases that need a compiler (a launch the
build stage never compiled, autotuning on evaluated inputs, side streams, queued work) run on the GPU
(``tests/gpu/test_gpu_triton.py``). Verified only, no timing: these are questions of the checks and rules."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate import Timeouts
from cuda_agent.evaluate.references import ReferencePool

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

CASES = Path(__file__).resolve().parent / "triton_cases"


@pytest.fixture(scope="module")
def evaluator(cache_dir):
    references = ReferencePool(1)
    yield Evaluator("cpu", cache_dir=cache_dir, timeouts=Timeouts(check_s=60, load_s=180), memory_limit=6 * 1024**3,
                    references=references)
    references.close()


@pytest.fixture(scope="module")
def task(examples):
    return load_task(examples / "triton_swish" / "model.py")


def runtime_only(evaluator: Evaluator) -> Evaluator:
    return Evaluator("cpu", policy=evaluator.policy.with_(static_checks=False), cache_dir=evaluator.cache_dir,
                     timeouts=evaluator.timeouts, memory_limit=evaluator.memory_limit, sandbox=evaluator.sandbox,
                     references=evaluator.references)


def test_the_triton_example_is_correct_through_the_interpreter(evaluator, task, examples):
    result = evaluator.verify(task, load_candidate(examples / "triton_swish" / "solution"))
    assert result.status == "correct", result.summary()
    assert result.candidate["language"] == "triton"
    assert any("Triton's interpreter" in note and "timings are the interpreter's" in note for note in result.notes)


def test_torch_called_from_a_kernel_body_is_torch_compute_at_run_time(evaluator, task):
    """With the static checks off: the interpreter dispatches no torch operator of its own on host tensors, so
    every one seen in forward, inside a kernel body run as Python too, is the candidate's. (Torch around the
    kernel, ``torch_in_forward.py``, is the CUDA red team's torch fallback; its Triton case runs on the GPU.)"""
    result = runtime_only(evaluator).verify(task, load_candidate(CASES / "torch_in_kernel.py"))
    detail = f"{result.summary()}\n{result.output[-1500:]}"
    assert (result.status, result.rule) == ("failed", "torch-compute"), detail
    assert "sigmoid" in (result.reason or ""), detail


def test_a_compile_error_is_one_line_naming_it(evaluator, task, examples, tmp_path):
    root = tmp_path / "compile_error"
    shutil.copytree(examples / "triton_swish" / "solution", root)
    text = (root / "model_new.py").read_text().replace("tl.arange(0, BLOCK)", "tl.arange(0, 1000)")
    (root / "model_new.py").write_text(text)
    result = evaluator.verify(task, load_candidate(root))
    assert result.status == "failed" and result.reward == -1.0, result.summary()
    assert "\n" not in result.reason and "power of 2" in result.reason, result.reason


def test_a_wrong_shape_is_one_line_naming_both_shapes(evaluator, task, examples, tmp_path):
    root = tmp_path / "wrong_shape"
    shutil.copytree(examples / "triton_swish" / "solution", root)
    text = (root / "model_new.py").read_text().replace("        return y\n", "        return y[:, :-1]\n")
    (root / "model_new.py").write_text(text)
    result = evaluator.verify(task, load_candidate(root))
    assert (result.status, result.rule) == ("incorrect", "wrong-output"), result.summary()
    assert "\n" not in result.reason and "16383" in result.reason and "16384" in result.reason, result.reason
