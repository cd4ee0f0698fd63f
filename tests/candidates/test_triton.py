"""Triton candidates: declared or detected, and a one-line error for what is neither."""

from __future__ import annotations

import shutil

import pytest

from cuda_agent.candidates import CandidateError, load_candidate
from cuda_agent.candidates.triton import triton_candidate, triton_kernels


def test_the_example_is_detected_as_triton(examples):
    candidate = load_candidate(examples / "triton_swish" / "solution")
    assert (candidate.kind, candidate.language, candidate.extensions) == ("triton", "triton", ())
    assert candidate.to_dict()["language"] == "triton"


def test_a_single_file_is_detected_and_a_declared_language_is_obeyed(examples, tmp_path):
    source = (examples / "triton_swish" / "solution" / "model_new.py").read_text()
    path = tmp_path / "generation.py"
    path.write_text(source)
    assert load_candidate(path).language == "triton"
    assert load_candidate(path, language="triton").digest == load_candidate(path).digest
    with pytest.raises(CandidateError, match="unknown candidate language 'rust'"):
        load_candidate(path, language="rust")


def test_the_cuda_examples_stay_cuda(examples):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    assert (candidate.kind, candidate.language) == ("workspace", "cuda")
    with pytest.raises(CandidateError, match="declared a CUDA candidate but has no .cu/.cpp sources"):
        load_candidate(examples / "triton_swish" / "solution", language="cuda")


def test_neither_cuda_nor_triton_is_one_line_naming_both(tmp_path):
    (tmp_path / "model_new.py").write_text("import torch\nclass ModelNew(torch.nn.Module):\n    pass\n")
    with pytest.raises(CandidateError) as caught:
        load_candidate(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "neither a CUDA candidate" in message and "@triton.jit" in message


def test_declared_triton_without_a_kernel_says_so(tmp_path):
    with pytest.raises(CandidateError, match="defines no @triton.jit kernel"):
        triton_candidate("import torch\nclass ModelNew(torch.nn.Module):\n    pass\n", "reply")


def test_a_syntax_error_is_one_line_with_its_line(examples, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(examples / "triton_swish" / "solution", root)
    text = (root / "model_new.py").read_text().replace("mask = offsets < n", "mask = offsets <", 1)
    (root / "model_new.py").write_text(text)
    with pytest.raises(CandidateError) as caught:
        load_candidate(root, language="triton")
    assert "syntax error at line 10" in str(caught.value) and "\n" not in str(caught.value)


def test_kernels_are_found_through_aliases_and_autotune():
    source = ("import triton as tr\nfrom triton import jit\n"
              "@tr.autotune(configs=[], key=[])\n@tr.jit\ndef a(x):\n    pass\n"
              "@jit\ndef b(x):\n    pass\n"
              "def host(x):\n    pass\n")
    assert triton_kernels(source) == ["a", "b"]
    assert triton_kernels("def f(:\n") == []
