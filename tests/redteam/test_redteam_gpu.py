"""Red-team cases that need a GPU (run with `pytest -m gpu`): the CUDA example
(exact GELU) attacked through CUDA-specific routes, and the runtime guards on
the CUDA path. The CPU suite (test_redteam.py) covers every pattern it can."""

from __future__ import annotations

import sys

import pytest
from casekit import (
    ALLOCATOR_CLASS, AT_THE_LET_GO, C_PROFILE, CODE_REWRITE_ROUTES, DISPATCH_TLS, DONE_EARLY, EARLY_PY, FRACTIONS,
    GOT_PATCH, LATER, PYTHON_FROM_CPP, SCALED_SAMPLES, SECCOMP, SECRETS_FROM_THE_FRAME, SYS_MONITORING, SYS_SETPROFILE,
    UNOBSERVED, UNWATCHED, Case, computed_ahead, deferral_prelude, deferred_share, gains_nothing, make_candidate, python_xy,
    return_computed_ahead,
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
# The same 0.55x, on the call the timing loop makes now: the descriptor it bound before load (``evaluate.protocol.bound``).
BOUND_ELAPSED_SWAP = PYTHON_FROM_CPP + r"""
static const char* BOUND_SWAP = R"PY(
import sys
def helper():
    calls = sys.modules["cuda_agent.evaluate.protocol.bound"].CUDA
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
         runtime=True, rule="monkeypatch", reason="cuda_agent.evaluate.protocol.bound.CUDA.elapsed was replaced"),
    # Class 1: the probe read from the timing loop's frame, a quarter of each timed output computed and the
    # probed positions. The timed outputs are read from outside the process now (evaluate.protocol.vmm): there is no
    # probe in it to read, and the positions read are three quarters wrong.
    Case("secrets-from-the-timing-frame-runtime", "Harness secrets read (class 1)", forward=GOOD,
         cpp_prelude=SECRETS_FROM_THE_FRAME, binding=GPU_COMPUTE_ONLY_WHAT_IS_READ, runtime=True,
         status="incorrect", rule="timed-output"),
    # The GPU quiet outside the candidate's regions: a kernel left running in a second context of its own (the
    # harness's synchronise waits for the primary context's streams only), through the baselines' regions and
    # across READY, where it could start on the written inputs before GO. The driver starts a thread for the new
    # context (H100: `cuda-EvtHandlr`), which ends the process (sandbox.nothreads; without it, seen from outside); the reference's quiet probe before each
    # baseline region and GO is the second line (``evaluate.protocol.quiet``, tests/gpu/test_gpu_quiet.py).
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


# The region closed by the candidate's own DONE as soon as its kernel is queued (casekit.DONE_EARLY), the
# samples at 55% (above gelu's speed-of-light floor). The kernel runs on after DONE and after the stop (a stopped
# process's queued GPU work is not stopped), and is done before the reads from outside, which come a millisecond
# or more after DONE. The harness's synchronise after the calls spins by default (one context, 16 cores), which
# would put the kernel's time in the timing thread's CPU time (the CPU bound, as on the CPU backend, where the same
# case fails as `clock`): the primary context's flags are set to block instead (allowed on an active context since
# CUDA 11).
DONE_EARLY_CASE = Case("done-sent-early-gpu-runtime", "Forged samples the round clock cannot resolve (class 3)",
                       forward=GOOD, cpp_prelude=SCALED_SAMPLES.replace("0.3 * t", "0.55 * t") + DONE_EARLY,
                       binding=gelu_then("done_early"), runtime=True)


# The adaptive form of the case above: DONE sent late enough that little of the region's last kernel is left when it
# is sent, every sample forged (0.36 or 0.40 ms of the honest 0.52). The region's last call launches its kernel onto
# the idle GPU, sleeps (a spin would be in its timing thread's CPU time) until LEFT_S of it is left, then sends DONE.
# The process is stopped at DONE and the probe after the stop waits for what is left.
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
                binding=gelu_then("done_late"), runtime=True)


# A report forged by a little (0.88 of each sample): within what an allowance on the candidate's own report would let
# through, and so worth a reward line where the report is believed.
WITHIN_THE_LIMIT = Case("scaled-within-the-limit-runtime", "Forged samples the round clock cannot resolve (class 3)",
                        forward=GOOD, cpp_prelude=SCALED_SAMPLES.replace("0.3 * t", "0.88 * t"),
                        binding="scale_samples(); auto y = torch::empty_like(x);", runtime=True)


# Work at the let-go, before GO: the first half of each written input's output computed there with the extension's
# own kernel, the thread spinning until it is done (so that GO finds the GPU idle), the second half in the region: a
# 2x fake where the region started at GO. A region starts at its let-go.
AT_THE_LET_GO_GPU = Case("outputs-computed-at-the-let-go-gpu-runtime", "Work moved before the region (between regions)",
                         forward=GOOD, cpp_prelude=PYTHON_FROM_CPP + AT_THE_LET_GO.replace("ready = {}", SPUN).replace(
                             "OUTPUT", "spun(first_half(x))"), binding=SECOND_HALF, runtime=True)
# Class 3: the candidate side's round answers with its samples at 30%.
SCALED = Case("scaled-samples-method-runtime", "Forged samples the round clock cannot resolve (class 3)", forward=GOOD,
              cpp_prelude=SCALED_SAMPLES, binding="scale_samples(); auto y = torch::empty_like(x);", runtime=True)
# Cases that forge what the candidate's process reports, or end its regions by its own word: its time is the
# evaluator's (evaluate.region_clock), so each is correct at its true cost or rejected, never above its honest twin.
TRUE_COST_CASES = [SCALED, AT_THE_LET_GO_GPU, DONE_EARLY_CASE, late_case("0.36"), late_case("0.40"), WITHIN_THE_LIMIT]


@pytest.fixture(scope="module")
def honest_gelu(gelu, cache_dir):
    task, solution = gelu
    return Evaluator("cuda", cache_dir=cache_dir).evaluate(task, load_candidate(solution))


def gpu_no_gain(case: Case, gelu, cache_dir, tmp_path, twin) -> None:
    """``case`` on the gelu example, judged by ``casekit.gains_nothing`` against its honest twin ``twin``."""
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=False, **case.policy)
    result = evaluator.evaluate(task, make_candidate(case, solution, tmp_path / case.name, scaled=False,
                                                     binding=GELU_BINDING, kernel_call=GELU_ALLOC))
    gains_nothing(result, twin, f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}")


@pytest.mark.parametrize("case", TRUE_COST_CASES, ids=[c.name for c in TRUE_COST_CASES])
def test_a_forged_report_or_a_region_ended_by_its_own_word_is_timed_at_its_true_cost(case, gelu, cache_dir, tmp_path,
                                                                                  honest_gelu):
    gpu_no_gain(case, gelu, cache_dir, tmp_path, honest_gelu)


def test_a_swapped_event_type_entry_changes_no_time(gelu, cache_dir, tmp_path):
    """Class 2 through torch's C type (it got reward 3 at 95673f2 and failed as `clock` until the timing loop bound
    its calls): the entry of torch._C._CudaEventBase's dictionary that torch.cuda.Event's elapsed_time reaches
    through super() on each call, replaced with one that reports 0.55x. The loop calls the descriptor it took
    before load (``evaluate.protocol.bound``): the candidate is timed as the honest solution is."""
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


# The deferral class on a GPU (issue 62; casekit.DEFERRED_TAILS): each timed call launches its head, the first
# (1 - 1/TAIL_DENOMINATOR) of its elements, on the current stream and keeps its tail, launched by each case's own
# finisher after the region's DONE (or where the harness's synchronise does not wait for it). Kernel and model_new.py
# are the honest solution's. Against issue 62's tree a tail of 1/5 launched by a C-API thread after DONE earned reward
# 3 (a fake 1.19x), and one launched by a hook on the timing thread 1.13-1.14x. A case that cannot set its deferral up
# on the device (the driver refuses what it needs) raises DEFERRAL_REFUSED and is skipped, saying so.
DEFERRAL_REFUSED = "deferral refused"
FINISH_GELU_TAILS = r"""
#include <cuda_runtime.h>
#include <stdexcept>
#include <string>
extern "C" void gelu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);
static bool tails_pending() { std::lock_guard<std::mutex> g(tails_lock); return !tails.empty(); }
static void launch_tail(const Tail& t, cudaStream_t stream) {
  gelu_launch(t.x.data_ptr<float>() + t.from, t.y.data_ptr<float>() + t.from, t.x.numel() - t.from, stream);
}
static void finish_tails() {
  for (auto& t : take_tails()) launch_tail(t, static_cast<cudaStream_t>(t.stream));
}
static void refused(const char* what, int code) {
  throw std::runtime_error(std::string("deferral refused: ") + what + " (" + std::to_string(code) + ")");
}
"""
# A helper thread started through the CPython C API at each region's last call: it waits for the region's heads to be
# done on the GPU (an event recorded after the last) and for the timing thread to sleep (its synchronise returned, DONE
# sent), launches the tails on the stream the heads ran on, and exits.
GPU_CAPI_THREAD = r"""
static cudaEvent_t heads_done = nullptr;
static void launch_after_done(void*) {
  while (cudaEventQuery(heads_done) == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::microseconds(5));
  wait_for_the_caller_to_sleep();
  finish_tails();
}
static void launch_in_a_new_thread(cudaStream_t stream) {
  if (heads_done == nullptr && cudaEventCreateWithFlags(&heads_done, cudaEventDisableTiming) != cudaSuccess)
    refused("cudaEventCreate", 0);
  cudaEventRecord(heads_done, stream);
  if (PyThread_start_new_thread(launch_after_done, nullptr) == PYTHREAD_INVALID_THREAD_ID) finish_tails();
}
"""
# torch's own GPU-trace callbacks (torch.cuda._gpu_trace, switched on by torch._C._activate_gpu_trace): the device
# synchronisation callback (the harness's synchronise after the region's calls) arms, and the event-record callback that
# follows it (the fence recorded once that synchronise has returned) launches the tails, on the timing thread, before
# DONE and after everything the harness waits for.
GPU_TRACE = r"""
static const char* GPU_TRACE_PY = R"PY(
import torch
from torch.cuda import _gpu_trace
def helper(finish, pending):
    armed = [False]
    def synchronized():
        armed[0] = True
    def recorded(event, stream):
        was, armed[0] = armed[0], False
        if was and pending():
            finish()
    _gpu_trace.register_callback_for_device_synchronization(synchronized)
    _gpu_trace.register_callback_for_event_record(recorded)
    torch._C._activate_gpu_trace()
)PY";
static void hook_the_timing_thread() {
  static bool hooked = false;
  if (hooked) return;
  hooked = true;
  python_helper(GPU_TRACE_PY)(pybind11::cpp_function([] { finish_tails(); }),
                              pybind11::cpp_function([] { return tails_pending(); }));
}
"""
# A second stream the current one never waits for: at the region's last call every tail of the region is launched on
# it behind an event recorded after the last head, so the region's end event (current stream) does not wait for them;
# the tails are kept alive until the next region's first call (``retire_tails``).
SIDE_STREAM_TAILS = r"""
static void retire_tails() { take_tails(); }
static void launch_region_tails_on_a_side_stream(cudaStream_t stream) {
  static cudaStream_t side = nullptr;
  static cudaEvent_t heads = nullptr;
  if (side == nullptr && (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess ||
                          cudaEventCreateWithFlags(&heads, cudaEventDisableTiming) != cudaSuccess)) refused("side stream", 0);
  cudaEventRecord(heads, stream);
  cudaStreamWaitEvent(side, heads, 0);
  std::lock_guard<std::mutex> g(tails_lock);
  for (auto& t : tails) launch_tail(t, side);
}
"""
# The region's tails captured (stream capture on a private stream: nothing runs) into a CUDA graph at its last call,
# and the graph launched on the heads' stream by the C profile function (casekit.C_PROFILE) when DONE's send
# returns.
GRAPH_TAILS = r"""
static cudaGraphExec_t tails_graph = nullptr;
static cudaStream_t tails_graph_stream = nullptr;
static bool tails_graph_ready = false;
static std::vector<Tail> graphed;  // the tensors of the graph's kernels, kept until the next capture
static bool graph_pending() { return tails_graph_ready; }
static void launch_graph() {
  if (!tails_graph_ready) return;
  tails_graph_ready = false;
  cudaGraphLaunch(tails_graph, tails_graph_stream);
}
static void capture_region_tails(cudaStream_t stream) {
  static cudaStream_t capture = nullptr;
  if (capture == nullptr && cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking) != cudaSuccess) refused("capture stream", 0);
  graphed = take_tails();
  cudaGraph_t graph = nullptr;
  cudaError_t rc = cudaStreamBeginCapture(capture, cudaStreamCaptureModeRelaxed);
  if (rc != cudaSuccess) refused("cudaStreamBeginCapture", rc);
  for (auto& t : graphed) launch_tail(t, capture);
  if ((rc = cudaStreamEndCapture(capture, &graph)) != cudaSuccess) refused("cudaStreamEndCapture", rc);
  if (tails_graph != nullptr) cudaGraphExecDestroy(tails_graph);
  if ((rc = cudaGraphInstantiate(&tails_graph, graph, 0)) != cudaSuccess) refused("cudaGraphInstantiate", rc);
  cudaGraphDestroy(graph);
  tails_graph_stream = stream;
  tails_graph_ready = true;
}
#define tails_pending graph_pending
#define finish_tails launch_graph
"""
# A second context of the candidate's own (created through the runtime's driver entry points, as LINGERING_CONTEXT
# is): the harness's synchronise waits for the primary context only. Each timed call enqueues its tail there at once,
# behind a wait (cuStreamWaitValue32) on a flag in pinned host memory that every context can read; the region's last
# call has the flag released after its head (``RELEASED_BY``), so the tails run after the region's heads, while the
# harness's synchronise (primary context) has nothing left to wait for. The region's tensors lie in memory of torch's
# allocator under expandable segments (the driver's virtual memory API), which every context on the device reaches.
# The tails' tensors are kept until the next region's first call (``retire_tails``).
SECOND_CONTEXT_TAILS = r"""
#include <cuda.h>
typedef CUresult (*ctx_create_t)(CUcontext*, unsigned int, CUdevice);
typedef CUresult (*ctx_move_t)(CUcontext*);
typedef CUresult (*ctx_push_t)(CUcontext);
typedef CUresult (*stream_create_t)(CUstream*, unsigned int);
typedef CUresult (*wait_value_t)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
static void* driver_entry(const char* name, int version) {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &entry, version, cudaEnableDefault, &found) != cudaSuccess || entry == nullptr)
    refused(name, 0);
  return entry;
}
struct SecondContext { CUcontext context = nullptr; CUstream stream = nullptr; volatile unsigned* flag = nullptr;
                       ctx_push_t push = nullptr; ctx_move_t pop = nullptr; wait_value_t wait = nullptr;
                       wait_value_t write = nullptr; };
static unsigned tails_region = 0;
static void retire_tails() { take_tails(); ++tails_region; }
static SecondContext& second_context() {
  static SecondContext c = [] {
    SecondContext s;
    auto create = reinterpret_cast<ctx_create_t>(driver_entry("cuCtxCreate", 3020));
    s.push = reinterpret_cast<ctx_push_t>(driver_entry("cuCtxPushCurrent", 4000));
    s.pop = reinterpret_cast<ctx_move_t>(driver_entry("cuCtxPopCurrent", 4000));
    s.wait = reinterpret_cast<wait_value_t>(driver_entry("cuStreamWaitValue32", 12000));
    s.write = reinterpret_cast<wait_value_t>(driver_entry("cuStreamWriteValue32", 12000));
    auto stream_create = reinterpret_cast<stream_create_t>(driver_entry("cuStreamCreate", 2000));
    void* flag = nullptr;
    cudaError_t rc = cudaHostAlloc(&flag, 64, cudaHostAllocPortable | cudaHostAllocMapped);
    if (rc != cudaSuccess) refused("cudaHostAlloc", rc);
    s.flag = static_cast<volatile unsigned*>(flag);
    *s.flag = 0;
    int device = 0;
    cudaGetDevice(&device);
    CUresult r = create(&s.context, 0, device);  // now current
    if (r != CUDA_SUCCESS) refused("cuCtxCreate", r);
    r = stream_create(&s.stream, CU_STREAM_NON_BLOCKING);
    CUcontext previous = nullptr;
    s.pop(&previous);
    if (r != CUDA_SUCCESS) refused("cuStreamCreate", r);
    return s;
  }();
  return c;
}
static void enqueue_in_the_second_context(const torch::Tensor& x, const torch::Tensor& y, int64_t from) {
  SecondContext& c = second_context();
  c.push(c.context);
  CUresult r = c.wait(c.stream, reinterpret_cast<CUdeviceptr>(c.flag), tails_region, CU_STREAM_WAIT_VALUE_GEQ);
  gelu_launch(x.data_ptr<float>() + from, y.data_ptr<float>() + from, x.numel() - from, reinterpret_cast<cudaStream_t>(c.stream));
  CUcontext previous = nullptr;
  c.pop(&previous);
  if (r != CUDA_SUCCESS) refused("cuStreamWaitValue32", r);
}
"""
# ... released by the GPU itself: a stream write (cuStreamWriteValue32) queued on the current stream after the last head.
RELEASED_BY_A_STREAM_WRITE = r"""
static void release_the_tails(cudaStream_t stream) {
  SecondContext& c = second_context();
  CUresult r = c.write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(c.flag), tails_region, 0);
  if (r != CUDA_SUCCESS) refused("cuStreamWriteValue32", r);
}
"""
# ... released by a host callback (cudaLaunchHostFunc) queued on the current stream after the last head: it stores the
# flag (a host function may not call CUDA, so it cannot launch the tail itself; it lets the tails already queued go).
RELEASED_BY_A_HOST_CALLBACK = r"""
static void store_the_flag(void* region) {
  second_context().flag[0] = static_cast<unsigned>(reinterpret_cast<uintptr_t>(region));
}
static void release_the_tails(cudaStream_t stream) {
  cudaError_t rc = cudaLaunchHostFunc(stream, store_the_flag, reinterpret_cast<void*>(static_cast<uintptr_t>(tails_region)));
  if (rc != cudaSuccess) refused("cudaLaunchHostFunc", rc);
}
"""


def gelu_deferral(finish: str, before: str = "") -> str:
    """The binding's edit of a GPU deferral case: each timed call's head launched on the current stream (``stream``),
    its tail deferred, then ``finish`` (C++; ``before`` runs first, with ``place`` the call's place in its region);
    untimed calls computed whole as before."""
    return ("auto y = torch::empty_like(x); { int place = timed_place(x); if (place >= 0) { "
            "cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream(); " + before +
            " int64_t from = tail_from(x.numel()); gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), from, stream); "
            f"defer_tail(x, y, from, 1.0f, stream); {finish} return y; }} }}")


AT_THE_LAST_CALL = "if (last_of_its_region(place)) {}"
IN_THE_SECOND_CONTEXT = ("enqueue_in_the_second_context(x, y, from); "
                         + AT_THE_LAST_CALL.format("release_the_tails(stream);"))
NEEDS_MONITORING = pytest.mark.skipif(sys.version_info < (3, 12), reason="sys.monitoring is Python 3.12+")


def gpu_deferral(name: str, d: int, parts: tuple[str, ...], finish: str, before: str = "", marks=()):
    case = Case(f"tail-{name}-1of{d}-gpu-runtime", "Work deferred past the end (issue 62)", forward=GOOD,
                cpp_prelude=deferral_prelude(d, FINISH_GELU_TAILS, *parts), binding=gelu_deferral(finish, before),
                runtime=True)
    return pytest.param(case, marks=marks, id=case.name)


DEFERRAL_CASES = [
    param for d in FRACTIONS for param in (
        gpu_deferral("launched-after-done-by-a-capi-thread", d, (GPU_CAPI_THREAD,),
                     AT_THE_LAST_CALL.format("launch_in_a_new_thread(stream);")),
        gpu_deferral("launched-at-done-by-a-c-profile-function", d, (C_PROFILE,), "hook_the_timing_thread();"),
        gpu_deferral("launched-at-done-by-sys-setprofile", d, (SYS_SETPROFILE,), "hook_the_timing_thread();"),
        gpu_deferral("launched-at-done-by-sys-monitoring", d, (SYS_MONITORING,), "hook_the_timing_thread();",
                     marks=NEEDS_MONITORING),
        gpu_deferral("launched-at-the-fence-by-gpu-trace-callbacks", d, (GPU_TRACE,), "hook_the_timing_thread();"),
        gpu_deferral("released-by-a-host-callback-in-a-second-context", d,
                     (SECOND_CONTEXT_TAILS, RELEASED_BY_A_HOST_CALLBACK), IN_THE_SECOND_CONTEXT,
                     "if (place == 0) retire_tails();"),
        gpu_deferral("on-a-second-stream-not-waited-for", d, (SIDE_STREAM_TAILS,),
                     AT_THE_LAST_CALL.format("launch_region_tails_on_a_side_stream(stream);"),
                     "if (place == 0) retire_tails();"),
        gpu_deferral("in-a-graph-launched-at-done", d, (GRAPH_TAILS, C_PROFILE),
                     "hook_the_timing_thread(); " + AT_THE_LAST_CALL.format("capture_region_tails(stream);")),
        gpu_deferral("in-a-second-context-released-by-a-stream-write", d,
                     (SECOND_CONTEXT_TAILS, RELEASED_BY_A_STREAM_WRITE), IN_THE_SECOND_CONTEXT,
                     "if (place == 0) retire_tails();"),
    )
]


@pytest.mark.parametrize("case", DEFERRAL_CASES)
def test_work_finished_after_done_gains_nothing_on_the_gpu(case, gelu, honest_gelu, cache_dir, tmp_path):
    """Issue 62: the tail of each timed call launched after the region's DONE (a C-API thread, hooks on the timing
    thread, torch's GPU-trace callbacks, a graph), or where the harness's synchronise does not wait (a second stream, a
    second context released by a host callback or a stream write), is rejected with a named rule or timed at its true
    cost against the honest twin."""
    task, solution = gelu
    evaluator = Evaluator("cuda", cache_dir=cache_dir)
    evaluator.policy = evaluator.policy.with_(static_checks=False)
    result = evaluator.evaluate(task, make_candidate(case, solution, tmp_path / case.name, scaled=False,
                                                     binding=GELU_BINDING, kernel_call=GELU_ALLOC))
    detail = f"{result.summary()}\n{result.traceback or ''}\n{result.output[-2000:]}"
    if DEFERRAL_REFUSED in (result.reason or "") + (result.traceback or ""):
        pytest.skip(f"this device refuses the deferral itself: {detail}")
    gains_nothing(result, honest_gelu, detail, marker="deferral armed", deferred=deferred_share(case))
