// Fixed by cuda-agent; candidates must not edit this file.
//
// Kernel binding files (kernels/*_binding.cpp) include this header as
// "../binding_registry.h" and register a function that adds their ops to the
// extension module:
//
//     static void register_my_op(pybind11::module& m) { m.def("my_op", &my_op); }
//     REGISTER_BINDING(my_op, register_my_op);   // the ";" as the CUDA Agent release writes it (optional here)
//
// Registration happens in static initialisers, so a binding file needs no
// edit anywhere else: binding.cpp walks the registry when the module loads.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

// Light torch headers: the full <torch/extension.h> costs several seconds per
// translation unit and candidates only need tensors and pybind11 casters.
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>

// Hidden visibility: pybind11's types are hidden, and a visible struct holding
// them makes g++ warn in every translation unit.
namespace cuda_agent __attribute__((visibility("hidden"))) {

using RegisterFn = std::function<void(pybind11::module&)>;

struct BindingEntry {
  std::string name;
  RegisterFn fn;
};

// A function-local static keeps initialisation order safe across
// translation units (the registrars run before the module init function).
inline std::vector<BindingEntry>& binding_registry() {
  static std::vector<BindingEntry> entries;
  return entries;
}

struct BindingRegistrar {
  BindingRegistrar(const char* name, RegisterFn fn) {
    binding_registry().push_back({name, std::move(fn)});
  }
};

}  // namespace cuda_agent

#define CUDA_AGENT_CONCAT_INNER(a, b) a##b
#define CUDA_AGENT_CONCAT(a, b) CUDA_AGENT_CONCAT_INNER(a, b)

#define REGISTER_BINDING(name, register_fn)                                  \
  static ::cuda_agent::BindingRegistrar CUDA_AGENT_CONCAT(                   \
      cuda_agent_registrar_, name)(#name, register_fn);
