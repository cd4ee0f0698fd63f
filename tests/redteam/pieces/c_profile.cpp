
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
