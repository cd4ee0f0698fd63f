"""What the red-team suites share: a case as code (``Case``, for the GPU file's cases, built on the CUDA
example), the candidate made from one, the C++ and Python pieces the GPU cases are assembled from (files in
``pieces/``), and the bar a case that moves its work where its own clock cannot see it must meet
(``gains_nothing``).

The CPU cases are folders (``cases/``, see its README): their files are the candidate, as written out from these
pieces; the GPU file (``test_redteam_gpu.py``) still assembles its cases here."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cuda_agent import load_candidate

PIECES = Path(__file__).parent / "pieces"


def piece(name: str) -> str:
    """The text of one piece (``pieces/``), C++ or Python, as the cases splice it into a candidate."""
    return (PIECES / name).read_text()


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
GOT_PATCH = piece("got_patch.cpp")


# A library function's own code rewritten (x86-64: a jump to the attacker's function) by one of three
# routes: in place after mprotect(RWX); through /proc/self/mem, which writes through page protections;
# or a patched copy of the library written to /tmp and mapped over the page. The sandbox refuses the
# first two (sandbox.nocode, a read-only /proc); the third is seen from outside (guard.integrity: the
# code mapping is another file). A route that is refused raises, naming why. TARGET_CODE() is the code
# rewritten, REPLACEMENT() where it jumps now.
CODE_REWRITE_ROUTES = piece("code_rewrite_routes.cpp")


# A helper thread, started inside a checked call and named like torch's own, finishes the second half
# of the output after forward returned, on calls no dispatch mode watches. The records catch the
# unfinished half only when the harness reads them before the helper is done, which a busy machine does
# not promise (a CI run once saw all 8 checked records complete); the thread itself, counted from
# outside after the checks whatever its name, is what fails it every time.
LATER = piece("later.cpp")


# The same spying with the allocator left in c10's table: its object's class swapped (its vtable pointer
# pointed at a copy of its vtable with the spy's allocate), or its own vtable's allocate entry patched in
# place (the page made writable again, which the code lock allows: nothing becomes executable). The spy
# runs as the allocator itself (`this` is the framework's allocator) and passes each call on.
ALLOCATOR_CLASS = piece("allocator_class.cpp")


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
PYTHON_FROM_CPP = piece("python_from_cpp.cpp")


SECRETS_FROM_THE_FRAME = PYTHON_FROM_CPP + piece("secrets_from_the_frame.cpp")


# Class 2 again, a method of a harness class: the candidate side's round answers with its samples scaled
# down to 30% (class 3's forged sample, below what the round-level outside clock resolves).
SCALED_SAMPLES = PYTHON_FROM_CPP + piece("scaled_samples.cpp")


# Work moved before the region (docs/SECURITY.md, trust v3: between regions): the harness's input draw (a method
# of its class) swapped for one that computes each timed call's output as soon as its inputs are drawn, before
# READY; the timed call returns it and computes nothing (the checked calls compute: on a GPU a forward that ran
# none of the extension's kernels fails as `decoy`). Against inputs drawn from a seed the process was told, this
# got reward 2-3 (a 3.4-5.5x fake); their values are now written from outside once the region is about to start.
# Where they are, the harness makes the timed inputs' memory without drawing values (``side.input_memory``, a name of
# its module): that is swapped too.
AHEAD_OF_THE_REGION = piece("ahead_of_the_region.cpp")


# The same, computed at the let-go instead: the draw method swapped to remember each timed call's input (and its
# own draw of it), and the brackets' wait for GO swapped (through the class, as any candidate can) to spin until the
# inputs hold other values (the evaluator's, written while the process was stopped after READY), then compute half
# the region's outputs before it waits: on the timing thread, after the let-go and before GO, outside the bracket.
# On the CPU backend at 042d8b5 (the CPU bound counted from GO): reward 3.0, 1.28x against eager, cpu_swish at 1024.
AT_THE_LET_GO = piece("at_the_let_go.cpp")


# The region closed before its work is done: DONE sent by the candidate's own code as the region's last call begins
# (its calls described as the harness would, on a GPU the allocations they lie in sent after it), the harness's own
# DONE (and FDS) swapped away through the brackets' class, and the samples scaled (class 3). The brackets then end
# where the candidate said, not where its work did. On the CPU backend the work left runs on the timing thread, whose
# CPU time the evaluator reads once it sleeps again (up to ``SETTLE_S``): `clock`, by that account or by the wall
# bound (2026-11-28: with the bell's class taken from the timing loop's frame instead of a search of every module on
# each call, the wall bound fires first). On a GPU the kernels the process queued run on after it is stopped, until
# the reads from outside (tests/redteam/test_redteam_gpu.py).
EARLY_PY = piece("early_py.py")


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
DEFERRED_TAILS = PYTHON_FROM_CPP + piece("deferred_tails.cpp")


def deferral_prelude(denominator: int, *parts: str) -> str:
    """The C++ prelude of a deferral case: the last 1/``denominator`` of each timed call deferred, then ``parts``."""
    return f"#define TAIL_DENOMINATOR {denominator}\n" + DEFERRED_TAILS + "".join(parts)


# Finished on the harness's own timing thread, no thread started: a C profile function (PyEval_SetProfile from the
# binding, on the thread that calls it) runs the tails when a builtin named ``send`` returns with tails pending: the
# socket send of the region's DONE (Ringer.done). On the CPU backend the tails then cost the timing thread CPU time
# after DONE, before it sleeps in the wait for CONT.
C_PROFILE = piece("c_profile.cpp")


# The same from Python: sys.setprofile (the calling thread's profile function; threading.setprofile reaches only
# threads started later, and none is), the tails run when the builtin ``send`` of DONE returns.
SYS_SETPROFILE = piece("sys_setprofile.cpp")


# sys.monitoring (3.12+): a C_RETURN callback of a free tool id (C_RETURN comes with the CALL events), the tails run
# when the builtin ``send`` of DONE returns.
SYS_MONITORING = piece("sys_monitoring.cpp")


# On the tree of issue 62 (4ae5a87, 2-core host busy with other work, evaluated with TimingConfig.pressure_max=1.0 so
# that the baselines were timed at all; honest twin correct, reward 1.0, 2.878 ms), the last 1/8: the C-API thread
# `incorrect`/`timed-output` (the outside read found a tail unfinished: 1 of 16 positions); the C profile function
# **correct, reward 3.0, 2.546 ms** (0.88x the honest time: the tail's CPU time after DONE, 0.345 ms a region, under
# the CPU bound's limit of 0.366); sys.setprofile `clock` (0.383 ms over a limit of 0.351); torch's pools `thread`
# (PTThreadPool started while timed).
FRACTIONS = (2, 4, 8, 16)
# The line of a deferral case's binding that sets its fraction (a CPU case folder holds it once, set per case).
TAIL_DEFINE = re.compile(r"^#define TAIL_DENOMINATOR \d+$", re.M)


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
