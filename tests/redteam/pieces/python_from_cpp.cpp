
#include <pybind11/eval.h>
static pybind11::object python_helper(const char* source) {
  pybind11::dict scope;
  pybind11::exec(source, scope);
  return scope["helper"];
}
