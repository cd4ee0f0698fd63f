"""Triton in the candidate's process on the CPU backend (``evaluate.worker.triton_runtime``), in a fresh interpreter each:
Triton reads TRITON_INTERPRET as it is imported."""

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

PROBE = r'''
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from cuda_agent.evaluate.worker.triton_runtime import prepare_triton
from cuda_agent.guard.runtime import RuleBroken

try:
    note = prepare_triton("cpu", None)
except RuleBroken as exc:
    print(json.dumps({"rule": exc.rule, "error": str(exc)}))
    sys.exit(0)
sys.path.insert(0, sys.argv[1])
import model_new
import triton
import triton.language as tl

seen = []
class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))

x = torch.randn(4, 5000)
model = model_new.ModelNew(1.5)
weight = torch.nn.Parameter(torch.randn(4, 5000), requires_grad=False)  # as a kernel reads a layer's weights
with Ops():
    y = model(x)
    w = model(weight)
expected = 1.5 * x * torch.sigmoid(x)

@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])
@triton.jit
def fill(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, BLOCK + 0.0 * offs, mask=offs < n)

z = torch.zeros(256)
fill[lambda meta: (triton.cdiv(256, meta["BLOCK"]),)](z, 256)
print(json.dumps({"note": note, "ops": seen, "error": float((y - expected).abs().max()), "block": float(z[0])}))
'''


def probe(env: dict[str, str]) -> dict:
    ran = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "examples" / "triton_swish" / "solution")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])


def test_the_interpreter_dispatches_no_torch_operator_of_its_own():
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "TRITON_INTERPRET": "1"}
    found = probe(env)
    # the candidate's own allocations, nothing else
    assert found["ops"] == ["aten.empty_like.default"] * 2, found
    assert found["error"] < 1e-5
    assert "interpreter" in found["note"]
    assert found["block"] == 64.0  # autotuned kernels run their first config


def test_triton_imported_before_the_interpreter_was_asked_for_is_a_harness_error():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT / "src")}
    ran = subprocess.run([sys.executable, "-c", "import triton.language\n" + PROBE, "."], env=env,
                         capture_output=True, text=True, timeout=120)
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    assert found["rule"] == "harness" and "TRITON_INTERPRET=1" in found["error"], found
