"""Symbol audit: what a built extension (``.so``) or object (``.o``) imports and defines.

The compiler has expanded every macro, resolved every overload and instantiated
every template by then, so a call the source scan could not see (a macro
building ``at::matmul``, ADL, a header wrapper) is an undefined symbol here:
``at::_ops::matmul::call`` or ``cublasSgemm_v2``. Inline tensor methods compile
to ``at::_ops::<op>::call`` too, which is what makes ATen compute visible.

What pybind11, torch's light headers and the project's fixed binding.cpp import
(Python C-API, c10 checks, ``at::_ops::empty_like::call``, ``data_ptr<T>``)
is allowed; the tests build the CPU example to keep it so. So are the stream
functions c10's ``CUDAGuardImpl`` vtable references (``getStreamFromPool``,
``setCurrentCUDAStream``): any use of ``CUDAGuard`` emits that vtable, so their
import says nothing about the candidate; the source scan checks its own calls.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from cuda_agent.guard import names as N
from cuda_agent.guard.policy import CodePolicy, Violation, sorted_unique

NM_TIMEOUT_S = 120
_NM_LINE = re.compile(r"^\s*(?:[0-9a-fA-F]+\s+)?([A-Za-z?-])\s+(.+)$")
_SPECIAL_PREFIXES = (
    "vtable for ", "typeinfo for ", "typeinfo name for ", "VTT for ", "construction vtable for ",
    "guard variable for ", "non-virtual thunk to ", "virtual thunk to ", "covariant return thunk to ",
    "TLS init function for ", "TLS wrapper function for ",
)
_OPERATOR = re.compile(r"operator\s*(?:\(\)|\[\]|<<=|>>=|<<|>>|<=>|<=|>=|->\*|->|<|>|[^\s(]+)")
_DRIVER_VERSION = re.compile(r"_v\d+$")
# Runtime entry points a candidate must not define: its copy would shadow the
# real one for whoever resolves the name through it (timers, allocation, loading).
_SHADOWED_C_NAMES = frozenset(
    {"clock_gettime", "gettimeofday", "time", "clock", "timespec_get", "nanosleep", "usleep", "sleep", "malloc",
     "free", "calloc", "realloc", "memcpy", "memset", "dlopen", "dlsym", "pthread_create", "fork", "syscall",
     "open", "fopen"}
)
_PROTECTED_NAMESPACES = frozenset({"at", "c10", "torch", "caffe2"})
_STRONG_DEFINITIONS = frozenset("TDBRG")


class SymbolAuditError(RuntimeError):
    """The audit could not read a file's symbols (no nm, not an object file)."""


def _nm() -> str:
    nm = shutil.which("nm")
    if nm is None:
        raise SymbolAuditError(
            "the symbol audit needs `nm` from GNU binutils; install binutils (Debian/Ubuntu: apt-get install binutils)."
        )
    return nm


def imported_symbols(paths: Sequence[Path]) -> frozenset[str]:
    """Every symbol the objects import (demangled, without version suffixes)."""
    nm = _nm()
    return frozenset(_plain(name) for path in map(Path, paths)
                     for _kind, name in _read_symbols(nm, path, _dynamic(path), undefined=True))


def defined_symbols(path: Path) -> list[str]:
    """Every symbol the object's full (static) symbol table defines, demangled: local
    ones too, such as the host stubs nvcc writes for each kernel."""
    return [name for _kind, name in _read_symbols(_nm(), Path(path), dynamic=False, undefined=False)]


def audit_symbols(paths: Sequence[Path], policy: CodePolicy = CodePolicy(),
                  allowed: frozenset[str] = frozenset()) -> list[Violation]:
    """Policy violations visible in the symbol tables of built objects. Imports in
    ``allowed`` (what a minimal extension from the same toolchain imports, see
    ``build.probe``) come from torch and the toolchain, not the candidate."""
    nm = _nm()
    found: list[Violation] = []
    for path in map(Path, paths):
        dynamic = _dynamic(path)
        for _kind, name in _read_symbols(nm, path, dynamic, undefined=True):
            if _plain(name) in allowed:
                continue
            verdict = classify_import(name, policy)
            if verdict:
                found.append(Violation(verdict[0], path.name, None, f"imports `{_short(name)}`: {verdict[1]}"))
        for kind, name in _read_symbols(nm, path, dynamic, undefined=False):
            verdict = classify_definition(kind, name, policy)
            if verdict:
                found.append(Violation(verdict[0], path.name, None, f"defines `{_short(name)}`: {verdict[1]}"))
    return sorted_unique(found)


def _dynamic(path: Path) -> bool:
    return path.suffix not in (".o", ".a")


def _plain(name: str) -> str:
    return name.split("@")[0].strip()


def _read_symbols(nm: str, path: Path, dynamic: bool, undefined: bool) -> list[tuple[str, str]]:
    argv = [nm, "-C", "--undefined-only" if undefined else "--defined-only"]
    if dynamic:
        argv.append("-D")
    try:
        proc = subprocess.run([*argv, str(path)], capture_output=True, text=True, timeout=NM_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise SymbolAuditError(f"nm timed out on {path}") from None
    if proc.returncode != 0:
        raise SymbolAuditError(f"nm could not read {path}: {proc.stderr.strip() or proc.stdout.strip()}")
    symbols = []
    for line in proc.stdout.splitlines():
        match = _NM_LINE.match(line)
        if match:
            symbols.append((match.group(1), match.group(2).strip()))
    return symbols


# -- classification -----------------------------------------------------------------------


def classify_import(name: str, policy: CodePolicy = CodePolicy()) -> tuple[str, str] | None:
    """(rule, reason) for an undefined symbol a candidate's object may not import, else None."""
    plain = name.split("@")[0].strip()
    if _is_c_name(plain):
        return _classify_c(plain, policy)
    segments = qualified_segments(plain)
    if not segments:
        return None
    root, rest = segments[0], segments[1:]
    if root == "at" and rest:
        return _classify_aten(rest, policy)
    if root == "c10" and ("Dispatcher" in segments or "OperatorHandle" in segments):
        return ("aten-compute", "calls ATen ops by name through the dispatcher")
    if root == "torch" and rest and rest[0] in ("jit", "nn"):
        return ("aten-compute", f"torch::{rest[0]} runs torch code")
    if root == "std" and rest and rest[0] in ("thread", "jthread") and segments[-1] != "hardware_concurrency":
        return ("thread", "starts a thread")
    if root == "std" and rest and rest[0] in ("basic_ofstream", "basic_ifstream", "basic_fstream", "basic_filebuf"):
        return ("syscall", "reads or writes files")
    return None


def _classify_c(symbol: str, policy: CodePolicy) -> tuple[str, str] | None:
    family = N.library_family(symbol)
    if family:
        return None if family in policy.libraries else ("library", f"{family} is not an allowed library")
    base = _DRIVER_VERSION.sub("", symbol)
    rule = N.SYMBOL_RULES.get(base) or N.SYMBOL_RULES.get(symbol)
    if rule == "stream":
        return _stream(policy, "puts work on a stream other than the current one")
    if rule:
        return (rule, _REASONS[rule])
    if symbol.endswith(("_ptsz", "_ptds")):
        return _stream(policy, "uses the per-thread default stream")
    if symbol.startswith(("PyRun_", "PyImport_")):
        return ("dynamic-access", _REASONS["dynamic-access"])
    if symbol.startswith(("GOMP_", "__kmpc_", "omp_")):
        return ("thread", _REASONS["thread"])
    if symbol.startswith(("cuModuleLoad", "cuLibraryLoad")):
        return ("native-load", _REASONS["native-load"])
    return None


def _classify_aten(rest: list[str], policy: CodePolicy) -> tuple[str, str] | None:
    head, name = rest[0], rest[-1]
    allowed = policy.allowed_aten
    if head == "_ops" and len(rest) > 1:
        op = N.aten_op_structs().get(rest[1], rest[1])
        return None if N.op_allowed(op, allowed) else ("aten-compute", f"the ATen op {op}")
    if head == "native":
        return ("aten-compute", "ATen's own kernels")
    if head in ("Tensor", "TensorBase") and len(rest) > 1:
        method = rest[1].removeprefix("__dispatch_")
        compute = (N.tensor_methods() & N.aten_op_names()) - N.ALLOWED_OPS
        return ("aten-compute", f"the ATen op {method}") if method in compute and method not in allowed else None
    if head == "cuda" and len(rest) > 1 and rest[1] == "blas":
        return ("aten-compute", "ATen's BLAS wrappers")
    if name in N.ATEN_LIBRARY_HANDLES:
        family = N.ATEN_LIBRARY_HANDLES[name]
        return None if family in policy.libraries else ("library", f"{family} is not an allowed library")
    if name in N.ATEN_THREAD_NAMES or head == "internal":
        return ("thread", "runs work on ATen's thread pool")
    if head.startswith("TensorIterator"):
        return ("aten-compute", "ATen's elementwise machinery")
    if len(rest) == 1 or head in N.ATEN_BACKEND_NAMESPACES:
        base = N.op_base(name)
        if base in N.aten_op_names() and not N.op_allowed(base, allowed):
            return ("aten-compute", f"the ATen op {base}")
    return None


def classify_definition(kind: str, name: str, policy: CodePolicy = CodePolicy()) -> tuple[str, str] | None:
    """(rule, reason) for a symbol a candidate's object may not define, else None."""
    plain = name.split("@")[0].strip()
    if _is_c_name(plain):
        family = N.library_family(plain)
        if family and family not in policy.libraries:
            return ("library", f"{family} code linked in statically")
        if kind in _STRONG_DEFINITIONS and _shadows_runtime(plain):
            return ("monkeypatch", "shadows the runtime's own definition")
        return None
    segments = qualified_segments(plain)
    if kind in _STRONG_DEFINITIONS and segments and segments[0] in _PROTECTED_NAMESPACES:
        return ("monkeypatch", f"a strong definition inside {segments[0]}:: shadows libtorch's")
    return None


def _shadows_runtime(symbol: str) -> bool:
    if symbol in _SHADOWED_C_NAMES:
        return True
    if symbol.startswith(("Py", "_Py")) and not symbol.startswith("PyInit_"):
        return True
    # CUDA runtime (cudaEventElapsedTime) and driver (cuLaunchKernel) API names.
    return (symbol.startswith("cuda") and symbol[4:5].isupper()) or (symbol.startswith("cu") and symbol[2:3].isupper())


def _stream(policy: CodePolicy, reason: str) -> tuple[str, str] | None:
    return None if policy.allow_streams else ("stream", reason)


def _is_c_name(name: str) -> bool:
    return "::" not in name and "(" not in name and " " not in name


def qualified_segments(demangled: str) -> list[str]:
    """``float* at::TensorBase::data_ptr<float>() const`` -> ``["at", "TensorBase", "data_ptr"]``."""
    name = demangled.split("@")[0].strip()
    for prefix in _SPECIAL_PREFIXES:
        name = name.removeprefix(prefix)
    name = name.replace("(anonymous namespace)", "anonymous")
    name = _OPERATOR.sub("operator", name)
    depth, cut = 0, len(name)
    for index, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = index
            break
    head, depth, kept = name[:cut], 0, []
    for ch in head:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    last = "".join(kept).strip().split(" ")[-1].lstrip("*&")
    return [s for s in last.split("::") if s]


def _short(name: str, limit: int = 160) -> str:
    name = name.split("@")[0]
    return name if len(name) <= limit else name[: limit - 3] + "..."


_REASONS = {
    "cache-control": "controls L2 persistence, which keeps data cached across the flush before timed calls",
    "thread": "starts threads",
    "subprocess": "runs other programs",
    "native-load": "loads native code outside the build",
    "syscall": "raw system access (files, sockets, syscalls, memory protection)",
    "dynamic-access": "runs Python code from C++",
}
