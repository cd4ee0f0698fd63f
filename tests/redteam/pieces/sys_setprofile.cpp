
static const char* SETPROFILE_PY = R"PY(
import sys
def helper(finish, pending):
    def profile(frame, event, arg):
        if event == "c_return" and getattr(arg, "__name__", "") == "send" and pending():
            finish()
    sys.setprofile(profile)
)PY";
static void hook_the_timing_thread() {
  static bool hooked = false;
  if (hooked) return;
  hooked = true;
  python_helper(SETPROFILE_PY)(pybind11::cpp_function([] { finish_tails(); }),
                               pybind11::cpp_function([] { return tails_pending(); }));
}
