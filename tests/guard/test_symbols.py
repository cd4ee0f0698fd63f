"""Symbol audit: built objects are judged by what they import and define.

The clean cases are the project's own: the CPU example built by the project's
builder (pybind11 + the fixed binding.cpp + a binding using empty_like/data_ptr)
and every CUDA kernel of the examples and GPU test solutions compiled by nvcc.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuda_agent.build import build
from cuda_agent.build.toolchain import ToolchainError, detect_toolchain
from cuda_agent.candidates import load_candidate
from cuda_agent.guard import CodePolicy, SymbolAuditError, audit_symbols, check_candidate
from cuda_agent.guard.symbols import classify_definition, classify_import, qualified_segments

ROOT = Path(__file__).resolve().parents[2]
PROJECT_KERNELS = sorted((ROOT / "examples").glob("*/solution/kernels/*.cu")) + sorted(
    (ROOT / "tests" / "gpu" / "kernelbench_solutions").glob("*/kernels/*.cu")
)
NO_LIBRARIES = CodePolicy(libraries=())


def rules(violations) -> set[str]:
    return {v.rule for v in violations}


def cuda_toolchain():
    try:
        return detect_toolchain("cuda")
    except ToolchainError as exc:
        pytest.skip(f"no CUDA toolchain: {exc}")


def nvcc_object(tmp_path: Path, name: str, source: str, *extra: str) -> Path:
    toolchain = cuda_toolchain()
    src = tmp_path / f"{name}.cu"
    src.write_text(source)
    obj = tmp_path / f"{name}.o"
    subprocess.run(toolchain.nvcc_command(src, obj, "cuda_extension", tmp_path, tuple(extra)), check=True,
                   capture_output=True, timeout=300)
    return obj


def gxx_object(tmp_path: Path, name: str, source: str) -> Path:
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    obj = tmp_path / f"{name}.o"
    cxx = detect_toolchain("cpu").cxx
    subprocess.run([cxx, "-c", "-O1", "-std=c++17", "-fPIC", str(src), "-o", str(obj)], check=True,
                   capture_output=True, timeout=300)
    return obj


# -- classification of single symbols (no compiler needed) ---------------------------------

IMPORTS = [
    ("at::_ops::matmul::call(at::Tensor const&, at::Tensor const&)", CodePolicy(), "aten-compute"),
    ("at::_ops::add_Tensor::call(at::Tensor const&, at::Tensor const&, c10::Scalar const&)", CodePolicy(), "aten-compute"),
    ("at::_ops::relu_::call(at::Tensor&)", CodePolicy(), "aten-compute"),
    ("at::_ops::empty_like::call(at::Tensor const&, std::optional<c10::ScalarType>)", CodePolicy(), None),
    ("at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)", CodePolicy(), None),
    ("at::_ops::zeros_like::call(at::Tensor const&)", CodePolicy(), None),
    ("at::TensorBase::__dispatch_contiguous(c10::MemoryFormat) const", CodePolicy(), None),
    ("float* at::TensorBase::data_ptr<float>() const", CodePolicy(), None),
    ("at::native::relu(at::Tensor const&)", CodePolicy(), "aten-compute"),
    ("at::cpu::relu(at::Tensor const&)", CodePolicy(), "aten-compute"),
    ("at::cuda::blas::gemm<float>(char, char, long, long, long, float, float const*, long, float const*, long, float, float*, long)", CodePolicy(), "aten-compute"),
    ("at::TensorIteratorBase::build(at::TensorIteratorConfig&)", CodePolicy(), "aten-compute"),
    ("c10::Dispatcher::realSingleton()", CodePolicy(), "aten-compute"),
    ("torch::jit::load(std::string const&)", CodePolicy(), "aten-compute"),
    ("at::cuda::getCurrentCUDABlasHandle()", CodePolicy(), None),
    ("at::cuda::getCurrentCUDABlasHandle()", NO_LIBRARIES, "library"),
    ("cublasSgemm_v2", CodePolicy(), None),
    ("cublasSgemm_v2", NO_LIBRARIES, "library"),
    ("cublasLtMatmul", CodePolicy(libraries=("cudnn",)), "library"),
    ("cudnnConvolutionForward", CodePolicy(), None),
    ("cufftExecC2C", CodePolicy(), "library"),
    ("pthread_create@GLIBC_2.34", CodePolicy(), "thread"),
    ("std::thread::_M_start_thread(std::unique_ptr<std::thread::_State, std::default_delete<std::thread::_State> >, void (*)())@GLIBCXX_3.4.22", CodePolicy(), "thread"),
    ("GOMP_parallel", CodePolicy(), "thread"),
    ("at::internal::invoke_parallel(long, long, long, std::function<void (long, long)> const&)", CodePolicy(), "thread"),
    ("system@GLIBC_2.2.5", CodePolicy(), "subprocess"),
    ("popen@GLIBC_2.2.5", CodePolicy(), "subprocess"),
    ("execve", CodePolicy(), "subprocess"),
    ("dlopen@GLIBC_2.34", CodePolicy(), "native-load"),
    ("cuModuleLoadData", CodePolicy(), "native-load"),
    ("syscall@GLIBC_2.2.5", CodePolicy(), "syscall"),
    ("socket", CodePolicy(), "syscall"),
    ("fopen64", CodePolicy(), "syscall"),
    ("std::basic_ofstream<char, std::char_traits<char> >::basic_ofstream(char const*, std::_Ios_Openmode)", CodePolicy(), "syscall"),
    ("cudaStreamCreateWithFlags", CodePolicy(), "stream"),
    ("cudaStreamCreateWithFlags", CodePolicy(allow_streams=True), None),
    ("__cudaLaunchKernel_ptsz", CodePolicy(), "stream"),
    # c10's CUDAGuardImpl vtable, emitted wherever a CUDAGuard is used, references these
    # (seen with torch 2.11 headers): the source scan checks the candidate's own uses.
    ("c10::cuda::getStreamFromPool(bool, signed char)", CodePolicy(), None),
    ("c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream)", CodePolicy(), None),
    ("PyImport_ImportModule", CodePolicy(), "dynamic-access"),
    ("PyRun_SimpleString", CodePolicy(), "dynamic-access"),
    # what pybind11, c10 and the fixed binding import
    ("c10::detail::torchCheckFail(char const*, char const*, unsigned int, char const*)", CodePolicy(), None),
    ("pybind11::detail::type_caster<at::Tensor, void>::load(pybind11::handle, bool)", CodePolicy(), None),
    ("PyObject_GetAttrString", CodePolicy(), None),
    ("pthread_mutex_lock@GLIBC_2.2.5", CodePolicy(), None),
    ("c10::cuda::getCurrentCUDAStream(signed char)", CodePolicy(), None),
    ("vtable for torch::autograd::AutogradMeta", CodePolicy(), None),
    ("__cudaLaunchKernel", CodePolicy(), None),
]


@pytest.mark.parametrize("symbol, policy, rule", IMPORTS, ids=[s[:60] for s, _, _ in IMPORTS])
def test_classify_import(symbol, policy, rule):
    verdict = classify_import(symbol, policy)
    assert (verdict[0] if verdict else None) == rule, verdict


def test_allowed_aten_extends_the_symbol_allowlist():
    symbol = "at::_ops::relu::call(at::Tensor const&)"
    assert classify_import(symbol)[0] == "aten-compute"
    assert classify_import(symbol, CodePolicy(allowed_aten=("relu",))) is None


def test_classify_definition():
    assert classify_definition("T", "cudaEventElapsedTime")[0] == "monkeypatch"
    assert classify_definition("T", "clock_gettime")[0] == "monkeypatch"
    assert classify_definition("T", "at::_ops::relu::call(at::Tensor const&)")[0] == "monkeypatch"
    assert classify_definition("T", "cublasSgemm_v2", NO_LIBRARIES)[0] == "library"
    assert classify_definition("T", "PyInit_cuda_extension") is None
    assert classify_definition("T", "gelu_launch") is None
    assert classify_definition("W", "c10::SymNodeImpl::guard_bool(char const*, long)") is None  # inline instantiation


def test_qualified_segments():
    assert qualified_segments("float* at::TensorBase::data_ptr<float>() const") == ["at", "TensorBase", "data_ptr"]
    assert qualified_segments("at::_ops::relu::call(at::Tensor const&)") == ["at", "_ops", "relu", "call"]
    assert qualified_segments(
        "std::basic_ostream<char, std::char_traits<char> >& std::__ostream_insert<char, std::char_traits<char> >"
        "(std::basic_ostream<char, std::char_traits<char> >&, char const*, long)@GLIBCXX_3.4.9"
    ) == ["std", "__ostream_insert"]
    assert qualified_segments("vtable for torch::autograd::AutogradMeta") == ["torch", "autograd", "AutogradMeta"]
    assert qualified_segments("std::ostream::operator<<(int)") == ["std", "ostream", "operator"]
    assert qualified_segments("(anonymous namespace)::launch(float*)") == ["anonymous", "launch"]


def test_missing_nm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr("cuda_agent.guard.symbols.shutil.which", lambda name: None)
    with pytest.raises(SymbolAuditError, match="binutils"):
        audit_symbols([tmp_path / "x.so"])


def test_unreadable_file_is_an_error(tmp_path):
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF file")
    with pytest.raises(SymbolAuditError, match="junk.so"):
        audit_symbols([junk])


# -- real objects ----------------------------------------------------------------------------


HOST_TRICKS = r"""
#include <cstdlib>
#include <cstdio>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <thread>

static void* work(void*) { return nullptr; }

extern "C" void launch_everything() {
  pthread_t t;
  pthread_create(&t, nullptr, work, nullptr);
  std::thread other([] {});
  other.detach();
  std::system("true");
  FILE* p = popen("true", "r");
  pclose(p);
  void* h = dlopen("libm.so.6", RTLD_NOW);
  (void)dlsym(h, "cos");
  (void)socket(AF_INET, SOCK_STREAM, 0);
  (void)syscall(SYS_getpid);
}
"""

SHADOWING = r"""
#include <ctime>
extern "C" int cudaEventElapsedTime(float* ms, void*, void*) { *ms = 1e-3f; return 0; }
extern "C" int clock_gettime(clockid_t, struct timespec* ts) { ts->tv_sec = 0; ts->tv_nsec = 0; return 0; }
extern "C" void my_launch(float* x) { x[0] = 1.0f; }
"""


def test_host_object_threads_processes_loading(tmp_path):
    found = audit_symbols([gxx_object(tmp_path, "tricks", HOST_TRICKS)])
    assert {"thread", "subprocess", "native-load", "syscall"} <= rules(found)
    messages = " ".join(v.message for v in found)
    for name in ("pthread_create", "std::thread", "system", "popen", "dlopen", "dlsym", "socket", "syscall"):
        assert name in messages, name


def test_defining_runtime_entry_points_is_flagged(tmp_path):
    found = audit_symbols([gxx_object(tmp_path, "shadow", SHADOWING)])
    assert {v.rule for v in found} == {"monkeypatch"}
    assert {v.message.split("`")[1] for v in found} == {"cudaEventElapsedTime", "clock_gettime"}


CUDA_LIBRARY_AND_STREAM = r"""
#include <cuda_runtime.h>
// The toolkit here has no cuBLAS headers: declare the one entry point used.
extern "C" int cublasSgemm_v2(void* h, int ta, int tb, int m, int n, int k, const float* alpha, const float* a,
                              int lda, const float* b, int ldb, const float* beta, float* c, int ldc);
__global__ void scale(float* x) { x[threadIdx.x] *= 2.0f; }
extern "C" void run(void* handle, float* a, float* b, float* c, int n) {
  const float one = 1.0f, zero = 0.0f;
  cublasSgemm_v2(handle, 0, 0, n, n, n, &one, a, n, b, n, &zero, c, n);
  cudaStream_t side;
  cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
  scale<<<1, 32, 0, side>>>(c);
}
"""


def test_cuda_object_library_and_stream(tmp_path):
    obj = nvcc_object(tmp_path, "lib", CUDA_LIBRARY_AND_STREAM)
    assert rules(audit_symbols([obj])) == {"stream"}  # cuBLAS is allowed by default
    assert rules(audit_symbols([obj], NO_LIBRARIES)) == {"stream", "library"}
    assert audit_symbols([obj], CodePolicy(allow_streams=True)) == []


def test_per_thread_default_stream_flag_is_visible(tmp_path):
    source = "__global__ void k(float* x) { x[0] = 1.0f; }\nextern \"C\" void go(float* x) { k<<<1, 1>>>(x); }\n"
    assert audit_symbols([nvcc_object(tmp_path, "plain", source)]) == []
    ptsz = nvcc_object(tmp_path, "ptsz", source, "--default-stream", "per-thread")
    assert rules(audit_symbols([ptsz])) == {"stream"}


@pytest.mark.slow
def test_project_cuda_kernels_are_clean(tmp_path):
    toolchain = cuda_toolchain()

    def compile_one(index_and_src):
        index, src = index_and_src
        obj = tmp_path / f"{index}_{src.stem}.o"
        argv = toolchain.nvcc_command(src, obj, "cuda_extension", src.parent.parent, ())
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
        return obj

    with ThreadPoolExecutor(max_workers=4) as pool:
        objects = list(pool.map(compile_one, enumerate(PROJECT_KERNELS)))
    assert len(objects) >= 8
    assert audit_symbols(objects) == []


@pytest.mark.slow
def test_cpu_example_build_is_clean(examples, cache_dir):
    result = build(load_candidate(examples / "cpu_swish" / "solution"), "cpu", cache_dir=cache_dir)
    assert result.ok, result.log
    (module,) = result.modules.values()
    assert audit_symbols([Path(module)]) == []


FALLBACK_BINDING = """#include "../binding_registry.h"

// Looks like a kernel binding, but runs ATen: relu, a reduction and operators.
static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  auto y = at::relu(x);
  return y * scale + x.sum();
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "torch fallback");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish)
"""


@pytest.mark.slow
def test_binding_calling_aten_is_flagged(examples, cache_dir, tmp_path):
    root = tmp_path / "fallback"
    shutil.copytree(examples / "cpu_swish" / "solution", root)
    (root / "kernels" / "scaled_swish_binding.cpp").write_text(FALLBACK_BINDING)
    candidate = load_candidate(root)
    assert "aten-compute" in rules(check_candidate(candidate))  # the source scan sees at::relu and .sum()
    result = build(candidate, "cpu", cache_dir=cache_dir)
    assert result.ok, result.log
    found = audit_symbols([Path(p) for p in result.modules.values()])
    assert rules(found) == {"aten-compute"}
    ops = {v.message.rsplit(" ", 1)[-1] for v in found}
    # `*` and `+` are invisible to the source scan; the symbols show them (mul, add).
    assert {"relu", "sum", "mul", "add"} <= ops


def test_persisting_l2_controls_are_visible(tmp_path):
    source = ("#include <cuda_runtime.h>\n__global__ void k(float* x) { x[0] = 1.0f; }\n"
              "extern \"C\" void go(float* x, cudaStream_t s) {\n"
              "  cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 1 << 20);\n"
              "  cudaStreamAttrValue v = {};\n  cudaStreamSetAttribute(s, cudaStreamAttributeAccessPolicyWindow, &v);\n"
              "  k<<<1, 1, 0, s>>>(x);\n}\n")
    found = audit_symbols([nvcc_object(tmp_path, "l2", source)])
    assert rules(found) == {"cache-control"}, [v.describe() for v in found]


def test_imports_the_toolchain_probe_has_are_allowed(tmp_path):
    obj = gxx_object(tmp_path, "sock", "#include <sys/socket.h>\nint f() { return socket(1, 1, 0); }\n")
    assert rules(audit_symbols([obj])) == {"syscall"}
    assert audit_symbols([obj], allowed=frozenset({"socket"})) == []
