"""The static rules of Triton candidates (``guard.tritoncheck``) on the red team's files and small sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from cuda_agent.candidates import load_candidate
from cuda_agent.guard import check_candidate
from cuda_agent.guard.static import check_model_new

CASES = Path(__file__).resolve().parents[1] / "redteam" / "triton_cases"

HEAD = "import torch\nimport triton\nimport triton.language as tl\n"
MODEL = ("class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        y = torch.empty_like(x)\n"
         "        k[(1,)](x, y, x.numel(), BLOCK=16)\n        return y\n")


def rules(source: str) -> set[str]:
    return {v.rule for v in check_model_new(source, triton=True)}


def test_the_example_passes(examples):
    assert check_candidate(load_candidate(examples / "triton_swish" / "solution")) == []


def test_triton_is_a_forbidden_import_for_a_cuda_candidate(examples):
    source = (examples / "triton_swish" / "solution" / "model_new.py").read_text()
    assert "forbidden-import" in {v.rule for v in check_model_new(source)}


@pytest.mark.parametrize("name, rule", [
    ("torch_in_forward.py", "torch-compute"),
    ("torch_in_kernel.py", "triton-kernel"),
    ("triton_internals.py", "triton-api"),
    ("side_stream.py", "stream"),
])
def test_red_team_files_break_their_static_rule(name, rule):
    found = {v.rule for v in check_candidate(load_candidate(CASES / name))}
    assert rule in found, found


@pytest.mark.parametrize("name", ["new_specialisation_when_timed.py", "autotune_when_timed.py",
                                  "work_left_queued.py"])
def test_cases_left_to_the_runtime_pass_the_static_check(name):
    """Nothing in their source says what they do: the build stage and the evaluated process's rules must."""
    assert check_candidate(load_candidate(CASES / name)) == []


def test_kernel_bodies_read_only_triton_arguments_constants_and_kernels():
    ok = HEAD + ("WIDTH = 4 * 4\nLIMIT = tl.constexpr(WIDTH)\n@triton.jit\ndef helper(v):\n    return v * 2\n"
                 "@triton.jit\ndef k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                 "    offs = tl.arange(0, BLOCK)\n    acc = tl.load(x_ptr + offs, mask=offs < min(n, LIMIT))\n"
                 "    for i in range(2):\n        acc = helper(acc) + WIDTH\n"
                 "    tl.store(y_ptr + offs, acc, mask=offs < n)\n") + MODEL
    assert rules(ok) == set()
    bad_names = HEAD + ("import math\nTABLE = [1, 2]\n@triton.jit\ndef k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                        "    v = math.pi + TABLE[0]\n    tl.store(y_ptr, v)\n") + MODEL
    found = [v.message for v in check_model_new(bad_names, triton=True) if v.rule == "triton-kernel"]
    assert any("`math`" in m for m in found) and any("`TABLE`" in m for m in found), found
    nested = HEAD + ("@triton.jit\ndef k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                     "    import os\n    f = lambda v: v\n    tl.store(y_ptr, f(1))\n") + MODEL
    assert "triton-kernel" in rules(nested)
    host = HEAD + ("@triton.jit\ndef k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):\n"
                   "    x = tl.load(x_ptr + tl.arange(0, BLOCK))\n    x.handle.data.sort()\n    tl.store(y_ptr, x)\n") + MODEL
    assert "triton-kernel" in rules(host)


def test_only_the_kernel_writing_api_of_triton():
    for path in ("triton.compiler.compile", "triton.testing.do_bench", "triton.runtime.driver", "triton.knobs"):
        module, _, name = path.rpartition(".")
        source = HEAD + f"from {module} import {name}\n" + MODEL
        assert "triton-api" in rules(source), path
    allowed = HEAD + "from triton import Config, cdiv, next_power_of_2, heuristics, autotune\n" + MODEL
    assert "triton-api" not in rules(allowed)
