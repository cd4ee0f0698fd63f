
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
