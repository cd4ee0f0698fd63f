// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale);

#define TAIL_DENOMINATOR 8

// The deferral machinery every tail-after-done case shares (pieces/deferred_tails.cpp, written beside this
// file by the suite: case.toml's [headers]).
#include "deferred_tails.h"

extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale);
static bool tails_pending() { std::lock_guard<std::mutex> g(tails_lock); return !tails.empty(); }
static void finish_tails() {
  for (auto& t : take_tails())
    scaled_swish_launch(t.x.data_ptr<float>() + t.from, t.y.data_ptr<float>() + t.from, t.x.numel() - t.from, t.scale);
}

#include <Python.h>
static int tails_profile(PyObject*, PyFrameObject*, int what, PyObject* arg) {
  if (what != PyTrace_C_RETURN || arg == nullptr || !PyCFunction_Check(arg)) return 0;
  if (std::strcmp(reinterpret_cast<PyCFunctionObject*>(arg)->m_ml->ml_name, "send") != 0) return 0;
  if (tails_pending()) finish_tails();
  return 0;
}
static void hook_the_timing_thread() {
  static bool hooked = false;
  if (!hooked) { hooked = true; PyEval_SetProfile(tails_profile, nullptr); }
}

static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scaled_swish: expected float32 input");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc); { int place = timed_place(xc); if (place >= 0) { float s = static_cast<float>(scale); int64_t from = tail_from(xc.numel()); scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), from, s); defer_tail(xc, y, from, s, nullptr); hook_the_timing_thread(); return y; } }
  scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(),
                      static_cast<float>(scale));
  return y;
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "scale * x * sigmoid(x)");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish);
