"""Static checks: every rule fires on a violating snippet (bypasses included) and
no legitimate candidate of the project gets a single violation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from samples import INLINE_ADD_ONE, INLINE_SWISH

from cuda_agent.candidates import fixed_file, load_candidate
from cuda_agent.candidates.candidate import Candidate, Extension
from cuda_agent.candidates.inline import candidate_from_inline_source
from cuda_agent.guard import RULES, STATIC_RULES, CodePolicy, Violation, check_candidate, check_model_new, check_native_source
from cuda_agent.guard.static import check_flags

ROOT = Path(__file__).resolve().parents[2]
LEGIT_WORKSPACES = sorted((ROOT / "examples").glob("*/solution")) + sorted(
    (ROOT / "tests" / "gpu" / "kernelbench_solutions").glob("*")
) + sorted((ROOT / "tests" / "gpu" / "triton_solutions").glob("*"))


def rules(violations: list[Violation]) -> set[str]:
    assert all(v.rule in RULES for v in violations)
    return {v.rule for v in violations}


def model(forward: str, *, header: str = "", init: str = "pass", prelude: str = "") -> str:
    """A model_new.py whose forward body is ``forward`` (one statement per line)."""
    body = "\n".join("        " + line for line in forward.splitlines())
    init_body = "\n".join("        " + line for line in init.splitlines())
    return (
        f"import torch\nimport torch.nn as nn\nimport cuda_extension\n{header}\n{prelude}\n"
        f"class ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n{init_body}\n\n"
        f"    def forward(self, x):\n{body}\n"
    )


# -- no false positives ---------------------------------------------------------------


@pytest.mark.parametrize("root", LEGIT_WORKSPACES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_project_candidates_have_no_violations(root):
    candidate = load_candidate(root)
    assert candidate.language == "triton" or (candidate.extensions and any(e.sources for e in candidate.extensions))
    assert check_candidate(candidate) == []


def test_there_are_legit_candidates_to_check():
    names = {p.parent.name if p.name == "solution" else p.name for p in LEGIT_WORKSPACES}
    assert {"cpu_swish", "cuda_gelu", "level1_19", "level2_76"} <= names


# A KernelBench-style generation with the idioms such files use: CHECK macros,
# AT_DISPATCH, device helpers named like ATen ops, local blocks in a ModuleList,
# parameters held in nn layers that forward never calls.
INLINE_KERNELBENCH = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

cuda_src = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <ATen/cuda/CUDAContext.h>

#define CHECK_CUDA(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK(x.is_contiguous(), #x " must be contiguous")
#define CHECK_INPUT(x) CHECK_CUDA(x); CHECK_CONTIGUOUS(x)

__device__ __forceinline__ float gelu(float v) { return 0.5f * v * (1.f + erff(v * 0.7071f)); }

template <typename scalar_t>
__global__ void fused_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                             scalar_t* __restrict__ out, int64_t size) {
    int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx < size) {
        float v = gelu(a[idx] + b[idx]);
        v = max(v, 0.f) + min(v, 6.f) * exp(0.f) + tanh(0.f) + sqrt(1.f) - abs(-0.f);
        out[idx] = static_cast<scalar_t>(v);
    }
}

torch::Tensor fused_cuda(torch::Tensor a, torch::Tensor b) {
    CHECK_INPUT(a); CHECK_INPUT(b);
    auto size = a.numel();
    auto out = torch::zeros_like(a);
    auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(a.device());
    auto scratch = torch::empty({a.size(0), a.size(1)}, opts);
    std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
    shape.resize(2);
    const int threads = 256;
    const int blocks = (size + threads - 1) / threads;
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "fused_cuda", ([&] {
        fused_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
            a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), size);
    }));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out.view({-1}).reshape(a.sizes());
}
"""

cpp_src = "torch::Tensor fused_cuda(torch::Tensor a, torch::Tensor b);"

fused = load_inline(
    name="fused",
    cpp_sources=cpp_src,
    cuda_sources=cuda_src,
    functions=["fused_cuda"],
    verbose=True,
    extra_cflags=["-O3"],
    extra_cuda_cflags=["-O3", "--use_fast_math", "-Xptxas", "-v"],
    extra_ldflags=[""],
)


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))

    def forward(self, x):
        return fused.fused_cuda(x, self.weight)


class ModelNew(nn.Module):
    def __init__(self, n) -> None:
        super().__init__()
        self.fused = fused
        self.blocks = nn.ModuleList()
        for _ in range(3):
            self.blocks.append(Block(n))
        self.conv = nn.Conv2d(3, 3, 3)
        self.register_buffer("buf", torch.zeros(n))

    def _run(self, x):
        for i, blk in enumerate(self.blocks):
            x = blk(x)
        return x

    def forward(self, a, b):
        batch = a.shape[0]
        assert a.dim() == 2 and a.is_contiguous()
        if not a.is_cuda:
            raise RuntimeError("cuda only")
        out = self.fused.fused_cuda(a.contiguous(), b)
        out = self._run(out.view(batch, -1))
        with torch.no_grad():
            tmp = torch.empty_like(out)
        return out.reshape(batch, -1), self.conv.weight.size(0), self.buf.numel(), tmp.new_empty(3)


def get_inputs():
    return [torch.randn(4, 4).cuda(), torch.relu(torch.randn(4, 4)).cuda()]
'''


@pytest.mark.parametrize("source", [INLINE_ADD_ONE, INLINE_SWISH, INLINE_KERNELBENCH], ids=["simple", "cpu", "kernelbench"])
def test_inline_candidates_have_no_violations(source):
    candidate = candidate_from_inline_source(source, "gen.py")
    assert candidate.kind == "inline"
    assert [v.describe() for v in check_candidate(candidate)] == []


def test_fixed_files_are_exempt_but_a_copy_of_their_tricks_is_not():
    # binding_registry.h pastes tokens (##); it is ours, so candidates are not blamed for it.
    assert "##" in fixed_file("binding_registry.h")
    registry = fixed_file("binding_registry.h")
    ext = Extension("cuda_extension", {"binding.cpp": fixed_file("binding.cpp"), "binding_registry.h": registry,
                                       "kernels/mine.h": registry})
    candidate = Candidate(model_new=model("return cuda_extension.op(x)"), extensions=(ext,), kind="workspace", origin="t")
    found = check_candidate(candidate)
    assert {(v.file, v.rule) for v in found} == {("kernels/mine.h", "token-paste")}


# -- Python: each rule and its bypasses ------------------------------------------------------

PY_CASES = {
    # torch compute, however it is spelled
    "torch-call": (model("return torch.relu(x)"), "torch-compute"),
    "import-alias": (model("return t.relu(x)", header="import torch as t"), "torch-compute"),
    "from-import-alias": (model("return mm(x, x)", header="from torch import matmul as mm"), "torch-compute"),
    "functional": (model("return F.gelu(x)", header="import torch.nn.functional as F"), "torch-compute"),
    "functional-alias": (model("return F2.gelu(x)", header="from torch.nn import functional as F2"), "torch-compute"),
    "dotted-import": (model("return torch.nn.functional.gelu(x)", header="import torch.nn.functional"), "torch-compute"),
    "nn-alias": (model("return N.functional.relu(x)", header="from torch import nn as N"), "torch-compute"),
    "assigned-alias": (model("f = torch.nn.functional.gelu\nreturn f(x)"), "torch-compute"),
    "module-level-alias": (model("return act(x)", prelude="act = torch.sigmoid"), "torch-compute"),
    "literal-getattr": (model('return getattr(torch, "relu")(x)'), "torch-compute"),
    "tensor-method": (model("return x.relu()"), "torch-compute"),
    "tensor-matmul": (model("return x.matmul(x)"), "torch-compute"),
    "method-on-extension-result": (model("return cuda_extension.op(x).sigmoid()"), "torch-compute"),
    "cast": (model("return cuda_extension.op(x.half())"), "torch-compute"),
    "nn-module-call": (model("return self.fc(x)", init="self.fc = nn.Linear(4, 4)"), "torch-compute"),
    "nn-module-forward": (model("return self.fc.forward(x)", init="self.fc = nn.Linear(4, 4)"), "torch-compute"),
    "sequential": (model("return self.seq(x)", init="self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())"), "torch-compute"),
    "module-list-index": (model("return self.layers[0](x)", init="self.layers = nn.ModuleList([nn.Linear(4, 4)])"), "torch-compute"),
    "helper-function": (model("return helper(x)", prelude="def helper(y):\n    return torch.sigmoid(y)\n"), "torch-compute"),
    "compiled": (model("return self.f(x)", init="self.f = torch.compile(lambda y: y * 2)"), "torch-compute"),
    "partial": (model("return self.f(x)", init="self.f = functools.partial(torch.relu)", header="import functools"), "torch-compute"),
    "lambda-attr": (model("return self.act(x)", init="self.act = lambda v: v.sigmoid()"), "torch-compute"),
    "ops-namespace": (model("return torch.ops.aten.relu.default(x)"), "torch-compute"),
    "passed-as-value": (model("return list(map(torch.relu, [x]))[0]"), "torch-compute"),
    "try-fallback": (model("try:\n    return cuda_extension.op(x)\nexcept Exception:\n    return torch.tanh(x)"), "torch-compute"),
    "local-block": (model("return self.block(x)", init="self.block = Block()",
                          prelude="class Block(nn.Module):\n    def forward(self, y):\n        return y.exp()\n"), "torch-compute"),
    "module-list-of-blocks": (model("for b in self.blocks:\n    x = b(x)\nreturn x", init="self.blocks = nn.ModuleList([Block() for _ in range(2)])",
                                    prelude="class Block(nn.Module):\n    def forward(self, y):\n        return torch.tanh(y)\n"), "torch-compute"),
    "super-forward": (
        "import torch\nimport torch.nn as nn\nclass Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
        "class ModelNew(Model):\n    def forward(self, x):\n        return super().forward(x)\n",
        "torch-compute",
    ),
    "forward-as-attribute": ("import torch\nimport torch.nn as nn\nclass ModelNew(nn.Module):\n    forward = staticmethod(torch.relu)\n", "torch-compute"),
    "forward-bound-in-init": (model("return x", init="self.forward = torch.relu").replace("    def forward(self, x):\n        return x\n", ""), "torch-compute"),
    "forward-patched-on-class": (model("return x", prelude="") + "ModelNew.forward = lambda self, x: x.relu()\n", "torch-compute"),
    "forward-hook": (model("return cuda_extension.op(x)", init="self.register_forward_hook(lambda m, i, o: torch.relu(o))"), "torch-compute"),
    "returned-by-helper": (model("return self.f(x)", init="self.f = make()", prelude="def make():\n    return torch.relu\n"), "torch-compute"),
    "default-argument": (model("return x").replace("def forward(self, x):", "def forward(self, x, f=torch.relu):"), "torch-compute"),
    "autograd-function": (model("return Fn.apply(x)", prelude="class Fn(torch.autograd.Function):\n    @staticmethod\n    def forward(ctx, y):\n        return y.relu()\n"), "torch-compute"),
    # imports
    "numpy": (model("return x", header="import numpy as np"), "forbidden-import"),
    "time": (model("return x", header="import time"), "forbidden-import"),
    "harness": (model("return x", header="import cuda_agent.evaluate.protocol.timing"), "forbidden-import"),
    "os-other": (model("os.remove('f')\nreturn x", header="import os"), "forbidden-import"),
    "relative": (model("return x", header="from . import helper"), "forbidden-import"),
    "threading": (model("return x", header="import threading"), "thread"),
    "concurrent": (model("return x", header="from concurrent.futures import ThreadPoolExecutor"), "thread"),
    "torch-multiprocessing": (model("return x", header="import torch.multiprocessing as mp"), "thread"),
    "jit-fork": (model("fut = torch.jit.fork(cuda_extension.op, x)\nreturn torch.jit.wait(fut)"), "thread"),
    "subprocess": (model("return x", header="import subprocess"), "subprocess"),
    "os-system": (model("os.system('nvidia-smi')\nreturn x", header="import os"), "subprocess"),
    "from-os-system": (model("return x", header="from os import system"), "subprocess"),
    "ctypes": (model("return x", header="import ctypes"), "ctypes"),
    "cffi": (model("return x", header="from cffi import FFI"), "ctypes"),
    # dynamic access
    "importlib": (model('return importlib.import_module("torch").relu(x)', header="import importlib"), "dynamic-access"),
    "dunder-import": (model('return __import__("torch").relu(x)'), "dynamic-access"),
    "computed-getattr": (model('return getattr(torch, "re" + "lu")(x)'), "dynamic-access"),
    "getattr-as-value": (model('g = getattr\nreturn g(torch, "relu")(x)'), "dynamic-access"),
    "eval": (model("return eval('torch.relu')(x)"), "dynamic-access"),
    "exec": (model("exec('y = 1')\nreturn x"), "dynamic-access"),
    "globals": (model("return globals()['torch'].relu(x)"), "dynamic-access"),
    "dunder-dict": (model("return torch.__dict__['relu'](x)"), "dynamic-access"),
    "dunder-class": (model("return x.__class__.__mro__"), "dynamic-access"),
    "builtins": (model("return x", header="import builtins"), "dynamic-access"),
    "star-import": (model("return relu(x)", header="from torch import *"), "dynamic-access"),
    "private-torch": (model("return torch._C._nn.gelu(x)"), "dynamic-access"),
    "type-lookup": (model("return type(self.fc).forward(self.fc, x)", init="self.fc = nn.Linear(4, 4)"), "dynamic-access"),
    "operator-module": (model('return operator.attrgetter("relu")(torch)(x)', header="import operator"), "dynamic-access"),
    # frames
    "sys": (model("return x", header="import sys"), "frame-access"),
    "gc": (model("return x", header="import gc"), "frame-access"),
    "inspect": (model("return inspect.currentframe().f_back.f_locals['expected']", header="import inspect"), "frame-access"),
    "f-back": (model("try:\n    raise ValueError\nexcept ValueError as e:\n    return e.__traceback__.tb_frame.f_back.f_locals['out']"), "frame-access"),
    # monkeypatching
    "patch-event": (model("return x", prelude="torch.cuda.Event.elapsed_time = lambda a, b: 0.001"), "monkeypatch"),
    "patch-synchronize": (model("return x", prelude="torch.cuda.synchronize = lambda *a: None"), "monkeypatch"),
    "patch-time": (model("return x", header="import time", prelude="time.perf_counter = lambda: 0.0"), "monkeypatch"),
    "patch-alias": (model("return x", header="import torch.cuda as tc", prelude="tc.Event = object"), "monkeypatch"),
    "patch-setattr": (model("return x", prelude='setattr(torch.cuda, "synchronize", lambda: None)'), "monkeypatch"),
    "patch-delete": (model("return x", prelude="del torch.testing"), "monkeypatch"),
    "patch-extension": (model("return cuda_extension.op(x)", prelude="cuda_extension.op = torch.relu"), "monkeypatch"),
    "patch-module-call": (model("return x", prelude="nn.Module.__call__ = lambda self, *a: a[0]"), "monkeypatch"),
    "patch-environ": (model("return x", header="import os", prelude='os.environ["CUDA_LAUNCH_BLOCKING"] = "1"'), "monkeypatch"),
    "flip-backend-flag": (model("return x", prelude="torch.backends.cuda.matmul.allow_tf32 = False"), "monkeypatch"),
    "set-global-state": (model("return x", prelude='torch.set_float32_matmul_precision("highest")'), "monkeypatch"),
    "torch-library": (model("return x", prelude='lib = torch.library.Library("aten", "IMPL")'), "monkeypatch"),
    # tensor subclasses and hooks
    "tensor-subclass": (model("return x", prelude="class Lazy(torch.Tensor):\n    pass\n"), "tensor-subclass"),
    "torch-function": (model("return x", prelude="class Hook:\n    @classmethod\n    def __torch_function__(cls, f, t, a=(), k=None):\n        return 0\n"), "tensor-subclass"),
    # streams
    "stream-object": (model("s = torch.cuda.Stream()\nreturn x"), "stream"),
    "stream-context": (model("with torch.cuda.stream(self.s):\n    return cuda_extension.op(x)", init="self.s = torch.cuda.Stream()"), "stream"),
    "set-stream": (model("torch.cuda.set_stream(self.s)\nreturn x"), "stream"),
    "external-stream": (model("return x", header="from torch.cuda import ExternalStream"), "stream"),
    "cuda-graph": (model("g = torch.cuda.CUDAGraph()\nreturn x"), "stream"),
    # native code and files
    "load-library": (model("return x", prelude='torch.ops.load_library("/tmp/evil.so")'), "native-load"),
    "cpp-extension-load": (model("return x", header="from torch.utils.cpp_extension import load"), "native-load"),
    "torch-load": (model("return torch.load('/tmp/expected.pt')"), "syscall"),
    "manual-seed": (model("return x", prelude="torch.manual_seed(0)"), "monkeypatch"),
    "open": (model("open('/tmp/result.json', 'w').write('{}')\nreturn x"), "syscall"),
    # syntax
    "syntax": ("class ModelNew(:\n    pass\n", "syntax"),
}


@pytest.mark.parametrize("name", sorted(PY_CASES))
def test_python_rule_fires(name):
    source, rule = PY_CASES[name]
    found = check_model_new(source)
    assert rule in rules(found), f"{name}: expected [{rule}], got {[v.describe() for v in found]}"


def test_python_cases_cover_every_python_rule():
    # The Triton rules have their cases in test_tritoncheck.py.
    python_rules = set(STATIC_RULES) - {"aten-compute", "library", "token-paste", "build-flag", "cache-control",
                                        "triton-api", "triton-kernel"}
    assert python_rules <= {rule for _, rule in PY_CASES.values()}


PY_CLEAN = {
    "allocation-and-metadata": model(
        "y = torch.empty_like(x)\nz = x.new_empty(x.shape).view(-1)\nn = x.size(0) * x.numel() * x.dim()\n"
        "w = torch.zeros(x.shape[0], device=x.device, dtype=x.dtype)\n"
        "with torch.no_grad():\n    cuda_extension.op(x.contiguous(), y, x.stride(0), x.is_contiguous())\n"
        "return y.view(x.shape).permute(1, 0).transpose(0, 1).unsqueeze(0).squeeze(0).flatten()"
    ),
    "parameters-passed-not-called": model(
        "return cuda_extension.linear(x, self.fc.weight, self.fc.bias, self.bias.size(0))",
        init="self.fc = nn.Linear(4, 4)\nself.bias = nn.Parameter(torch.randn(4))",
    ),
    "init-may-use-torch": model("return cuda_extension.op(x, self.w)", init="self.w = nn.Parameter(torch.relu(torch.randn(4)) @ torch.eye(4))"),
    "reference-model-in-file": "import torch\nimport torch.nn as nn\nimport cuda_extension\n"
    "class Model(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
    "class ModelNew(nn.Module):\n    def forward(self, x):\n        return cuda_extension.relu(x)\n",
    "extension-names": model("return relu(x) + op2(x)", header="from cuda_extension import relu, op2"),
    "os-environ-read": model("return x", header="import os", prelude='ARCH = os.environ.get("TORCH_CUDA_ARCH_LIST", os.getenv("X"))\nP = os.path.join("a", "b")'),
    "math": model("return cuda_extension.op(x, math.sqrt(x.size(-1)))", header="import math"),
    "operators-are-left-to-the-runtime-guard": model("return cuda_extension.op(x) * 2 + 1"),
    "tensor-subclass-check": model("assert isinstance(x, torch.Tensor) and x.dtype == torch.float32\nreturn cuda_extension.op(x)"),
    "current-stream-query": model("return cuda_extension.op(x, torch.cuda.current_stream().cuda_stream)"),
    "getattr-literal-on-self": model('return cuda_extension.op(getattr(self, "scale", 1.0) * 1.0, x)'),
    "main-guard": model("return cuda_extension.op(x)", prelude='if __name__ == "__main__":\n    print(ModelNew)'),
}


@pytest.mark.parametrize("name", sorted(PY_CLEAN))
def test_python_clean_code_passes(name):
    assert [v.describe() for v in check_model_new(PY_CLEAN[name])] == []


def test_streams_allowed_by_policy():
    source = model("s = torch.cuda.Stream()\nwith torch.cuda.stream(s):\n    return cuda_extension.op(x)")
    assert "stream" in rules(check_model_new(source))
    assert check_model_new(source, policy=CodePolicy(allow_streams=True)) == []


def test_allowed_aten_extends_the_allowlist():
    source = model("return cuda_extension.op(x).clone()")
    assert "torch-compute" in rules(check_model_new(source))
    assert check_model_new(source, policy=CodePolicy(allowed_aten=("clone",))) == []


def test_violation_describe_and_line():
    source = model("return torch.relu(x)")
    (violation,) = check_model_new(source, "gen.py")
    line = source.splitlines().index("        return torch.relu(x)") + 1
    assert violation == Violation("torch-compute", "gen.py", line, violation.message)
    assert violation.describe() == f"gen.py:{line}: [torch-compute] {violation.message}"
    assert "torch.relu" in violation.message


def test_syntax_error_is_one_violation():
    found = check_model_new("x = (\n")
    assert len(found) == 1 and found[0].rule == "syntax" and found[0].line is not None


def test_policy_to_dict():
    assert CodePolicy().to_dict() == {"libraries": ["cublas", "cudnn"], "allow_streams": False, "allowed_aten": []}


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown rule"):
        Violation("no-such-rule", "f", 1, "m")


# -- C++/CUDA ----------------------------------------------------------------------------

CXX_CASES = {
    "at-matmul": ("torch::Tensor f(torch::Tensor a, torch::Tensor b) { return at::matmul(a, b); }", "aten-compute"),
    "tensor-method": ("torch::Tensor f(torch::Tensor a, torch::Tensor b) { return a.matmul(b); }", "aten-compute"),
    "arrow-method": ("torch::Tensor f(torch::Tensor* a) { return a->relu(); }", "aten-compute"),
    "torch-relu": ("torch::Tensor f(torch::Tensor x) { return torch::relu(x); }", "aten-compute"),
    "global-qualified": ("auto y = ::at::relu(x);", "aten-compute"),
    "functional": ("auto y = torch::nn::functional::gelu(x);", "aten-compute"),
    "ops-struct": ("auto y = at::_ops::relu::call(x);", "aten-compute"),
    "native": ("auto y = at::native::relu(x);", "aten-compute"),
    "backend-namespace": ("auto y = at::cuda::relu(x);", "aten-compute"),
    "out-variant": ("at::matmul_out(out, a, b);", "aten-compute"),
    "item": ("float v = x.item<float>();", "aten-compute"),
    "to": ("auto y = x.to(torch::kHalf);", "aten-compute"),
    "aten-blas": ("at::cuda::blas::gemm<float>('n', 'n', 1, 1, 1, 1.f, a, 1, b, 1, 0.f, c, 1);", "aten-compute"),
    "dispatcher": ('auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::relu", "");', "aten-compute"),
    "adl": ("torch::Tensor f(torch::Tensor x) { return sigmoid(x); }", "aten-compute"),
    "line-splice": ("auto y = at::mat\\\nmul(a, b);", "aten-compute"),
    "namespace-alias": ("namespace A = at;\nauto y = A::relu(x);", "aten-compute"),
    "cublas": ("void f(cublasHandle_t h) { cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1); }", "library"),
    "cufft": ("cufftHandle plan; cufftPlan1d(&plan, 8, CUFFT_C2C, 1);", "library"),
    "blas-handle": ("auto h = at::cuda::getCurrentCUDABlasHandle();", "library"),
    "std-thread": ("#include <thread>\nvoid f() { std::thread t([] {}); t.join(); }", "thread"),
    "std-async": ("auto fut = std::async(std::launch::async, [] { return 1; });", "thread"),
    "pthread": ("pthread_t t; pthread_create(&t, nullptr, work, nullptr);", "thread"),
    "openmp": ("#pragma omp parallel for\nfor (int i = 0; i < n; ++i) y[i] = x[i];", "thread"),
    "parallel-for": ("at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {});", "thread"),
    "system": ('int f() { return system("ls"); }', "subprocess"),
    "global-system": ('int f() { return ::system("ls"); }', "subprocess"),
    "popen": ('FILE* p = popen("nvidia-smi", "r");', "subprocess"),
    "fork": ("pid_t p = fork();", "subprocess"),
    "execve": ("execve(path, argv, envp);", "subprocess"),
    "persisting-l2-limit": ("cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 1 << 20);", "cache-control"),
    "access-policy-window": ("attr.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;", "cache-control"),
    "driver-l2-limit": ("cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 1 << 20);", "cache-control"),
    "dlopen": ('void* h = dlopen("libcublas.so", RTLD_NOW);', "native-load"),
    "dlsym": ('auto f = dlsym(RTLD_DEFAULT, "cudaEventElapsedTime");', "native-load"),
    "syscall": ("long r = syscall(39);", "syscall"),
    "ptrace": ("ptrace(PTRACE_ATTACH, pid, 0, 0);", "syscall"),
    "socket": ("int s = socket(AF_INET, SOCK_STREAM, 0);", "syscall"),
    "fopen": ('FILE* f = fopen("/tmp/out", "w");', "syscall"),
    "ofstream": ('std::ofstream out("/tmp/result.json");', "syscall"),
    "mprotect": ("mprotect(page, 4096, PROT_READ | PROT_WRITE | PROT_EXEC);", "syscall"),
    "host-asm": ('void f() { asm volatile("nop"); }', "syscall"),
    "stream-create": ("cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);", "stream"),
    "stream-pool": ("auto s = at::cuda::getStreamFromPool();", "stream"),
    "per-thread-stream": ("k<<<1, 32, 0, cudaStreamPerThread>>>(x);", "stream"),
    "host-func": ("cudaLaunchHostFunc(stream, cb, nullptr);", "stream"),
    "token-paste": ("#define CAT(a, b) a##b\nint CAT(x, y);", "token-paste"),
    "digraph-paste": ("#define CAT(a, b) a %:%: b\nint CAT(x, y);", "token-paste"),
    "define-alias": ("#define MM at::matmul\ntorch::Tensor f(torch::Tensor a) { return MM(a, a); }", "token-paste"),
    "macro-builds-name": ("#define CALL(ns, f) ns::f\nauto y = CALL(at, relu)(x);", "token-paste"),
    "macro-builds-method": ("#define INVOKE(t, m) t.m()\nauto y = INVOKE(x, relu);", "token-paste"),
    "using-namespace": ("using namespace at;\nauto y = matmul(a, b);", "token-paste"),
    "reopen-namespace": ("namespace at { Tensor g(const Tensor& x) { return relu(x); } }", "token-paste"),
    "pybind-import": ('auto m = pybind11::module_::import("torch");', "dynamic-access"),
    "python-attr": ('auto r = obj.attr("relu")(x);', "dynamic-access"),
    "pyrun": ('PyRun_SimpleString("import torch");', "dynamic-access"),
    "torch-library": ("TORCH_LIBRARY_IMPL(aten, CUDA, m) { m.impl(\"relu\", &mine); }", "monkeypatch"),
}


@pytest.mark.parametrize("name", sorted(CXX_CASES))
def test_native_rule_fires(name):
    source, rule = CXX_CASES[name]
    found = check_native_source(source, "kernels/x_binding.cpp", CodePolicy(libraries=()) if rule == "library" else CodePolicy())
    assert rule in rules(found), f"{name}: expected [{rule}], got {[v.describe() for v in found]}"


def test_define_alias_also_reports_the_op_where_used():
    found = check_native_source("#define MM at::matmul\n\nauto y = MM(a, b);\n", "k.cpp")
    assert ("aten-compute", 3) in {(v.rule, v.line) for v in found}
    assert ("token-paste", 1) in {(v.rule, v.line) for v in found}


CXX_CLEAN = {
    "raw-string": 'const char* doc = R"doc(at::matmul(a, b); x.relu(); system("ls"); )" )doc";\nint y = 0;',
    "raw-string-prefixed": 'auto s = u8R"(torch::relu(x))";',
    "string": 'const char* s = "at::matmul(a, b) \\" torch::relu(x)";',
    "char-literal": "char q = '\"'; auto y = at::empty_like(x);",
    "line-comment": "// at::matmul(a, b)\nint y;",
    "block-comment": "/* torch::relu(x);\n   std::thread t; */ int y;",
    "comment-splice-is-comment": "// a comment \\\n at::matmul(a, b);\nint y;",
    "error-directive": "#error at::matmul is not allowed\n",
    "allocation-and-metadata": (
        "auto y = torch::empty_like(x); auto z = at::zeros({x.size(0), x.size(1)}, x.options());\n"
        "auto w = torch::empty_strided(x.sizes(), x.strides(), x.options().dtype(torch::kFloat32));\n"
        "float* p = x.data_ptr<float>(); int64_t n = x.numel() * x.dim() * x.stride(0);\n"
        "auto v = x.contiguous().view({-1}).reshape({n}); TORCH_CHECK(x.is_cuda() && x.is_contiguous());\n"
        "auto s = at::cuda::getCurrentCUDAStream(); const at::cuda::OptionalCUDAGuard guard(x.device());"
    ),
    "device-math-and-std": (
        "__device__ float act(float v) { return max(0.f, min(v, 6.f)) + exp(v) + tanh(v) + sqrt(v) + abs(v); }\n"
        "int m = std::numeric_limits<int>::max(); std::vector<int64_t> s(4); s.resize(2); std::sort(s.begin(), s.end());"
    ),
    "local-function-named-like-op": "torch::Tensor relu(torch::Tensor x);\nauto y = relu(x);",
    "device-function-named-like-op": "__device__ float sigmoid(float v) { return 1.f / (1.f + __expf(-v)); }\n__global__ void k(float* y) { y[0] = sigmoid(y[0]); }",
    "check-macros": '#define CHECK_CUDA(x) TORCH_CHECK(x.is_cuda(), #x " must be a CUDA tensor")\nCHECK_CUDA(a);',
    "cooperative-groups": "namespace cg = cooperative_groups;\nauto t = cg::tiled_partition<32>(cg::this_thread_block());\nbool b = t.any(v > 0) && t.all(v < 1);",
    "digit-separators": "int n = 1'000'000; char c = 'a'; auto y = torch::empty({n}, x.options());",
    "cub": "typedef cub::BlockReduce<float, 256> BR; __shared__ typename BR::TempStorage tmp; float s = BR(tmp).Sum(v);",
}


@pytest.mark.parametrize("name", sorted(CXX_CLEAN))
def test_native_clean_code_passes(name):
    assert [v.describe() for v in check_native_source(CXX_CLEAN[name], "kernels/k.cpp")] == []


def test_inline_ptx_is_allowed_outside_host_only_files():
    ptx = '__device__ float f(float v) { float r; asm volatile("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v)); return r; }'
    for name in ("kernels/k.cu", "kernels/k.cuh", "kernels/ptx.h"):
        assert check_native_source(ptx, name) == []
    assert "syscall" in rules(check_native_source(ptx, "kernels/k.cpp"))
    assert "syscall" in rules(check_native_source('void f() { asm volatile("syscall"); }', "kernels/k.cu"))


def test_library_policy():
    source = "cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &a, A, m, B, k, &b, C, m);"
    assert check_native_source(source, "k.cpp") == []  # cuBLAS is allowed by default (the paper's rule)
    assert "library" in rules(check_native_source(source, "k.cpp", CodePolicy(libraries=("cudnn",))))
    assert "library" in rules(check_native_source("cudnnConvolutionForward(h);", "k.cpp", CodePolicy(libraries=())))


def test_line_numbers_survive_splices_and_comments():
    source = "/* one\n two */\n#define A \\\n  1\nint x; // three\nauto y = at::relu(x);\n"
    (violation,) = check_native_source(source, "k.cpp")
    assert violation.line == 6


def test_candidate_kernel_files_are_scanned(tmp_path):
    root = tmp_path / "ws"
    shutil.copytree(ROOT / "examples" / "cpu_swish" / "solution", root)
    binding = root / "kernels" / "scaled_swish_binding.cpp"
    binding.write_text(binding.read_text().replace("auto y = torch::empty_like(xc);", "auto y = at::sigmoid(xc);"))
    found = check_candidate(load_candidate(root))
    assert [(v.rule, v.file) for v in found] == [("aten-compute", "kernels/scaled_swish_binding.cpp")]


def test_inline_candidate_sources_are_scanned():
    source = INLINE_SWISH.replace("auto y = torch::empty_like(x);", "auto y = torch::sigmoid(x);")
    found = check_candidate(candidate_from_inline_source(source, "gen.py"))
    assert [(v.rule, v.file) for v in found] == [("aten-compute", "swish_inline/main.cpp")]


@pytest.mark.parametrize(
    "flags, rule",
    [
        ({"cflags": ("-DMM=at::matmul",)}, "token-paste"),
        ({"cflags": ("-fopenmp",)}, "thread"),
        ({"cuda_cflags": ("-Xcompiler", "-fopenmp")}, "thread"),
        ({"cuda_cflags": ("--default-stream", "per-thread")}, "stream"),
        ({"ldflags": ("-lcufft",)}, "library"),
        ({"ldflags": ("-Wl,--wrap=cudaEventElapsedTime",)}, "build-flag"),
        ({"cflags": ("-include", "evil.h")}, "build-flag"),
    ],
)
def test_build_flags(flags, rule):
    ext = Extension("gen", {"gen/main.cpp": "int x;"}, **flags)
    assert rule in rules(check_flags(ext))


def test_ordinary_build_flags_pass():
    ext = Extension("gen", {"gen/main.cpp": "int x;"}, cflags=("-O3", "-std=c++17"),
                    cuda_cflags=("-O3", "--use_fast_math", "-Xptxas", "-v", "--expt-relaxed-constexpr", "-DBLOCK=256"),
                    ldflags=("", "-lcublas"))
    assert check_flags(ext) == []
