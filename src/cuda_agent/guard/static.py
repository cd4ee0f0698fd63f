"""Static policy checks over a candidate's sources, before anything is built or run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cuda_agent.guard import names as N
from cuda_agent.guard.cxxcheck import check_cxx, declared_functions
from cuda_agent.guard.policy import CodePolicy, Violation, sorted_unique
from cuda_agent.guard.pycheck import check_python

if TYPE_CHECKING:
    from cuda_agent.candidates import Candidate, Extension

NATIVE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".h", ".hpp", ".inl")
# Flags a kernel plausibly needs; anything else is reported (an allowlist, since
# flags can define macros, force includes or rewrite symbols at link time).
_FLAG_PREFIXES = (
    "-O", "-std=", "--std=", "-use_fast_math", "--use_fast_math", "-ffast-math", "-funroll-loops", "-march=",
    "-mtune=", "-lineinfo", "--generate-line-info", "-g", "-maxrregcount", "--maxrregcount", "-Xptxas",
    "--ptxas-options", "-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code", "--expt-relaxed-constexpr",
    "--expt-extended-lambda", "--extended-lambda", "-U", "-w", "-fno-strict-aliasing", "-fPIC", "-DNDEBUG",
    "-ftz", "--ftz", "-prec-div", "--prec-div", "-prec-sqrt", "--prec-sqrt", "-fmad", "--fmad", "-fopenmp-simd",
    "-v", "--resource-usage", "-Xnvlink",
)


def check_model_new(source: str, filename: str = "model_new.py", policy: CodePolicy = CodePolicy(),
                    triton: bool = False) -> list[Violation]:
    """Policy violations in a candidate's Python file (see ``RULES``); ``triton`` for a Triton candidate's."""
    return sorted_unique(check_python(source, filename, policy, triton))


def check_native_source(source: str, filename: str, policy: CodePolicy = CodePolicy()) -> list[Violation]:
    """Policy violations in one C++/CUDA source file (see ``RULES``)."""
    return sorted_unique(check_cxx(source, filename, policy))


def check_candidate(candidate: Candidate, policy: CodePolicy = CodePolicy()) -> list[Violation]:
    """Every static check over a candidate: model_new, each extension's own sources
    (not the project's fixed binding files) and the flags it asks the compiler for.

    Inline (``load_inline``) candidates carry their recovered sources as extensions,
    so they are scanned the same way; their file names are ``<module>/main.cpp`` and
    ``<module>/cuda.cu``, lines counted in those generated files.
    """
    model_name = "model_new.py" if candidate.kind == "workspace" else candidate.origin.rsplit("/", 1)[-1]
    found = check_python(candidate.model_new, model_name, policy, triton=candidate.language == "triton")
    for extension in candidate.extensions:
        sources = _own_sources(extension)
        # Functions one file declares may be called unqualified from another.
        declared = frozenset(name for text in sources.values() for name in declared_functions(text))
        for rel, text in sorted(sources.items()):
            found += check_cxx(text, rel, policy, declared)
        found += check_flags(extension, policy)
    return sorted_unique(found)


def _own_sources(extension: Extension) -> dict[str, str]:
    from cuda_agent.candidates import fixed_file
    from cuda_agent.candidates.candidate import FIXED_FILES

    own = {}
    for rel, text in extension.sources.items():
        if rel in FIXED_FILES and text == fixed_file(rel):
            continue  # ours, and identical to ours
        if rel.endswith(NATIVE_SUFFIXES):
            own[rel] = text
    return own


def check_flags(extension: Extension, policy: CodePolicy = CodePolicy()) -> list[Violation]:
    """Compiler and linker flags a candidate asked for (load_inline's extra_*flags)."""
    found: list[Violation] = []
    where = f"{extension.name} (build flags)"
    for kind, flags in (("cflags", extension.cflags), ("cuda_cflags", extension.cuda_cflags), ("ldflags", extension.ldflags)):
        for flag in _split_forwarded(flags):
            problem = _flag_problem(flag, policy)
            if problem:
                found.append(Violation(problem[0], where, None, f"{kind} `{flag}`: {problem[1]}"))
    return found


def _split_forwarded(flags: tuple[str, ...]) -> list[str]:
    """Flags with nvcc's -Xcompiler/-Xlinker values unpacked (they are flags too)."""
    out: list[str] = []
    forward = False
    for flag in flags:
        flag = flag.strip()
        if not flag:
            continue
        if forward:
            out += [f for f in flag.split(",") if f]
            forward = False
        elif flag in ("-Xcompiler", "--compiler-options", "-Xlinker", "--linker-options"):
            forward = True
            if flag in ("-Xlinker", "--linker-options"):
                out.append("-Wl,")  # anything passed to the linker is a link trick
        elif flag.startswith(("-Xcompiler=", "--compiler-options=")):
            out += [f for f in flag.split("=", 1)[1].split(",") if f]
        else:
            out.append(flag)
    return out


def _flag_problem(flag: str, policy: CodePolicy) -> tuple[str, str] | None:
    if flag in ("-fopenmp", "-openmp", "-pthread", "-lpthread", "-lgomp", "-liomp5") or flag.startswith("-fopenmp="):
        return ("thread", "starts threads")
    if flag.startswith(("--default-stream", "-default-stream")):
        return ("stream", "changes which stream kernels run on")
    if flag.startswith("-l"):
        family = N.library_family(flag[2:].removeprefix(":lib"))
        if family and family in policy.libraries:
            return None
        if family:
            return ("library", f"{family} is not an allowed library")
        return ("build-flag", "links a library a kernel does not need")
    if flag.startswith("-D"):
        return _define_problem(flag[2:], policy)
    if flag.startswith(_FLAG_PREFIXES):
        return None
    return ("build-flag", "not a flag a kernel needs (macros, includes and link options are the build's)")


def _define_problem(define: str, policy: CodePolicy) -> tuple[str, str] | None:
    name, _, value = define.partition("=")
    if not value:
        return None
    inner = check_cxx(value, "flag", policy)
    if inner or "##" in value:
        return ("token-paste", f"defines {name} as forbidden code ({inner[0].message if inner else '##'})")
    return None
