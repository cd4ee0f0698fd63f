"""Name tables shared by the Python check, the C++ scan and the symbol audit.

The lists of torch compute names are read from the installed torch at first use
(the ATen operator registry and ``torch.Tensor``), so they follow the torch
version that builds and runs the candidate.
"""

from __future__ import annotations

import inspect
from functools import cache

# -- allowed torch/ATen names ---------------------------------------------------

# Creating an output is the one thing forward and the bindings must do with torch.
ALLOCATION_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "zeros", "zeros_like",
     "new_empty", "new_zeros", "new_empty_strided"}
)
# Views and layout: no arithmetic. `contiguous`/`reshape` may copy, which the
# paper's skill allows (bindings call x.contiguous() before taking pointers).
VIEW_OPS = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "_reshape_alias", "_unsafe_view", "contiguous",
     "flatten", "unflatten", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand",
     "expand_as", "narrow", "select", "slice", "as_strided", "alias", "detach", "unbind", "split",
     "split_with_sizes", "chunk", "tensor_split", "lift_fresh"}
)
# Shape, dtype, device and pointer queries.
METADATA_NAMES = frozenset(
    {"size", "sizes", "sym_size", "sym_sizes", "stride", "strides", "sym_stride", "sym_strides",
     "numel", "sym_numel", "nelement", "dim", "ndimension", "dim_order", "storage_offset",
     "sym_storage_offset", "is_contiguous", "is_non_overlapping_and_dense", "suggest_memory_format",
     "data_ptr", "mutable_data_ptr", "const_data_ptr", "element_size", "itemsize", "nbytes",
     "get_device", "is_floating_point", "is_complex", "is_conj", "is_neg", "is_signed",
     "is_pinned", "is_shared", "is_set_to", "is_inference", "has_names", "requires_grad_",
     "dtype", "scalar_type", "device", "options", "layout", "is_cuda", "is_cpu", "defined",
     "has_storage", "use_count", "is_same", "is_same_size"}
)
ALLOWED_OPS = ALLOCATION_OPS | VIEW_OPS | METADATA_NAMES

# torch functions forward may call (full dotted paths, after aliases are resolved).
TORCH_ALLOWED_CALLS = frozenset(
    {"torch.empty", "torch.empty_like", "torch.empty_strided", "torch.zeros", "torch.zeros_like",
     "torch.no_grad", "torch.inference_mode", "torch.Size", "torch.device", "torch.is_tensor",
     "torch.is_grad_enabled", "torch.get_default_dtype", "torch.finfo", "torch.iinfo",
     "torch.cuda.current_device", "torch.cuda.current_stream", "torch.cuda.is_available",
     "torch.cuda.device", "torch.cuda.device_count", "torch.cuda.get_device_properties",
     "torch.cuda.get_device_capability", "torch.utils.cpp_extension.load_inline"}
)

# -- Python modules -------------------------------------------------------------

WORKSPACE_EXTENSION = "cuda_extension"
# Everything a candidate's model_new.py plausibly needs; any other import is
# reported (the list is short on purpose: an allowlist has no bypass by omission).
ALLOWED_IMPORT_ROOTS = frozenset(
    {"torch", "math", "typing", "typing_extensions", "__future__", "dataclasses", "functools",
     "itertools", "collections", "numbers", "enum", "abc", "warnings", "os", WORKSPACE_EXTENSION}
)
# Denied modules with a more specific rule than forbidden-import.
IMPORT_RULES: dict[str, str] = {
    **dict.fromkeys(("threading", "_thread", "multiprocessing", "concurrent", "asyncio", "sched"), "thread"),
    **dict.fromkeys(("subprocess", "pty", "pexpect"), "subprocess"),
    **dict.fromkeys(("ctypes", "_ctypes", "cffi"), "ctypes"),
    **dict.fromkeys(("sys", "gc", "inspect", "traceback", "tracemalloc", "_testcapi"), "frame-access"),
    **dict.fromkeys(("importlib", "builtins", "__builtin__", "imp", "runpy", "code", "codeop", "types",
                     "operator", "zipimport", "pkgutil"), "dynamic-access"),
}
# `os` is allowed for paths and reading the environment only.
OS_ALLOWED = frozenset({"os", "os.path", "os.environ", "os.environ.get", "os.getenv", "os.sep", "os.linesep"})
OS_SUBPROCESS = frozenset(
    {"system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
     "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnvp",
     "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "_exit", "startfile"}
)

# Builtins that run or reach code by name.
DYNAMIC_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "globals", "locals", "vars", "breakpoint"})
ATTRIBUTE_BUILTINS = frozenset({"getattr", "setattr", "delattr", "hasattr"})
FILE_BUILTINS = frozenset({"open"})
# Dunders a candidate legitimately touches (super().__init__(), __name__ checks).
ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__doc__", "__version__", "__all__", "__future__"})
FRAME_ATTRIBUTES = frozenset(
    {"f_back", "f_locals", "f_globals", "f_builtins", "f_code", "tb_frame", "tb_next", "gi_frame",
     "cr_frame", "ag_frame", "gi_code", "_getframe", "currentframe", "get_referrers", "get_referents",
     "get_objects"}
)

# torch paths by rule (a path matches an entry or anything under it).
TORCH_PATH_RULES: dict[str, str] = {
    **dict.fromkeys(
        ("torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.set_stream", "torch.cuda.ExternalStream",
         "torch.cuda.StreamContext", "torch.cuda.streams", "torch.Stream", "torch.cuda.graph",
         "torch.cuda.graphs", "torch.cuda.CUDAGraph", "torch.cuda.make_graphed_callables"),
        "stream",
    ),
    **dict.fromkeys(("torch.multiprocessing", "torch.jit.fork", "torch.jit.wait", "torch.futures"), "thread"),
    **dict.fromkeys(
        ("torch.ops.load_library", "torch.classes.load_library", "torch.utils.cpp_extension.load",
         "torch.cuda.jiterator"),
        "native-load",
    ),
    **dict.fromkeys(
        ("torch.library", "torch.backends", "torch.nn.modules.module.register_module", "torch.manual_seed",
         "torch.seed", "torch.random", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "torch.cuda.seed",
         "torch.cuda.seed_all"),
        "monkeypatch",
    ),
    **dict.fromkeys(
        ("torch.load", "torch.save", "torch.from_file", "torch.hub", "torch.utils.model_zoo", "torch.serialization"),
        "syscall",
    ),
    **dict.fromkeys(("torch.overrides", "torch.utils._python_dispatch"), "tensor-subclass"),
}

# -- C/C++ names ------------------------------------------------------------------

# Library families: policy.libraries names the family (the key).
LIBRARY_PREFIXES: dict[str, str] = {
    "cublaslt": "cublas", "cublas": "cublas", "cudnn": "cudnn", "cufft": "cufft", "curand": "curand",
    "cusparse": "cusparse", "cusolver": "cusolver", "cutensor": "cutensor", "nccl": "nccl",
    "nvrtc": "nvrtc", "nvjitlink": "nvjitlink", "cufile": "cufile", "nvshmem": "nvshmem",
}
# ATen handles onto vendor libraries.
ATEN_LIBRARY_HANDLES: dict[str, str] = {
    "getCurrentCUDABlasHandle": "cublas", "getCurrentCUDABlasLtHandle": "cublas",
    "getCurrentCUDASparseHandle": "cusparse", "getCurrentCUDASolverDnHandle": "cusolver",
    "getCudnnHandle": "cudnn",
}
# L2 persistence: lines marked persisting survive the flush buffer written before
# every timed call, so the candidate would be timed with a warm cache. (Also
# cudaDeviceSetLimit's stack/heap/printf limits: no kernel here needs them.)
CACHE_CONTROL_SYMBOLS = ("cudaDeviceSetLimit", "cuCtxSetLimit", "cudaCtxResetPersistingL2Cache",
                         "cuCtxResetPersistingL2Cache", "cudaStreamSetAttribute", "cuStreamSetAttribute",
                         "cudaGraphKernelNodeSetAttribute", "cuGraphKernelNodeSetAttribute")
CACHE_CONTROL_NAMES = (*CACHE_CONTROL_SYMBOLS, "cudaLimitPersistingL2CacheSize", "CU_LIMIT_PERSISTING_L2_CACHE_SIZE",
                       "accessPolicyWindow", "cudaAccessPropertyPersisting", "CU_ACCESS_PROPERTY_PERSISTING",
                       "cudaLaunchAttributeAccessPolicyWindow", "cudaStreamAttributeAccessPolicyWindow",
                       "CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW", "cudaKernelNodeAttributeAccessPolicyWindow")
# Identifiers that are forbidden wherever they appear (distinctive enough that a
# variable of that name is not a plausible accident).
NATIVE_IDENTIFIER_RULES: dict[str, str] = {
    **dict.fromkeys(("pthread_create", "thrd_create", "GOMP_parallel", "__kmpc_fork_call", "omp_set_num_threads"), "thread"),
    **dict.fromkeys(("popen", "execve", "execv", "execvp", "execvpe", "execl", "execlp", "execle", "fexecve",
                     "posix_spawn", "posix_spawnp", "vfork"), "subprocess"),
    **dict.fromkeys(("dlopen", "dlmopen", "dlsym", "dlvsym", "dl_iterate_phdr", "cuModuleLoad", "cuModuleLoadData",
                     "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuLibraryLoadData", "cuLibraryLoadFromFile",
                     "cuModuleGetFunction", "cudaLibraryLoadData", "cudaLibraryLoadFromFile"), "native-load"),
    **dict.fromkeys(("syscall", "ptrace", "mprotect", "mmap", "mmap64", "process_vm_readv", "process_vm_writev",
                     "fopen", "fopen64", "freopen", "ofstream", "ifstream", "fstream", "basic_ofstream",
                     "basic_ifstream", "basic_fstream", "basic_filebuf", "prctl", "sigaction"), "syscall"),
    **dict.fromkeys(("cudaStreamCreate", "cudaStreamCreateWithFlags", "cudaStreamCreateWithPriority",
                     "cuStreamCreate", "cuStreamCreateWithPriority", "cudaLaunchHostFunc", "cudaStreamAddCallback",
                     "cudaStreamBeginCapture", "cudaGraphLaunch", "cudaStreamPerThread", "cudaStreamLegacy",
                     "getStreamFromPool", "setCurrentCUDAStream", "CUDAStreamGuard", "OptionalCUDAStreamGuard",
                     "CUDAMultiStreamGuard", "getDefaultCUDAStream"), "stream"),
    **dict.fromkeys(("PyRun_SimpleString", "PyRun_String", "PyRun_StringFlags", "PyImport_ImportModule",
                     "PyImport_Import", "PyImport_ImportModuleLevel", "PyImport_AddModule", "Py_CompileString",
                     "PyEval_EvalCode"), "dynamic-access"),
    **dict.fromkeys(CACHE_CONTROL_NAMES, "cache-control"),
    **dict.fromkeys(("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL", "TORCH_LIBRARY_FRAGMENT"), "monkeypatch"),
    **dict.fromkeys(("Dispatcher", "findSchemaOrThrow", "findSchema", "findOp", "callBoxed"), "aten-compute"),
}
# Common words that are only forbidden as a free (or std::/::) function call.
NATIVE_CALL_RULES: dict[str, str] = {
    **dict.fromkeys(("fork", "system"), "subprocess"),
    **dict.fromkeys(("clone", "clone3"), "thread"),
    **dict.fromkeys(("open", "open64", "openat", "creat", "socket", "connect", "kill", "tgkill", "signal",
                     "setenv", "putenv", "unlink", "chmod"), "syscall"),
}
# C symbols a built object may not import (C++ symbols are parsed, see symbols.py).
SYMBOL_RULES: dict[str, str] = {
    **NATIVE_CALL_RULES,
    **dict.fromkeys(("pthread_create", "thrd_create", "GOMP_parallel", "GOMP_parallel_start", "__kmpc_fork_call",
                     "omp_set_num_threads", "__clone", "__clone3"), "thread"),
    **dict.fromkeys(("popen", "execve", "execv", "execvp", "execvpe", "execl", "execlp", "execle", "fexecve",
                     "posix_spawn", "posix_spawnp", "vfork", "_Fork"), "subprocess"),
    **dict.fromkeys(("dlopen", "dlmopen", "dlsym", "dlvsym", "dl_iterate_phdr", "cuModuleLoad", "cuModuleLoadData",
                     "cuModuleLoadDataEx", "cuModuleLoadFatBinary", "cuLibraryLoadData", "cuLibraryLoadFromFile",
                     "cuModuleGetFunction", "cudaLibraryLoadData", "cudaLibraryLoadFromFile"), "native-load"),
    **dict.fromkeys(("syscall", "ptrace", "mprotect", "mmap", "mmap64", "process_vm_readv", "process_vm_writev",
                     "fopen", "fopen64", "freopen", "prctl", "sigaction", "__open_2", "__open64_2", "__openat_2",
                     "openat64", "creat64", "sendto", "sendmsg", "accept", "listen", "bind", "recvfrom",
                     "recvmsg"), "syscall"),
    **dict.fromkeys(("cudaStreamCreate", "cudaStreamCreateWithFlags", "cudaStreamCreateWithPriority",
                     "cuStreamCreate", "cuStreamCreateWithPriority", "cudaLaunchHostFunc", "cudaStreamAddCallback",
                     "cudaStreamBeginCapture", "cudaGraphLaunch"), "stream"),
    **dict.fromkeys(CACHE_CONTROL_SYMBOLS, "cache-control"),
    **dict.fromkeys(("PyRun_SimpleString", "PyRun_SimpleStringFlags", "PyRun_String", "PyRun_StringFlags",
                     "PyImport_ImportModule", "PyImport_Import", "PyImport_ImportModuleLevel",
                     "PyImport_ImportModuleLevelObject", "PyImport_AddModule", "Py_CompileString",
                     "Py_CompileStringExFlags", "PyEval_EvalCode"), "dynamic-access"),
}
# Backend namespaces that hold per-backend op functions (at::cpu::relu ...).
ATEN_BACKEND_NAMESPACES = frozenset(
    {"cpu", "cuda", "meta", "compositeexplicitautograd", "compositeimplicitautograd",
     "compositeexplicitautogradnonfunctional"}
)
ATEN_THREAD_NAMES = frozenset({"parallel_for", "parallel_reduce", "launch", "intraop_launch", "invoke_parallel"})


# -- read from torch ------------------------------------------------------------------


@cache
def aten_op_names() -> frozenset[str]:
    """Base names of every registered ATen operator (``relu``, ``relu_``, ``matmul``, ...)."""
    import torch

    return frozenset(n[6:].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))


@cache
def aten_op_structs() -> dict[str, str]:
    """``at::_ops`` struct name -> base operator (``add_Tensor`` -> ``add``)."""
    import torch

    structs = {}
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::"):
            base, _, overload = name[6:].partition(".")
            structs[f"{base}_{overload}" if overload else base] = base
    return structs


@cache
def tensor_methods() -> frozenset[str]:
    """Public callables of ``torch.Tensor`` (properties such as ``shape`` excluded)."""
    import torch

    return frozenset(
        n for n in dir(torch.Tensor)
        if not n.startswith("_") and callable(inspect.getattr_static(torch.Tensor, n, None))
        and not isinstance(inspect.getattr_static(torch.Tensor, n, None), property)
    )


@cache
def python_compute_methods() -> frozenset[str]:
    """Tensor methods that compute (or copy, cast, sync): flagged on any receiver in forward."""
    return tensor_methods() - ALLOWED_OPS


# `any`/`all` are also cooperative_groups methods in device code and `resize` is
# std::vector's; tensor calls of these are still caught by the symbol audit.
_CPP_METHOD_COLLISIONS = frozenset({"any", "all", "resize"})


@cache
def cpp_compute_methods() -> frozenset[str]:
    """at::Tensor methods that run an ATen op (C++ has no Python-only ones like ``numpy``)."""
    return (tensor_methods() & aten_op_names()) - ALLOWED_OPS - _CPP_METHOD_COLLISIONS


def op_allowed(name: str, extra: tuple[str, ...] = ()) -> bool:
    return name in ALLOWED_OPS or name in extra


def op_base(name: str) -> str:
    """``matmul_out``/``matmul_outf`` -> ``matmul``: the C++ API's out= variants."""
    for suffix in ("_outf", "_out"):
        if name.endswith(suffix) and name[: -len(suffix)] in aten_op_names():
            return name[: -len(suffix)]
    return name


def library_family(identifier: str) -> str | None:
    low = identifier.lower()
    for prefix, family in LIBRARY_PREFIXES.items():
        if low.startswith(prefix):
            return family
    return None
