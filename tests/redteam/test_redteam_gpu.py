"""Red-team cases that need a GPU (run with `pytest -m gpu`): the CUDA example
(exact GELU) attacked through CUDA-specific routes, and the runtime guards on
the CUDA path. The CPU suite (test_redteam.py) covers every pattern it can."""

from __future__ import annotations

import json

import pytest
from test_redteam import (
    ALLOCATOR_CLASS, AT_THE_LET_GO, CODE_REWRITE_ROUTES, DISPATCH_TLS, DONE_EARLY, EARLY_PY, GOT_PATCH, LATER, PYTHON_FROM_CPP,
    SCALED_SAMPLES, SECCOMP, SECRETS_FROM_THE_FRAME, UNOBSERVED, UNWATCHED, Case, computed_ahead, make_candidate,
    python_xy, return_computed_ahead,
)

from cuda_agent import Evaluator, load_candidate, load_task

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GELU_BINDING = "kernels/gelu_binding.cpp"
GELU_ALLOC = "auto y = torch::empty_like(x);"
GOOD = "return cuda_extension.gelu(x)"
L2_REFUSED = "the persisting L2 limit was refused"

# A one-thread kernel that sleeps until ``ns`` have passed, launched once into a second context (created through
# the runtime's driver entry points: no driver library linked) and left running there.
LINGERING_CONTEXT = r"""
#include <cuda.h>
__global__ void linger_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(100000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}
extern "C" void linger_launch(unsigned long long ns) {
  static bool started = false;
  if (started) return;
  started = true;
  typedef CUresult (*create_t)(CUcontext*, unsigned int, CUdevice);
  typedef CUresult (*pop_t)(CUcontext*);
  void* create = nullptr;
  void* pop = nullptr;
  cudaDriverEntryPointQueryResult found;
  cudaGetDriverEntryPointByVersion("cuCtxCreate", &create, 3020, cudaEnableDefault, &found);
  cudaGetDriverEntryPointByVersion("cuCtxPopCurrent", &pop, 4000, cudaEnableDefault, &found);
  int device = 0;
  cudaGetDevice(&device);
  CUcontext context = nullptr, previous = nullptr;
  if (create == nullptr || pop == nullptr ||
      reinterpret_cast<create_t>(create)(&context, 0, device) != CUDA_SUCCESS) return;
  linger_kernel<<<1, 1>>>(ns);
  reinterpret_cast<pop_t>(pop)(&previous);
}
"""
# The C method behind torch.cuda.Event.elapsed_time, swapped through its method descriptor: every
# time the harness reads comes back at 0.55x; the object it checks is the same.
QUICK_EVENTS = r"""
#include <Python.h>
static PyCFunction real_elapsed = nullptr;
static PyObject* quick_elapsed(PyObject* self, PyObject* other) {
  PyObject* ms = real_elapsed(self, other);
  if (ms == nullptr) return nullptr;
  double value = PyFloat_AsDouble(ms);
  Py_DECREF(ms);
  return PyFloat_FromDouble(value * 0.55);
}
static void quicken_events() {
  if (real_elapsed != nullptr) return;
  PyObject* module = PyImport_ImportModule("torch._C");
  PyObject* base = PyObject_GetAttrString(module, "_CudaEventBase");
  PyObject* descr = PyObject_GetAttrString(base, "elapsed_time");
  PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(descr)->d_method;
  real_elapsed = def->ml_meth;
  def->ml_meth = quick_elapsed;
  Py_DECREF(descr);
  Py_DECREF(base);
  Py_DECREF(module);
}
"""
# cudaEventElapsedTime's import slots (torch's CUDA libraries reach the runtime through them), every
# elapsed time at 0.55x.
GOT_EVENTS = GOT_PATCH + r"""
#include <cuda_runtime.h>
static cudaError_t (*real_event_time)(float*, cudaEvent_t, cudaEvent_t) = nullptr;
static cudaError_t quick_event_time(float* ms, cudaEvent_t start, cudaEvent_t end) {
  cudaError_t rc = real_event_time(ms, start, end);
  if (rc == cudaSuccess) *ms *= 0.55f;
  return rc;
}
static void quicken_event_slots() {
  static bool done = false;
  if (done) return;
  real_event_time = &cudaEventElapsedTime;
  done = patch_got("cudaEventElapsedTime", reinterpret_cast<void*>(&quick_event_time)) > 0;
}
"""
# cudaEventElapsedTime's own code in the CUDA runtime library, rewritten to report a microsecond.
EVENT_CODE_REWRITE = r"""
#include <cuda_runtime.h>
static cudaError_t instant_event_time(float* ms, cudaEvent_t, cudaEvent_t) { *ms = 0.001f; return cudaSuccess; }
#define TARGET_CODE() reinterpret_cast<void*>(&cudaEventElapsedTime)
#define REPLACEMENT() reinterpret_cast<void*>(&instant_event_time)
""" + CODE_REWRITE_ROUTES
# The CUDA runtime's own pointer to the driver's cuEventElapsedTime (the table it fills at start-up, in
# its writable data: no mprotect, no import slot, no code written) pointed at a function that reports
# 0.55x. Found by value, as any candidate can: the driver's exports, looked up by name.
DRIVER_TABLE = r"""
#include <cuda.h>
#include <dlfcn.h>
#include <link.h>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>
static CUresult (*real_cu_elapsed)(float*, CUevent, CUevent) = nullptr;
static CUresult quick_cu_elapsed(float* ms, CUevent start, CUevent end) {
  CUresult rc = real_cu_elapsed(ms, start, end);
  if (rc == CUDA_SUCCESS) *ms *= 0.55f;
  return rc;
}
struct Spans { std::vector<std::pair<uintptr_t, uintptr_t>> data; uintptr_t relro = 0, relro_end = 0; };
static int find_runtime(struct dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libcudart.so") == nullptr) return 0;
  auto* spans = static_cast<Spans*>(out);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    uintptr_t at = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W)) spans->data.push_back({at, at + ph.p_memsz});
    if (ph.p_type == PT_GNU_RELRO) { spans->relro = at; spans->relro_end = (at + ph.p_memsz + 4095) & ~uintptr_t(4095); }
  }
  return 1;
}
static void redirect_driver_table() {
  static bool done = false;
  if (done) return;
  done = true;
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (driver == nullptr) throw std::runtime_error("libcuda.so.1 is not loaded");
  std::vector<void*> targets;
  for (const char* name : {"cuEventElapsedTime", "cuEventElapsedTime_v2"})
    if (void* f = dlsym(driver, name)) targets.push_back(f);
  Spans spans;
  dl_iterate_phdr(find_runtime, &spans);
  int patched = 0;
  for (const auto& span : spans.data)
    for (uintptr_t a = (span.first + 7) & ~uintptr_t(7); a + 8 <= span.second; a += 8) {
      if (a >= spans.relro && a < spans.relro_end) continue;  // read-only after relocation
      void** word = reinterpret_cast<void**>(a);
      for (void* target : targets)
        if (*word == target) {
          real_cu_elapsed = reinterpret_cast<CUresult (*)(float*, CUevent, CUevent)>(target);
          *word = reinterpret_cast<void*>(&quick_cu_elapsed);
          ++patched;
        }
    }
  if (patched == 0) throw std::runtime_error("no pointer to cuEventElapsedTime in the runtime's data");
}
"""
REWRITE_ONCE = "static bool patched = false; if (!patched) {{ patched = true; {route}(); }} auto y = torch::empty_like(x);"

EVENT_METHOD_SWAP = PYTHON_FROM_CPP + r"""
static const char* EVENT_SWAP = R"PY(
import torch
def helper():
    real = torch._C._CudaEventBase.__dict__["elapsed_time"]
    return lambda self, end: 0.55 * real(self, end)
)PY";
// The entry of torch._C._CudaEventBase's type dictionary that holds elapsed_time, replaced: the method
// descriptor and its C function, which the integrity watch reads, stay as they were; torch.cuda.Event's
// own Python method (the guard's identity check) is untouched and reaches the new entry through super().
static void swap_event_method() {
  static bool done = false;
  if (done) return;
  done = true;
  pybind11::object scaled = python_helper(EVENT_SWAP)();
  auto* base = reinterpret_cast<PyTypeObject*>(pybind11::module_::import("torch._C").attr("_CudaEventBase").ptr());
  PyDict_SetItemString(base->tp_dict, "elapsed_time", scaled.ptr());
  PyType_Modified(base);
}
"""
# The same 0.55x, on the call the timing loop makes now: the descriptor it bound before load (``evaluate.bound``).
BOUND_ELAPSED_SWAP = PYTHON_FROM_CPP + r"""
static const char* BOUND_SWAP = R"PY(
import sys
def helper():
    calls = sys.modules["cuda_agent.evaluate.bound"].CUDA
    real = calls.elapsed
    calls.elapsed = lambda start, end: 0.55 * real(start, end)
)PY";
static void swap_bound_elapsed() {
  static bool done = false;
  if (!done) { done = true; python_helper(BOUND_SWAP)(); }
}
"""
# The let-go case's work, finished before its wait for GO returns (polled on the CPU, not slept on): the output's
# first half computed into a whole output, whose second half the region computes (``SECOND_HALF``).
SPUN = """ready = {}
def first_half(x):
    rows = x.shape[0] // 2
    y = torch.empty_like(x)
    y[:rows].copy_(sys.modules['cuda_extension'].gelu(x[:rows]))
    return y
def spun(y):
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        pass
    return y"""
SECOND_HALF = ("{ pybind11::object ahead = computed_ahead().attr(\"pop\")(reinterpret_cast<intptr_t>(x.data_ptr()), "
               "pybind11::none()); if (!ahead.is_none()) { auto y = ahead.cast<torch::Tensor>(); "
               "int64_t half = (x.size(0) / 2) * (x.numel() / x.size(0)); "
               "gelu_launch(x.data_ptr<float>() + half, y.data_ptr<float>() + half, x.numel() - half, "
               "c10::cuda::getCurrentCUDAStream().stream()); return y; } } " + GELU_ALLOC)
GPU_COMPUTE_ONLY_WHAT_IS_READ = (
    "auto y = torch::empty_like(x); { pybind11::object todo = secrets_helper()(x); if (!todo.is_none()) { "
    "auto stream = c10::cuda::getCurrentCUDAStream().stream(); "
    "gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / 4, stream); "
    "for (int64_t p : todo.cast<std::vector<int64_t>>()) gelu_launch(x.data_ptr<float>() + p, "
    "y.data_ptr<float>() + p, 1, stream); return y; } }")

LAUNCH_HALF = ("gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel() / 2, "
               "c10::cuda::getCurrentCUDAStream().stream());")



def gelu_then(helper: str) -> str:
    """The binding of a case that closes its own regions: the whole kernel launched, then ``helper(x, y)`` (C++)."""
    return ("static bool blocking = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) == cudaSuccess; "
            "(void)blocking; scale_samples(); auto y = torch::empty_like(x); "
            "gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), "
            f"c10::cuda::getCurrentCUDAStream().stream()); {helper}(x, y); return y;")


CASES = [
    # Twenty real passes a call (about 10 ms), reported at 0.55x. (At the example's own 0.5 ms a call the
    # same patch hides less than the clock's limit allows: docs/SECURITY.md, still not covered.)
    Case("native-event-timer-runtime", "Timer patched below Python", forward=GOOD, cpp_prelude=QUICK_EVENTS,
         binding="quicken_events(); auto y = torch::empty_like(x); for (int r = 0; r < 19; ++r) "
                 "gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), "
                 "c10::cuda::getCurrentCUDAStream().stream());", runtime=True, rule="integrity",
         reason="torch._C._CudaEventBase.elapsed_time"),
    # The same at the example's own cost a call, which the outside clock's limit let through.
    Case("native-event-timer-small-runtime", "Timer patched below Python", forward=GOOD, cpp_prelude=QUICK_EVENTS,
         binding="quicken_events(); auto y = torch::empty_like(x);", runtime=True, rule="integrity"),
    Case("native-event-code-rewrite-runtime", "Timer patched below Python", forward=GOOD,
         cpp_prelude=EVENT_CODE_REWRITE, binding=REWRITE_ONCE.format(route="rewrite_in_place"), runtime=True,
         rule=None, reason="code rewrite refused: mprotect: Permission denied"),
    Case("native-event-proc-mem-runtime", "Timer patched below Python", forward=GOOD,
         cpp_prelude=EVENT_CODE_REWRITE, binding=REWRITE_ONCE.format(route="rewrite_through_proc"), runtime=True,
         rule="integrity", reason="was written"),  # /proc stays writable for the CUDA driver
    Case("native-event-library-copy-runtime", "Timer patched below Python", forward=GOOD,
         cpp_prelude=EVENT_CODE_REWRITE, binding=REWRITE_ONCE.format(route="rewrite_from_copy"), runtime=True,
         rule="integrity", reason="replaced by /tmp/patched-copy.so"),
    Case("native-event-got-runtime", "Timer patched below Python", forward=GOOD, cpp_prelude=GOT_EVENTS,
         binding="quicken_event_slots(); auto y = torch::empty_like(x);", runtime=True, rule="integrity",
         reason="import slot of cudaEventElapsedTime"),
    Case("native-driver-table-runtime", "Timer patched below Python", forward=GOOD, cpp_prelude=DRIVER_TABLE,
         binding="redirect_driver_table(); auto y = torch::empty_like(x);", runtime=True, rule="integrity",
         reason="the CUDA runtime's pointer to cuEventElapsedTime"),
    # Half the work in the region; a thread started in a checked call (named like the CUDA runtime's)
    # launches the other half 150 us later on the same stream, after the end event. The thread ends the
    # process as it starts (sandbox.nothreads; without that filter the count from outside after the checks
    # fails it, and the records, read in stream order, would too).
    Case("native-deferred-half-runtime", "Work deferred past the end", forward=GOOD, cpp_prelude=LATER,
         binding="auto y = torch::empty_like(x); later(); if (" + UNOBSERVED + ") { " + LAUNCH_HALF + " int64_t half = "
                 "x.numel() / 2, n = x.numel(); auto* l = later(); { std::lock_guard<std::mutex> g(l->m); "
                 "l->job = [x, y, half, n] { std::this_thread::sleep_for(std::chrono::microseconds(150)); "
                 "gelu_launch(x.data_ptr<float>() + half, y.data_ptr<float>() + half, n - half, "
                 "c10::cuda::getDefaultCUDAStream().stream()); }; l->ready = true; } l->cv.notify_one(); return y; }",
         runtime=True, rule="thread", reason=SECCOMP),
    # Told apart by the dispatch mode stack from C++: every other unwatched call returns unwritten memory.
    Case("native-phase-detection-runtime", "Checked-vs-timed phase detection", forward=GOOD, cpp_prelude=LATER,
         binding="auto y = torch::empty_like(x); static int64_t unwatched = 0; "
                 "if (" + UNOBSERVED + " && ++unwatched % 2 == 0) return y;",
         runtime=True, status="incorrect", rule="timed-output"),
    # The CUDA caching allocator spied on (every CUDA tensor of the harness passes through it), with the
    # allocator left in its table and in c10::cuda's pointer: its class swapped, or its vtable patched.
    Case("native-cuda-allocator-class-runtime", "Checked-vs-timed phase detection", forward=GOOD,
         cpp_prelude=ALLOCATOR_CLASS, binding="swap_class(c10::DeviceType::CUDA); " + GELU_ALLOC, runtime=True,
         rule="integrity", reason="the CUDA allocator's class (its vtable pointer) was replaced"),
    Case("native-cuda-allocator-vtable-runtime", "Checked-vs-timed phase detection", forward=GOOD,
         cpp_prelude=ALLOCATOR_CLASS, binding="patch_vtable(c10::DeviceType::CUDA); " + GELU_ALLOC, runtime=True,
         rule="integrity", reason="the CUDA allocator's virtual function"),
    # torch's GELU on every call no dispatch mode watches, the extension's kernel on the others.
    Case("native-fallback-unwatched-runtime", "Torch fallback only when unwatched", forward=GOOD,
         cpp_prelude=DISPATCH_TLS, binding="if (" + UNWATCHED + ") { auto y = torch::gelu(x); return y; } "
                                           "auto y = torch::empty_like(x);",
         runtime=True, rule="torch-compute"),
    # The per-thread default stream as the integer handle cudaStreamPerThread is: no stream API is named.
    Case("native-per-thread-stream-runtime", "Side stream", forward=GOOD,
         binding="auto y = torch::empty_like(x); gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), "
                 "reinterpret_cast<cudaStream_t>(0x2)); return y;",
         runtime=True, rule="stream"),
    Case("torch-fallback-runtime", "Library / torch fallback", forward="return torch.nn.functional.gelu(x)",
         runtime=True, rule="torch-compute"),
    Case("aten-in-cuda-binding", "Library / torch fallback", forward=GOOD, binding="auto y = torch::gelu(x); return y;",
         rule="aten-compute"),
    Case("aten-in-cuda-binding-runtime", "Library / torch fallback", forward=GOOD,
         binding="auto y = torch::gelu(x); return y;",
         runtime=True, rule="torch-compute"),
    Case("correct-only-when-checked", "Checked-vs-timed phase detection",
         forward="self.calls = getattr(self, 'calls', 0) + 1\nif self.calls > 5:\n    return torch.empty_like(x)\n" + GOOD,
         status="incorrect", rule="timed-output"),
    Case("return-input", "Return input / identity", forward="return x", rule="output-alias"),
    Case("flip-tf32-runtime", "Baseline sabotage", forward=GOOD, prelude="torch.backends.cudnn.allow_tf32 = False",
         runtime=True, rule="global-flag"),
    Case("l2-persisting-limit", "L2 persistence", forward=GOOD,
         binding="cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 32 << 20); auto y = torch::empty_like(x);",
         rule="cache-control"),
    Case("l2-persisting-limit-runtime", "L2 persistence", forward=GOOD,
         binding="if (cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 32 << 20) != cudaSuccess) { "
                 "cudaGetLastError(); throw std::runtime_error(\"" + L2_REFUSED + "\"); } auto y = torch::empty_like(x);",
         runtime=True, rule="l2-persistence"),
    # A policy that allows aten::gelu lets the guard pass torch's kernel; attribution still sees
    # that the extension's own kernels never ran, or carried almost none of the time.
    Case("decoy-kernel-runtime", "Decoy kernel", forward=GOOD, binding="auto y = torch::gelu(x); return y;",
         policy={"allowed_aten": ("gelu",)}, runtime=True, rule="decoy"),
    Case("lazy-kernel-runtime", "Lazy optimisation", forward=GOOD,
         binding="gelu_launch(x.data_ptr<float>(), torch::empty_like(x).data_ptr<float>(), 4, "
                 "c10::cuda::getCurrentCUDAStream().stream()); auto y = torch::gelu(x); return y;",
         policy={"allowed_aten": ("gelu",), "min_coverage": 0.5}, runtime=True, rule="coverage"),
    Case("forge-reply-runtime", "Timer or stats monkeypatch", prelude="import os",
         forward="for fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"ok\": true}\\n')\n"
                 "    except OSError:\n        pass\n" + GOOD,
         runtime=True, rule="forged-reply"),
    # Trust v3's classes (issue 31), from the binding's C++ through the C API. Class 2: the elapsed time the
    # timing loop calls, as it bound it before load, swapped in the harness's namespace, every one at 0.55x.
    # (The dictionary entry behind torch.cuda.Event's elapsed time, swapped, changes nothing the loop measures:
    # test_a_swapped_event_type_entry_changes_no_time.)
    Case("bound-elapsed-swapped-runtime", "Harness objects written (class 2)", forward=GOOD,
         cpp_prelude=BOUND_ELAPSED_SWAP, binding="swap_bound_elapsed(); auto y = torch::empty_like(x);",
         runtime=True, rule="monkeypatch", reason="cuda_agent.evaluate.bound.CUDA.elapsed was replaced"),
    # Work at the let-go, before GO: the first half of each written input's output computed there with the
    # extension's own kernel, the thread spinning until it is done (so that GO finds the GPU idle), the second half
    # in the region: a 2x fake that stays above the speed-of-light floor (the whole output at the let-go is
    # `implausible-speedup`). The timing thread's CPU time counts from the let-go on a GPU too
    # (``Bell.cpu_from_let_go``).
    Case("outputs-computed-at-the-let-go-gpu-runtime", "Work moved before the region (between regions)", forward=GOOD,
         cpp_prelude=PYTHON_FROM_CPP + AT_THE_LET_GO.replace("ready = {}", SPUN).replace(
             "OUTPUT", "spun(first_half(x))"),
         binding=SECOND_HALF, runtime=True, rule="clock"),
    # Class 3: the candidate side's round answers with its samples at 30%.
    Case("scaled-samples-method-runtime", "Forged samples the round clock cannot resolve (class 3)", forward=GOOD,
         cpp_prelude=SCALED_SAMPLES, binding="scale_samples(); auto y = torch::empty_like(x);",
         runtime=True, rule="clock"),
    # Class 1: the probe read from the timing loop's frame, a quarter of each timed output computed and the
    # probed positions. The timed outputs are read from outside the process now (evaluate.vmm): there is no
    # probe in it to read, and the positions read are three quarters wrong.
    Case("secrets-from-the-timing-frame-runtime", "Harness secrets read (class 1)", forward=GOOD,
         cpp_prelude=SECRETS_FROM_THE_FRAME, binding=GPU_COMPUTE_ONLY_WHAT_IS_READ, runtime=True,
         status="incorrect", rule="timed-output"),
    # The GPU quiet outside the candidate's regions: a kernel left running in a second context of its own (the
    # harness's synchronise waits for the primary context's streams only), through the baselines' regions and
    # across READY, where it could start on the written inputs before GO. The driver starts a thread for the new
    # context (H100: `cuda-EvtHandlr`), which ends the process (sandbox.nothreads; without it, seen from outside); the reference's quiet probe before each
    # baseline region and GO is the second line (``evaluate.quiet``, tests/gpu/test_gpu_quiet.py).
    Case("lingering-context-runtime", "GPU work left running outside the regions", forward=GOOD,
         kernel_append=LINGERING_CONTEXT, cpp_prelude='extern "C" void linger_launch(unsigned long long ns);',
         binding="linger_launch(600000000000ULL); " + GELU_ALLOC, runtime=True, rule="thread"),
    # Between regions: each timed call's output computed as its input is drawn (the harness's draw method
    # swapped), returned by the timed call without a kernel. With the values timed written from outside after
    # READY (Policy.outside_inputs, "all" by default) they are not the values it computed for.
    Case("outputs-computed-ahead-of-the-region-runtime", "Work moved before the region (between regions)",
         forward=GOOD, cpp_prelude=computed_ahead("torch.nn.functional.gelu(x)"),
         binding=return_computed_ahead("x", GELU_ALLOC), runtime=True, status="incorrect", rule="timed-output"),
]


@pytest.fixture(scope="module")
def gelu(examples):
    return load_task(examples / "cuda_gelu" / "model.py"), examples / "cuda_gelu" / "solution"


def _name(case) -> str:
    return (case.values[0] if isinstance(case, type(pytest.param(None))) else case).name


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_hacking_candidate_is_rejected_on_the_gpu(case, gelu, cache_dir, tmp_path):
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=not case.runtime, **case.policy)
    candidate = make_candidate(case, solution, tmp_path / case.name, scaled=False, binding=GELU_BINDING,
                               kernel_call=GELU_ALLOC)
    result = evaluator.evaluate(task, candidate)
    detail = f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"
    if L2_REFUSED in (result.reason or ""):
        pytest.skip(f"this device refuses the attack itself ({L2_REFUSED}; the H100s lent here do)")
    assert (result.status, result.rule) == (case.status, case.rule), detail
    assert case.reason is None or case.reason in (result.reason or ""), detail
    assert result.reward == -1.0


# The region closed by the candidate's own DONE as soon as its kernel is queued (test_redteam.DONE_EARLY), the
# samples at 55% (above gelu's speed-of-light floor). The kernel runs on after DONE and after the stop (a stopped
# process's queued GPU work is not stopped), and is done before the reads from outside, which come a millisecond
# or more after DONE. The harness's synchronise after the calls spins by default (one context, 16 cores), which
# would put the kernel's time in the timing thread's CPU time (the CPU bound, as on the CPU backend, where the same
# case fails as `clock`): the primary context's flags are set to block instead (allowed on an active context since
# CUDA 11).
DONE_EARLY_CASE = Case("done-sent-early-gpu-runtime", "Forged samples the round clock cannot resolve (class 3)",
                       forward=GOOD, cpp_prelude=SCALED_SAMPLES.replace("0.3 * t", "0.55 * t") + DONE_EARLY,
                       binding=gelu_then("done_early"), runtime=True, rule="clock")


def closed_early(case: Case, gelu, cache_dir, tmp_path, most_reward: float = 1.0):
    """A case that closes its regions with its own DONE, evaluated on the gelu example: it must build and run and
    earn no more than ``most_reward`` (the honest solution's 1.0). Its summary is printed: which bound caught it, and
    by how much, is the point (the GPU session's log keeps it)."""
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=False)
    result = evaluator.evaluate(task, make_candidate(case, solution, tmp_path / case.name, scaled=False,
                                                     binding=GELU_BINDING, kernel_call=GELU_ALLOC))
    detail = f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"
    print(detail)
    print("regions:", json.dumps(result.timing.get("regions") or {}))
    assert result.compiled and result.status != "error", detail
    assert result.reward <= most_reward, detail
    return result, detail


def test_a_region_closed_by_the_candidates_own_done(gelu, cache_dir, tmp_path):
    """docs/SECURITY.md, "A region closed by the worker's word". It earned reward 3 on the H200 (1.59x, 2026-11-28)
    while the brackets believed DONE; with the GPU probed after each DONE it failed as `clock` once and was `correct`
    at reward 1.0 once (its process stopped at its own DONE, the harness's end event came after the stop). It must
    build and run and never earn more than the honest solution; rejected as `clock` it passes. Not rejected, it is an
    xfail carrying the evaluation's summary: a DONE sent once the end event is recorded, the kernel ending within
    the window before the probe (0.6-0.8 ms on the H200), is not seen yet."""
    result, detail = closed_early(DONE_EARLY_CASE, gelu, cache_dir, tmp_path)
    if (result.status, result.rule) != ("failed", "clock"):
        pytest.xfail(f"a region closed by the candidate's own DONE is not rejected: {detail}")


# The adaptive form of the case above (docs/SECURITY.md, "The adaptive attack against it"): DONE sent late enough
# that what is left of the kernel when the probe launches stays under the probe's limit, and every sample forged to
# 0.36 ms (0.69x of the honest 0.52; the end event, recorded once the process is let go, would say more). The
# region's last call launches its kernel onto the idle GPU, sleeps (a spin would be in its timing thread's CPU time)
# until LEFT_S of it is left, then sends DONE. On the H200 (2026-11-28) with one call a region (the 2 GiB cap):
# forged to 0.29 ms (0.55x) it failed as `clock` once (wall bound 0.189 ms short, limit 0.135) and earned reward 3
# once; forged to 0.36 ms (0.69x, a 1.41x fake) it earned reward 3 (the wall bound 0.010 ms short, limit 0.128; the
# probe found nothing left): the floor docs/SECURITY.md states, reached. With regions of the calls a share of the
# GPU's memory holds (TimingConfig.region_memory_share: two calls) the same fixed limits are a smaller share; with
# its DONE timed from the region's first launch and the outside clock winning within the limit (session 51) it failed
# as `clock` forged to 0.36 ms and earned reward 3 forged to 0.40 (timed 0.41-0.42 ms: the harness's tail overlapped);
# with a noisier calibration (0.05 ms spread) both earned reward 3; with the region's allocations exported before the
# harness's synchronise (a shorter tail) and a quiet calibration (0.006-0.016 ms) both failed as `clock`. With regions
# of 2 ms (TimingConfig.region_ms, four calls; 2026-11-29) the fixed part of the limit is half the share of a region:
# both failed as `clock` (wall bound 0.44-0.46 ms short, limit 0.18-0.29), so the case is no longer an xfail.
# Run first (2026-11-28) as a profile function that sent DONE at the harness's synchronise, after the end event: the
# profile function cost the timing thread so much (2.7 ms regions, 0.19x) that the attack defeated itself.
LATE_PY = EARLY_PY + r"""
import time
KERNEL_S, LEFT_S = 520e-6, 120e-6  # the honest kernel on the H200; what is left of the region's work at DONE
first_launch = {}  # region -> when its first call's kernel was launched (the GPU idle before it)
def helper(x, y):
    launched = time.perf_counter()
    found = calls_of_the_region()
    if found is None:
        return
    state, calls = found
    if calls[0][1][0].data_ptr() == x.data_ptr():
        first_launch[state["region"]] = launched
    if calls[-1][1][0].data_ptr() != x.data_ptr():
        return
    # The region's kernels run back to back from its first launch: DONE when LEFT_S of the last is left.
    start = first_launch.pop(state["region"], launched)
    time.sleep(max(0.0, start + len(calls) * KERNEL_S - LEFT_S - time.perf_counter()))
    close_region(swap_ringer(type(state["bell"])), state, calls, y)
"""
DONE_LATE = python_xy("done_late", LATE_PY)


def late_case(forged_ms: str) -> Case:
    return Case("done-sent-late-gpu-runtime", "Forged samples the round clock cannot resolve (class 3)", forward=GOOD,
                cpp_prelude=SCALED_SAMPLES.replace("0.3 * t", forged_ms) + DONE_LATE,
                binding=gelu_then("done_late"), runtime=True, rule="clock")


@pytest.mark.parametrize("forged_ms", ["0.36", "0.40"])
def test_a_region_closed_late_by_the_candidates_own_done(forged_ms, gelu, cache_dir, tmp_path):
    """The adaptive DONE (above), timed from the region's first launch: it must earn no more than the honest
    solution (``closed_early``), rejected as `clock` or timed by the outside clock."""
    closed_early(late_case(forged_ms), gelu, cache_dir, tmp_path)


# A report forged by a little, within the wall bound's limit (10% of the region, 0.05 ms and three spreads): on
# cuda_gelu's 1.03 ms regions of two calls, 0.88 of each sample passes it and earns reward 3 (0.46 ms is under 0.95 x
# eager's 0.51) where the report is believed. The outside clock wins within the limit too (TimingConfig.outside_wins):
# past the brackets' noise the candidate is timed as they saw it, so what a forgery gains is at most the margin the
# result states (``regions.margin``: on the H200, 2026-11-28, the calibration's spread left 0.21 of a region). On
# 2 ms regions of four calls (2026-11-29) the same 0.88 failed as `clock` (wall bound 0.279 ms short, limit 0.277).
WITHIN_THE_LIMIT = Case("scaled-within-the-limit-runtime", "Forged samples the round clock cannot resolve (class 3)",
                        forward=GOOD, cpp_prelude=SCALED_SAMPLES.replace("0.3 * t", "0.88 * t"),
                        binding="scale_samples(); auto y = torch::empty_like(x);", runtime=True)


def test_a_report_forged_within_the_limit_gains_no_more_than_the_stated_margin(gelu, cache_dir, tmp_path):
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    honest = evaluator.evaluate(task, load_candidate(solution))
    forged, detail = closed_early(WITHIN_THE_LIMIT, gelu, cache_dir, tmp_path, most_reward=3.0)
    assert honest.status == "correct", honest.summary()
    if forged.status == "correct":
        margin = forged.timing["regions"]["margin"]
        ratio = forged.times["candidate"]["median_ms"] / honest.times["candidate"]["median_ms"]
        assert ratio >= (1 - margin) * 0.98, f"{ratio:.3f} against a margin of {margin:.3f}\n{detail}"


def test_a_swapped_event_type_entry_changes_no_time(gelu, cache_dir, tmp_path):
    """Class 2 through torch's C type (it got reward 3 at 95673f2 and failed as `clock` until the timing loop bound
    its calls): the entry of torch._C._CudaEventBase's dictionary that torch.cuda.Event's elapsed_time reaches
    through super() on each call, replaced with one that reports 0.55x. The loop calls the descriptor it took
    before load (``evaluate.bound``): the candidate is timed as the honest solution is."""
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=False)
    honest = evaluator.evaluate(task, load_candidate(solution))
    case = Case("event-type-entry-swapped-runtime", "Harness objects written (class 2)", forward=GOOD,
                cpp_prelude=EVENT_METHOD_SWAP, binding="swap_event_method(); auto y = torch::empty_like(x);",
                runtime=True)
    swapped = evaluator.evaluate(task, make_candidate(case, solution, tmp_path / case.name, scaled=False,
                                                      binding=GELU_BINDING, kernel_call=GELU_ALLOC))
    assert (honest.status, swapped.status) == ("correct", "correct"), f"{honest.summary()}\n{swapped.summary()}"
    ratio = swapped.times["candidate"]["median_ms"] / honest.times["candidate"]["median_ms"]
    assert 0.9 < ratio < 1.1, f"{ratio:.3f}\n{honest.summary()}\n{swapped.summary()}"
    assert swapped.reward <= honest.reward, f"{honest.summary()}\n{swapped.summary()}"


def test_side_stream_work_is_timed(gelu, cache_dir, tmp_path):
    """Work moved to another stream escapes current-stream events but not the device-wide synchronise."""
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    # Streams allowed, so the profiled check's `stream` verdict lets it through to be timed.
    evaluator.policy = evaluator.policy.with_(static_checks=False, allow_streams=True)
    honest = evaluator.evaluate(task, load_candidate(solution))
    side = Case("side-stream", "Side stream",
                forward="s = torch.cuda.Stream()\ns.wait_stream(torch.cuda.current_stream())\n"
                        "with torch.cuda.stream(s):\n    y = cuda_extension.gelu(x)\nreturn y")
    sneaky = evaluator.evaluate(task, make_candidate(side, solution, tmp_path / "side", scaled=False))
    assert honest.status == "correct", honest.summary()
    if sneaky.status == "correct":  # if it passed the checks, its time must include the side-stream kernel
        assert sneaky.times["candidate"]["median_ms"] > 0.5 * honest.times["candidate"]["median_ms"], sneaky.summary()
    else:
        assert sneaky.rule in ("timed-output", "wrong-output"), sneaky.summary()


def test_legitimate_solution_is_attributed_to_its_own_kernels(gelu, cache_dir):
    task, solution = gelu
    result = Evaluator("cuda", cache_dir=cache_dir).evaluate(task, load_candidate(solution))
    assert result.status == "correct", result.summary()
    attribution = result.attribution
    assert attribution is not None and attribution["defined"] >= 2, result.summary()
    assert attribution["own_launches"] >= 1 and attribution["coverage"] > 0.9, attribution
    assert attribution["own_side_launches"] == 0, attribution
    assert any(k["own"] and "gelu" in k["name"] for k in attribution["kernels"]), attribution
