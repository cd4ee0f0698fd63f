// Fixed by cuda-agent; candidates must not edit this file.
// The extension module: every op registered with REGISTER_BINDING is added here.
#include "binding_registry.h"

PYBIND11_MODULE(cuda_extension, m) {
  m.doc() = "cuda-agent candidate extension";
  for (auto& entry : cuda_agent::binding_registry()) {
    entry.fn(m);
  }
}
