"""What the red-team suites share: a case as code (``Case``, for the GPU file's cases, built on the CUDA
example), the candidate made from one, the C++ and Python pieces the GPU cases are assembled from, and the bar a
case that moves its work where its own clock cannot see it must meet (``gains_nothing``).

The CPU cases are folders (``cases/``, see its README): their files are the candidate, as written out from these
pieces; the GPU file (``test_redteam_gpu.py``) still assembles its cases here."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent import load_candidate


# The C++ binding of the example with its kernel call replaced (a separate build).
BINDING = "kernels/scaled_swish_binding.cpp"


KERNEL_CALL = "auto y = torch::empty_like(xc);"


@dataclass(frozen=True)
class Case:
    name: str
    pattern: str  # the row of docs/SECURITY.md
    forward: str = "return cuda_extension.scaled_swish(x, self.scale)"
    prelude: str = ""
    init: str = ""
    binding: str | None = None  # replaces KERNEL_CALL in the binding
    cpp_prelude: str = ""  # C++ at file scope, before the binding's functions (with binding)
    task: str | None = None  # task source; default: the example
    policy: dict = field(default_factory=dict)
    runtime: bool = False  # static checks off
    status: str = "failed"
    rule: str | None = None
    reason: str | None = None  # a substring of the reason, where the rule alone is not specific
    kernel_append: str = ""  # device code appended to the solution's kernel file (kernels/*.cu)


# The import-table (GOT) slot of SYMBOL in every loaded object, pointed at REPLACEMENT: the loader's
# link_map reached through _r_debug, the page made writable with pkey_mprotect (neither is a name the
# symbol audit knows). The extension's own slots are patched too: it keeps the real function's address,
# taken before (a GLOB_DAT load, not the patched PLT slot).
GOT_PATCH = r"""
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <cstdint>
#include <cstring>
static int patch_got(const char* symbol, void* replacement) {
  int patched = 0;
  for (link_map* m = _r_debug.r_map; m != nullptr; m = m->l_next) {
    if (m->l_ld == nullptr) continue;
    ElfW(Sym)* symtab = nullptr; const char* strtab = nullptr; ElfW(Rela)* rel = nullptr; size_t size = 0;
    for (ElfW(Dyn)* d = m->l_ld; d->d_tag != DT_NULL; ++d) {
      // The loader relocates these in place, except in objects it did not load itself (the vDSO).
      uintptr_t p = d->d_un.d_ptr < m->l_addr ? m->l_addr + d->d_un.d_ptr : d->d_un.d_ptr;
      if (d->d_tag == DT_SYMTAB) symtab = reinterpret_cast<ElfW(Sym)*>(p);
      else if (d->d_tag == DT_STRTAB) strtab = reinterpret_cast<const char*>(p);
      else if (d->d_tag == DT_JMPREL) rel = reinterpret_cast<ElfW(Rela)*>(p);
      else if (d->d_tag == DT_PLTRELSZ) size = d->d_un.d_val;
    }
    if (symtab == nullptr || strtab == nullptr || rel == nullptr) continue;
    for (size_t i = 0; i < size / sizeof(ElfW(Rela)); ++i) {
      if (std::strcmp(strtab + symtab[ELF64_R_SYM(rel[i].r_info)].st_name, symbol) != 0) continue;
      void** slot = reinterpret_cast<void**>(m->l_addr + rel[i].r_offset);
      uintptr_t page = reinterpret_cast<uintptr_t>(slot) & ~static_cast<uintptr_t>(4095);
      pkey_mprotect(reinterpret_cast<void*>(page), 4096, PROT_READ | PROT_WRITE, -1);
      *slot = replacement;
      ++patched;
    }
  }
  return patched;
}
"""


# A library function's own code rewritten (x86-64: a jump to the attacker's function) by one of three
# routes: in place after mprotect(RWX); through /proc/self/mem, which writes through page protections;
# or a patched copy of the library written to /tmp and mapped over the page. The sandbox refuses the
# first two (sandbox.nocode, a read-only /proc); the third is seen from outside (guard.integrity: the
# code mapping is another file). A route that is refused raises, naming why. TARGET_CODE() is the code
# rewritten, REPLACEMENT() where it jumps now.
CODE_REWRITE_ROUTES = r"""
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
static void jump_code(unsigned char* code) {  // movabs rax, target; jmp rax
  void* target = REPLACEMENT();
  code[0] = 0x48; code[1] = 0xB8; std::memcpy(code + 2, &target, 8); code[10] = 0xFF; code[11] = 0xE0;
}
static unsigned char* target_code() { return reinterpret_cast<unsigned char*>(TARGET_CODE()); }
static uintptr_t page_of(unsigned char* p) { return reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(4095); }
static size_t span_of(unsigned char* p) { return reinterpret_cast<uintptr_t>(p) + 12 - page_of(p) > 4096 ? 8192 : 4096; }
static void refused(const char* route) { throw std::runtime_error(std::string("code rewrite refused: ") + route + ": " + std::strerror(errno)); }
static void rewrite_in_place() {
  unsigned char* fn = target_code();
  if (mprotect(reinterpret_cast<void*>(page_of(fn)), span_of(fn), PROT_READ | PROT_WRITE | PROT_EXEC) != 0) refused("mprotect");
  jump_code(fn);
}
static void rewrite_through_proc() {
  unsigned char code[12];
  jump_code(code);
  int fd = open("/proc/self/mem", O_RDWR);
  if (fd < 0) refused("/proc/self/mem");
  if (pwrite(fd, code, 12, static_cast<off_t>(reinterpret_cast<uintptr_t>(target_code()))) != 12) refused("/proc/self/mem write");
  close(fd);
}
struct Segment { uintptr_t address; uintptr_t file_offset; bool found; };
static void rewrite_from_copy() {
  unsigned char* fn = target_code();
  Dl_info info;
  if (dladdr(fn, &info) == 0) refused("dladdr");
  Segment seg{reinterpret_cast<uintptr_t>(fn), 0, false};
  dl_iterate_phdr([](dl_phdr_info* i, size_t, void* data) -> int {
    auto* s = static_cast<Segment*>(data);
    for (int k = 0; k < i->dlpi_phnum; ++k) {
      const auto& ph = i->dlpi_phdr[k];
      uintptr_t start = i->dlpi_addr + ph.p_vaddr;
      if (ph.p_type == PT_LOAD && s->address >= start && s->address < start + ph.p_memsz) {
        s->file_offset = s->address - start + ph.p_offset; s->found = true; return 1;
      }
    }
    return 0;
  }, &seg);
  if (!seg.found) refused("dl_iterate_phdr");
  int in = open(info.dli_fname, O_RDONLY);
  if (in < 0) refused("open");
  std::string bytes;
  char chunk[1 << 16];
  for (ssize_t n; (n = read(in, chunk, sizeof chunk)) > 0;) bytes.append(chunk, static_cast<size_t>(n));
  close(in);
  jump_code(reinterpret_cast<unsigned char*>(&bytes[seg.file_offset]));
  int out = open("/tmp/patched-copy.so", O_CREAT | O_RDWR | O_TRUNC, 0700);
  if (out < 0 || write(out, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) refused("/tmp");
  void* at = mmap(reinterpret_cast<void*>(page_of(fn)), span_of(fn), PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_FIXED,
                  out, static_cast<off_t>(seg.file_offset & ~static_cast<uintptr_t>(4095)));
  close(out);
  if (at != reinterpret_cast<void*>(page_of(fn))) refused("mmap");
}
"""


# A helper thread, started inside a checked call and named like torch's own, finishes the second half
# of the output after forward returned, on calls no dispatch mode watches. The records catch the
# unfinished half only when the harness reads them before the helper is done, which a busy machine does
# not promise (a CI run once saw all 8 checked records complete); the thread itself, counted from
# outside after the checks whatever its name, is what fails it every time.
LATER = r"""
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
"""


# The same spying with the allocator left in c10's table: its object's class swapped (its vtable pointer
# pointed at a copy of its vtable with the spy's allocate), or its own vtable's allocate entry patched in
# place (the page made writable again, which the code lock allows: nothing becomes executable). The spy
# runs as the allocator itself (`this` is the framework's allocator) and passes each call on.
ALLOCATOR_CLASS = r"""
#include <c10/core/Allocator.h>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>
struct Spy final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}
};
static std::atomic<long> spied{0};
static void** spy_slot = nullptr;  // the vtable pointer or entry swapped, what it held, what it holds
static void* spy_real = nullptr;
static void* spy_fake = nullptr;
c10::DataPtr Spy::allocate(size_t n) {
  spied++;
  c10::Allocator* volatile self = this;  // not devirtualised: the real allocate for one call
  *spy_slot = spy_real;
  c10::DataPtr out = self->allocate(n);
  *spy_slot = spy_fake;
  return out;
}
static std::size_t allocate_entry() {  // Itanium ABI: a virtual member pointer holds 1 + its vtable offset
  auto member = &c10::Allocator::allocate;
  std::ptrdiff_t at;
  std::memcpy(&at, &member, sizeof at);
  return static_cast<std::size_t>(at - 1) / sizeof(void*);
}
static void* spy_allocate() { static Spy probe; return (*reinterpret_cast<void***>(&probe))[allocate_entry()]; }
static void swap_class(c10::DeviceType device) {
  if (spy_slot) return;
  auto* victim = c10::GetAllocator(device);
  void** real = *reinterpret_cast<void***>(victim);
  static void* copy[2 + 48];
  std::memcpy(copy, real - 2, sizeof copy);  // with the offset-to-top and type info before the entries
  copy[2 + allocate_entry()] = spy_allocate();
  spy_slot = reinterpret_cast<void**>(victim);
  spy_real = real;
  spy_fake = copy + 2;
  *spy_slot = spy_fake;
}
static void patch_vtable(c10::DeviceType device) {
  if (spy_slot) return;
  void** entry = *reinterpret_cast<void***>(c10::GetAllocator(device)) + allocate_entry();
  auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  mprotect(reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(entry) & ~(page - 1)), page, PROT_READ | PROT_WRITE);
  spy_slot = entry;
  spy_real = *entry;
  spy_fake = spy_allocate();
  *spy_slot = spy_fake;
}
"""


UNWATCHED = "c10::impl::TorchDispatchModeTLS::stack_len() == 0"


DISPATCH_TLS = "#include <c10/core/impl/TorchDispatchModeTLS.h>\n"


# Neither the dispatch mode nor the profiler on: what a timed call looks like from inside, told apart from
# every check (the records catch such a candidate; no in-process observer does).
UNOBSERVED = UNWATCHED + " && !torch::profiler::impl::profilerEnabled()"


# What the evaluator says of a candidate's process the kernel ended (sandbox.nothreads).
SECCOMP = "which the kernel refused (seccomp)"


# Trust v3's classes (issue 31): Python reached from the binding's C++ through the C API, with model_new.py and
# the kernel file as the example has them. Class 1, the harness's secrets: the timing loop's own frame names
# the round's last call and, where the worker records in its own process, the probe its positions come from;
# every other timed call computes a quarter of its output and those positions (with the kernel: bit for bit).
PYTHON_FROM_CPP = r"""
#include <pybind11/eval.h>
static pybind11::object python_helper(const char* source) {
  pybind11::dict scope;
  pybind11::exec(source, scope);
  return scope["helper"];
}
"""


SECRETS_FROM_THE_FRAME = PYTHON_FROM_CPP + r"""
#include <vector>
static const char* SECRETS = R"PY(
import sys
def helper(x):
    frame = sys._getframe(1)
    while frame is not None and not {"region", "msg", "last"} <= frame.f_locals.keys():
        frame = frame.f_back
    if frame is None:
        return None  # not a timed call: computed whole
    state = frame.f_locals
    index = next((i for i, inputs, _ in state["region"] if inputs and inputs[0].data_ptr() == x.data_ptr()), None)
    if index is None or index == state["last"]:
        return None
    recorder = state.get("recorder")
    if recorder is None:
        return []
    from cuda_agent.evaluate.records import OUTPUT_VALUES, positions
    return positions(recorder.probe, "output", 0, x.numel(), OUTPUT_VALUES)
)PY";
static pybind11::object secrets_helper() {
  static pybind11::object helper = python_helper(SECRETS);
  return helper;
}
"""


# Class 2 again, a method of a harness class: the candidate side's round answers with its samples scaled
# down to 30% (class 3's forged sample, below what the round-level outside clock resolves).
SCALED_SAMPLES = PYTHON_FROM_CPP + r"""
static const char* SCALE = R"PY(
import sys
def helper():
    side = next((module.CandidateSide for module in list(sys.modules.values())
                 if isinstance(getattr(module, "CandidateSide", None), type)), None)
    if side is None or getattr(side.time, "scaled", False):
        return
    real = side.time
    def time(self, msg):
        reply = real(self, msg)
        reply["samples"] = [0.3 * t for t in reply["samples"]]
        return reply
    time.scaled = True
    side.time = time
)PY";
static void scale_samples() {
  static bool done = false;
  if (!done) { done = true; python_helper(SCALE)(); }
}
"""


# Work moved before the region (docs/SECURITY.md, trust v3: between regions): the harness's input draw (a method
# of its class) swapped for one that computes each timed call's output as soon as its inputs are drawn, before
# READY; the timed call returns it and computes nothing (the checked calls compute: on a GPU a forward that ran
# none of the extension's kernels fails as `decoy`). Against inputs drawn from a seed the process was told, this
# got reward 2-3 (a 3.4-5.5x fake); their values are now written from outside once the region is about to start.
# Where they are, the harness makes the timed inputs' memory without drawing values (``side.input_memory``, a name of
# its module): that is swapped too.
AHEAD_OF_THE_REGION = r"""
static const char* AHEAD = R"PY(
import sys
import torch
ready = {}
def timed(depth):
    frame = sys._getframe(depth)
    return any(f is not None and f.f_code.co_name == "prepare" for f in (frame, frame.f_back))
def ahead(real, depth):
    def draw(*args):
        drawn = real(*args)
        if timed(depth):  # a timed call's draw: the checked ones compute
            x = drawn[0]
            ready[x.data_ptr()] = OUTPUT
        return drawn
    draw.ahead = True
    return draw
def helper():
    side = next((module.CandidateSide for module in list(sys.modules.values())
                 if isinstance(getattr(module, "CandidateSide", None), type)), None)
    if side is not None and not getattr(side.inputs, "ahead", False):
        side.inputs = ahead(side.inputs, 2)
    module = sys.modules.get("cuda_agent.evaluate.side")
    if module is not None and hasattr(module, "input_memory") and not getattr(module.input_memory, "ahead", False):
        module.input_memory = ahead(module.input_memory, 2)
    return ready
)PY";
static pybind11::dict computed_ahead() {
  static pybind11::dict ready = python_helper(AHEAD)().cast<pybind11::dict>();
  return ready;
}
"""


# The same, computed at the let-go instead: the draw method swapped to remember each timed call's input (and its
# own draw of it), and the brackets' wait for GO swapped (through the class, as any candidate can) to spin until the
# inputs hold other values (the evaluator's, written while the process was stopped after READY), then compute half
# the region's outputs before it waits: on the timing thread, after the let-go and before GO, outside the bracket.
# On the CPU backend at 042d8b5 (the CPU bound counted from GO): reward 3.0, 1.28x against eager, cpu_swish at 1024.
AT_THE_LET_GO = r"""
static const char* LET_GO = R"PY(
import sys, time
import torch
ready = {}
pending = []
def helper():
    modules = list(sys.modules.values())
    side = next((m.CandidateSide for m in modules if isinstance(getattr(m, "CandidateSide", None), type)), None)
    ringer = next((m.Ringer for m in modules if isinstance(getattr(m, "Ringer", None), type)), None)
    if side is not None and ringer is not None and not getattr(ringer.wait, "let_go", False):
        real_wait = ringer.wait
        def remembering(real):  # the harness's draw, or its memory without values (``side.input_memory``)
            def draw(*args):
                drawn = real(*args)
                frame = sys._getframe(1)
                if any(f is not None and f.f_code.co_name == "prepare" for f in (frame, frame.f_back)):
                    pending.append((drawn[0], drawn[0].view(torch.uint8).clone()))
                return drawn
            return draw
        def wait(self, what, region):
            if what == b"GO__" and pending:
                deadline = time.monotonic() + 0.5
                while all(torch.equal(x.view(torch.uint8), own) for x, own in pending) and time.monotonic() < deadline:
                    pass
                for x, _ in pending[:max(1, len(pending) // 2)]:  # half the region's calls (one of one)
                    ready[x.data_ptr()] = OUTPUT
                pending.clear()
            return real_wait(self, what, region)
        wait.let_go = True
        side.inputs, ringer.wait = remembering(side.inputs), wait
        module = sys.modules.get("cuda_agent.evaluate.side")
        if module is not None and hasattr(module, "input_memory"):
            module.input_memory = remembering(module.input_memory)
    return ready
)PY";
static pybind11::dict computed_ahead() {
  static pybind11::dict ready = python_helper(LET_GO)().cast<pybind11::dict>();
  return ready;
}
"""


# The region closed before its work is done: DONE sent by the candidate's own code as the region's last call begins
# (its calls described as the harness would, on a GPU the allocations they lie in sent after it), the harness's own
# DONE (and FDS) swapped away through the brackets' class, and the samples scaled (class 3). The brackets then end
# where the candidate said, not where its work did. On the CPU backend the work left runs on the timing thread, whose
# CPU time the evaluator reads once it sleeps again (up to ``SETTLE_S``): `clock`, by that account or by the wall
# bound (2026-11-28: with the bell's class taken from the timing loop's frame instead of a search of every module on
# each call, the wall bound fires first). On a GPU the kernels the process queued run on after it is stopped, until
# the reads from outside (tests/redteam/test_redteam_gpu.py).
EARLY_PY = r"""
import os, sys
done_sent, chunks_sent = set(), set()
def cells(fn):
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
def swap_ringer(ringer):
    # The class of the timing loop's own bell (no search of the modules, which costs the candidate its own time).
    if getattr(ringer.done, "early", False):
        return ringer
    real_done, real_chunks = ringer.done, ringer.chunks
    def done(self, region, payload=b""):
        if (id(self), region) in done_sent:
            done_sent.discard((id(self), region))
            return None
        return real_done(self, region, payload)
    def chunks(self, region, table, fds, looked_up):
        if (id(self), region) in chunks_sent:
            chunks_sent.discard((id(self), region))
            for fd in fds:
                os.close(fd)
            return None
        return real_chunks(self, region, table, fds, looked_up)
    done.early, done.real, chunks.real = True, real_done, real_chunks
    ringer.done, ringer.chunks = done, chunks
    return ringer
def calls_of_the_region():
    # The timing loop's locals and the region's calls (each one's input first in its inputs).
    frame = sys._getframe(2)
    while frame is not None and not {"bell", "after_end", "region"} <= frame.f_locals.keys():
        frame = frame.f_back
    if frame is None or frame.f_locals["bell"] is None:
        return None  # not a timed region
    state = frame.f_locals
    calls = cells(state["after_end"]).get("region")
    return (state, list(calls)) if calls else None
def last_call_of_a_region(x):
    # As above, where x is the input of the region's last call.
    found = calls_of_the_region()
    if found is None or found[1][-1][1][0].data_ptr() != x.data_ptr():
        return None  # not the region's last call
    return found
def close_region(ringer, state, calls, y):
    bell, number = state["bell"], state["region"]
    outside, regions = sys.modules["cuda_agent.evaluate.outside"], sys.modules["cuda_agent.evaluate.regions"]
    described = [outside.describe(i, box.get("output", y), inputs) for i, inputs, box in calls]
    if state.get("before_done") is not None:  # a GPU's: the allocations the region's tensors lie in, before DONE
        vmm = sys.modules["cuda_agent.evaluate.vmm"]
        table, fds, looked_up = cells(state["before_done"])["exporter"].finish(vmm.spans(described, outside.ITEMSIZE))
        ringer.chunks.real(bell, number, table, fds, looked_up)
        chunks_sent.add((id(bell), number))
    ringer.done.real(bell, number, regions.encode_calls(described))
    done_sent.add((id(bell), number))
def helper(x, y):
    found = last_call_of_a_region(x)
    if found is not None:
        close_region(swap_ringer(type(found[0]["bell"])), *found, y)
"""


def python_xy(name: str, source: str) -> str:
    """A C++ ``static void name(x, y)`` that calls the ``helper(x, y)`` the Python ``source`` defines (executed once,
    at the first call); the prelude needs PYTHON_FROM_CPP."""
    return (f'static const char* {name.upper()}_PY = R"PY({source})PY";\n'
            f"static void {name}(const torch::Tensor& x, const torch::Tensor& y) {{\n"
            f"  static pybind11::object helper = python_helper({name.upper()}_PY);\n  helper(x, y);\n}}\n")


DONE_EARLY = python_xy("done_early", EARLY_PY)


def computed_ahead(output: str) -> str:
    """The prelude of a case that computes each call's output as its input ``x`` is drawn (``output``: Python)."""
    return PYTHON_FROM_CPP + AHEAD_OF_THE_REGION.replace("OUTPUT", output)


def return_computed_ahead(x: str, allocation: str) -> str:
    """The binding's edit: the output computed ahead for the input ``x`` where there is one, else ``allocation``
    and the kernel as before."""
    return (f"{{ pybind11::object ahead = computed_ahead().attr(\"pop\")(reinterpret_cast<intptr_t>({x}.data_ptr()), "
            f"pybind11::none()); if (!ahead.is_none()) return ahead.cast<torch::Tensor>(); }} {allocation}")


# The deferral class (issue 62): work finished just after the region says it is done. Each timed call computes the
# first (1 - 1/TAIL_DENOMINATOR) of its output's elements with the example's own kernel and keeps the rest, with its
# tensors, for a finisher of each case's own to compute once the region is over; the region's calls (and this call's
# place among them) are read from the timing loop's frame as EARLY_PY reads them, so that only timed calls defer and
# every checked call is whole. The kernel, model_new.py and the outputs are the honest solution's. A case's prelude
# starts with ``#define TAIL_DENOMINATOR d`` (``deferral_prelude``). Where the timing loop's frame is not found (the
# harness renamed its locals) nothing is deferred and the case is the honest solution: ``tails_deferred`` counts.
DEFERRED_TAILS = PYTHON_FROM_CPP + r"""
#include <sys/syscall.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
static const char* TIMED_PLACE_PY = R"PY(
import sys
def helper(x):
    frame = sys._getframe(1)
    while frame is not None and not {"bell", "after_end", "region"} <= frame.f_locals.keys():
        frame = frame.f_back
    if frame is None or frame.f_locals["bell"] is None:
        return None  # not a timed call
    after_end = frame.f_locals["after_end"]
    cells = dict(zip(after_end.__code__.co_freevars, (c.cell_contents for c in after_end.__closure__ or ())))
    calls = cells.get("region") or []
    place = next((i for i, (_, inputs, _) in enumerate(calls) if inputs and inputs[0].data_ptr() == x.data_ptr()), None)
    return None if place is None else (place, len(calls))
)PY";
struct Tail { torch::Tensor x, y; int64_t from; float scale; void* stream; };
static std::mutex tails_lock;
static std::vector<Tail> tails;
static std::atomic<long> tails_deferred{0};
static int tails_region_calls = 0;  // the calls of the region the latest timed call belongs to
static pid_t tails_caller = 0;      // the harness's timing thread
static int64_t tail_from(int64_t n) { return n - n / TAIL_DENOMINATOR; }
// -1: not a timed call (computed whole); else the call's place in its region.
static int timed_place(const torch::Tensor& x) {
  static pybind11::object helper = python_helper(TIMED_PLACE_PY);
  pybind11::object found = helper(x);
  if (found.is_none()) return -1;
  auto place = found.cast<std::pair<int, int>>();
  tails_region_calls = place.second;
  tails_caller = static_cast<pid_t>(syscall(SYS_gettid));
  return place.first;
}
static bool last_of_its_region(int place) { return place + 1 == tails_region_calls; }
static void defer_tail(const torch::Tensor& x, const torch::Tensor& y, int64_t from, float scale, void* stream) {
  std::lock_guard<std::mutex> g(tails_lock);
  tails.push_back({x, y, from, scale, stream});
  if (++tails_deferred == 1) std::fprintf(stderr, "deferral armed: the last 1/%d of each timed call\n", TAIL_DENOMINATOR);
}
static std::vector<Tail> take_tails() {
  std::lock_guard<std::mutex> g(tails_lock);
  std::vector<Tail> out;
  out.swap(tails);
  return out;
}
// The timing thread asleep (its state, read twice 5 us apart): after the region's last call, that is DONE sent and
// the wait for CONT begun.
static bool caller_state_asleep() {
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/stat", static_cast<int>(tails_caller));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');
  return close == nullptr || close[1] == 0 || close[2] != 'R';
}
static void wait_for_the_caller_to_sleep() {
  for (int seen = 0; seen < 2;) {
    seen = caller_state_asleep() ? seen + 1 : 0;
    std::this_thread::sleep_for(std::chrono::microseconds(5));
  }
}
"""


def deferral_prelude(denominator: int, *parts: str) -> str:
    """The C++ prelude of a deferral case: the last 1/``denominator`` of each timed call deferred, then ``parts``."""
    return f"#define TAIL_DENOMINATOR {denominator}\n" + DEFERRED_TAILS + "".join(parts)


# Finished on the harness's own timing thread, no thread started: a C profile function (PyEval_SetProfile from the
# binding, on the thread that calls it) runs the tails when a builtin named ``send`` returns with tails pending: the
# socket send of the region's DONE (Ringer.done). On the CPU backend the tails then cost the timing thread CPU time
# after DONE, before it sleeps in the wait for CONT.
C_PROFILE = r"""
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
"""


# The same from Python: sys.setprofile (the calling thread's profile function; threading.setprofile reaches only
# threads started later, and none is), the tails run when the builtin ``send`` of DONE returns.
SYS_SETPROFILE = r"""
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
"""


# sys.monitoring (3.12+): a C_RETURN callback of a free tool id (C_RETURN comes with the CALL events), the tails run
# when the builtin ``send`` of DONE returns.
SYS_MONITORING = r"""
static const char* MONITORING_PY = R"PY(
import sys
def helper(finish, pending):
    monitoring = sys.monitoring
    tool = next(t for t in range(6) if monitoring.get_tool(t) is None)
    monitoring.use_tool_id(tool, "tails")
    def returned(code, offset, called, arg0):
        if getattr(called, "__name__", "") == "send" and pending():
            finish()
    monitoring.register_callback(tool, monitoring.events.C_RETURN, returned)
    monitoring.set_events(tool, monitoring.events.CALL)
)PY";
static void hook_the_timing_thread() {
  static bool hooked = false;
  if (hooked) return;
  hooked = true;
  python_helper(MONITORING_PY)(pybind11::cpp_function([] { finish_tails(); }),
                               pybind11::cpp_function([] { return tails_pending(); }));
}
"""


# On the tree of issue 62 (4ae5a87, 2-core host busy with other work, evaluated with TimingConfig.pressure_max=1.0 so
# that the baselines were timed at all; honest twin correct, reward 1.0, 2.878 ms), the last 1/8: the C-API thread
# `incorrect`/`timed-output` (the outside read found a tail unfinished: 1 of 16 positions); the C profile function
# **correct, reward 3.0, 2.546 ms** (0.88x the honest time: the tail's CPU time after DONE, 0.345 ms a region, under
# the CPU bound's limit of 0.366); sys.setprofile `clock` (0.383 ms over a limit of 0.351); torch's pools `thread`
# (PTThreadPool started while timed).
FRACTIONS = (2, 4, 8, 16)


def make_candidate(case: Case, solution: Path, root: Path, *, scaled: bool = True, binding: str = BINDING,
                   kernel_call: str = KERNEL_CALL):
    """The example's solution with the case's model_new.py (and binding edit); ``scaled``:
    ModelNew takes the example's ``scale`` argument."""
    shutil.copytree(solution, root)
    if case.binding is not None:
        path = root / binding
        text = path.read_text()
        assert kernel_call in text, f"{binding} no longer contains {kernel_call!r}"
        text = text.replace(kernel_call, case.binding)
        if case.cpp_prelude:
            first = text.index("static ")
            text = text[:first] + case.cpp_prelude + "\n" + text[first:]
        path.write_text(text)
    if case.kernel_append:
        kernel = sorted(root.glob("kernels/*.cu"))[0]
        kernel.write_text(kernel.read_text() + "\n" + case.kernel_append)
    indent = "        "
    init = "".join(f"{indent}{line}\n" for line in case.init.splitlines())
    (root / "model_new.py").write_text(
        "import torch\nimport torch.nn as nn\nimport cuda_extension\n" + case.prelude + "\n\n\n"
        "class ModelNew(nn.Module):\n"
        + ("    def __init__(self, scale):\n" if scaled else "    def __init__(self):\n")
        + "        super().__init__()\n"
        + ("        self.scale = scale\n" if scaled else "") + init
        + "\n    def forward(self, x):\n" + "".join(f"{indent}{line}\n" for line in case.forward.splitlines())
    )
    return load_candidate(root)


# Evaluations of one honest candidate on the CPU backend of a 2-core host differ by up to a quarter (cpu_swish 3.1-4.6
# ms a call in one run); on a GPU by about 1%. Within one evaluation the two clocks are compared too (``deferred``).
CPU_NOISE = 0.25


def deferred_share(case: Case) -> float | None:
    """The share of each timed call's work a deferral case leaves for after its region (its name's ``1of<d>``)."""
    found = re.search(r"-1of(\d+)-", case.name)
    return 1 / int(found.group(1)) if found else None


def gains_nothing(result, honest, detail: str, marker: str | None = None, noise: float = 0.02,
                  deferred: float | None = None) -> None:
    """Issue 62's bar for a case that moves its work where its own clock does not see it: rejected with a named rule, or
    correct with a reward no higher than its honest twin's and a time no faster than the honest twin's by more than the
    allowance the result states and ``noise``. ``marker``: what the case prints on its stderr once it has done what it
    tries. ``deferred``: the share of each call's work the case finishes after its region, while the harness's own
    events time the rest honestly: within the same evaluation, the evaluator's regions must then hold the whole work,
    at least what the events saw over ``1 - deferred``, less the allowance and 2% of the two clocks' own difference."""
    print(detail)
    print("regions:", json.dumps((result.timing or {}).get("regions") or {}))
    print(f"honest: {honest.status} reward {honest.reward} median "
          f"{(honest.times.get('candidate') or {}).get('median_ms')} ms")
    assert result.compiled and result.status != "error", detail
    if result.status != "correct":
        assert result.reward == -1.0 and result.rule is not None, detail
        return
    # Not the honest solution in disguise.
    assert marker is None or marker in (result.output or ""), f"the case never did what it tries ({marker!r})\n{detail}"
    assert result.reward <= honest.reward, detail
    regions = (result.timing or {}).get("regions") or {}
    allowance = regions.get("allowance")
    assert allowance is not None, f"the result states no allowance\n{detail}"
    if deferred is not None:
        whole = regions["reported_ms"] / (1 - deferred)
        assert regions["outside_ms"] >= whole * (1 - allowance) * 0.98, \
            f"regions of {regions['outside_ms']:.4f} ms hold less than the whole work ({whole:.4f} ms)\n{detail}"
    timed, fair = result.times["candidate"]["median_ms"], honest.times["candidate"]["median_ms"]
    assert timed >= fair * (1 - allowance) * (1 - noise), \
        f"{timed:.4f} ms against the honest {fair:.4f} ms, allowance {allowance}\n{detail}"
