
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
