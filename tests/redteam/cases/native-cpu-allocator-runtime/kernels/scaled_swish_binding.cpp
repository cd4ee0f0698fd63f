// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale);


#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <cstring>
struct Spy final : c10::Allocator {
  c10::Allocator* inner = nullptr;
  std::atomic<long> seen{0};
  c10::DataPtr allocate(size_t n) override { seen++; return inner->allocate(n); }
  c10::DeleterFnPtr raw_deleter() const override { return inner->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
static void install_spy() {
  static Spy spy;
  if (spy.inner) return;
  spy.inner = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&spy, 255);
}

static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scaled_swish: expected float32 input");
  auto xc = x.contiguous();
  install_spy(); auto y = torch::empty_like(xc);
  scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(),
                      static_cast<float>(scale));
  return y;
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "scale * x * sigmoid(x)");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish);
