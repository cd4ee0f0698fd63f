"""Single-turn replies into candidates: named fenced blocks become a workspace, one load_inline file
is read as KernelBench's format, anything else is the failure reward with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_agent import Evaluator, load_task
from cuda_agent.candidates import CandidateError
from cuda_agent.train.single_turn import FAILURE_REWARD, candidate_from_reply, reply_files, score_reply, \
    single_turn_messages


def reply_with(solution: Path) -> str:
    """The example's solution as a model would write it in one reply."""
    parts = ["Here is the solution.\n"]
    for path in sorted(solution.rglob("*")):
        if path.is_file():
            rel = path.relative_to(solution).as_posix()
            lang = {"py": "python", "cpp": "cpp", "cu": "cuda"}.get(path.suffix.lstrip("."), "")
            parts.append(f"### {rel}\n```{lang}\n{path.read_text().rstrip()}\n```\n")
    return "\n".join(parts) + "\nThe kernel fuses the sigmoid and the scale.\n"


def test_named_blocks_become_the_workspace_files(examples, tmp_path):
    solution = examples / "cpu_swish" / "solution"
    files = reply_files(reply_with(solution))
    assert set(files) == {"model_new.py", "kernels/scaled_swish.cpp", "kernels/scaled_swish_binding.cpp"}
    assert files["model_new.py"] == (solution / "model_new.py").read_text().rstrip() + "\n"
    candidate = candidate_from_reply(reply_with(solution), tmp_path / "c")
    assert candidate.kind == "workspace"
    assert "kernels/scaled_swish.cpp" in candidate.extensions[0].sources


def test_a_single_load_inline_file_is_kernelbench_format(tmp_path):
    code = ("import torch\nfrom torch.utils.cpp_extension import load_inline\n"
            "src = 'torch::Tensor f(torch::Tensor x) { return x; }'\n"
            "ext = load_inline(name='ext', cpp_sources=src, functions=['f'])\n"
            "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return ext.f(x)")
    candidate = candidate_from_reply(f"```python\n{code}\n```", tmp_path)
    assert candidate.kind == "inline"


@pytest.mark.parametrize("reply, reason", [
    ("I would write a kernel that fuses the two operations.", "no model_new.py"),
    ("### ../model_new.py\n```python\nclass ModelNew: pass\n```", "outside the workspace"),
    ("### model_new.py\n```python\nclass Model: pass\n```", "no `class ModelNew`"),
])
def test_replies_without_a_usable_candidate_say_why(reply, reason, tmp_path):
    with pytest.raises(CandidateError, match=reason):
        candidate_from_reply(reply, tmp_path)


def test_the_prompt_carries_the_task(examples):
    task = load_task(examples / "cpu_swish" / "model.py")
    (message,) = single_turn_messages(task)
    assert "class Model" in message["content"] and "### model_new.py" in message["content"]


@pytest.mark.slow
def test_a_reply_is_scored_by_the_real_evaluator(examples, cache_dir, tmp_path):
    task = load_task(examples / "cpu_swish" / "model.py")
    evaluator = Evaluator("cpu", cache_dir=cache_dir)
    good = score_reply(task, reply_with(examples / "cpu_swish" / "solution"), evaluator, tmp_path / "good")
    assert good.reward >= 1 and good.reason == "correct" and good.evaluation["status"] == "correct"
    none = score_reply(task, "No code today.", evaluator, tmp_path / "none")
    assert (none.reward, none.evaluation) == (FAILURE_REWARD, None) and "no model_new.py" in none.reason


def test_a_triton_reply_is_a_triton_candidate_named_or_not(examples, tmp_path):
    solution = examples / "triton_swish" / "solution"
    named = candidate_from_reply(reply_with(solution), tmp_path / "named", language="triton")
    assert (named.kind, named.language) == ("triton", "triton")
    source = (solution / "model_new.py").read_text()
    bare = candidate_from_reply(f"Here it is:\n```python\n{source}```\nDone.", tmp_path / "bare")
    assert bare.language == "triton" and bare.model_new == named.model_new


def test_a_reply_not_in_the_asked_language_is_the_failure_reward_with_the_reason(examples, tmp_path):
    task = load_task(examples / "triton_swish" / "model.py")
    outcome = score_reply(task, reply_with(examples / "cpu_swish" / "solution"), evaluator=None,
                          where=tmp_path / "c", language="triton")
    assert outcome.reward == FAILURE_REWARD and "model_new.py alone" in outcome.reason


def test_the_triton_prompt_asks_for_triton(examples):
    task = load_task(examples / "triton_swish" / "model.py")
    triton_prompt = single_turn_messages(task, "triton")[0]["content"]
    assert "@triton.jit" in triton_prompt and "REGISTER_BINDING" not in triton_prompt and task.code.strip() in triton_prompt
    assert "Triton" not in single_turn_messages(task)[0]["content"]
    with pytest.raises(CandidateError, match="unknown candidate language"):
        single_turn_messages(task, "mojo")
