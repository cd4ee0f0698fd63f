"""Compilers, versions, target architectures and flags for the two backends."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# Bumped whenever the recipe below changes, so cached builds are never stale.
# 2: glue units (binding.cpp, kernels/*_binding.cpp) at GLUE_OPT with the precompiled header.
RECIPE_VERSION = 2
KERNEL_OPT = "-O3"
# The glue's cost is the front end (torch's headers and pybind11's templates), not code generation:
# -O1 with the precompiled header compiles a binding file in about a third of the CPU time -O3 without it
# takes (docs/BUILD.md). The glue converts tensors to pointers once per call, so
# -O1 costs nothing the timer can see; kernels keep -O3 (and --use_fast_math for .cu).
GLUE_OPT = "-O1"
DEFAULT_CUDA_ARCH = "9.0"  # Hopper, the paper's target; used when no GPU is visible


class ToolchainError(RuntimeError):
    pass


@dataclass(frozen=True)
class Toolchain:
    backend: str  # "cpu" | "cuda"
    cxx: str
    cxx_version: str
    torch_version: str
    torch_include: tuple[str, ...]
    torch_lib: tuple[str, ...]
    python_include: str
    cxx11_abi: bool
    nvcc: str | None = None
    nvcc_version: str | None = None
    cuda_home: str | None = None
    torch_cuda: str | None = None
    arch: tuple[str, ...] = ()

    def fingerprint(self) -> dict[str, Any]:
        data = asdict(self)
        data["recipe"] = RECIPE_VERSION
        return data

    # -- flags -----------------------------------------------------------------
    def defines(self, module: str) -> list[str]:
        return [
            f"-DTORCH_EXTENSION_NAME={module}",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(self.cxx11_abi)}",
        ]

    def includes(self, source_root: Path) -> list[str]:
        # -isystem keeps warnings from torch's headers out of the candidate's diagnostics.
        dirs = [*self.torch_include, self.python_include]
        if self.cuda_home:
            dirs.append(os.path.join(self.cuda_home, "include"))
        flags = [f"-I{source_root}"]
        for d in dirs:
            flags += ["-isystem", d]  # separate arguments: nvcc rejects the joined form
        return flags

    def cxx_flags(self, opt: str = KERNEL_OPT) -> list[str]:
        # No -fopenmp: torch wheels bundle their own OpenMP runtime, and a second
        # one in the same process oversubscribes the cores.
        return [opt, "-std=c++17", "-fPIC", "-fdiagnostics-color=never"]

    def cxx_command(
        self,
        src: Path,
        obj: Path,
        module: str,
        root: Path,
        extra: tuple[str, ...],
        *,
        opt: str = KERNEL_OPT,
        pch: Path | None = None,
    ) -> list[str]:
        """``pch``: a header whose ``.gch`` lies beside it, force-included first. The .gch must come
        from ``pch_command`` with the same ``opt`` and no extra flags: g++ 12.2 accepted an -O1 .gch
        in an -O3 compile and crashed (internal compiler error), so the builder keys the .gch by its
        whole command and uses it only for glue units without extra flags."""
        forced = ["-include", str(pch)] if pch is not None else []
        return [self.cxx, "-c", str(src), "-o", str(obj), *self.cxx_flags(opt), *self.defines(module),
                *self.includes(root), *forced, *extra]

    def pch_command(self, header: Path, out: Path, opt: str = GLUE_OPT) -> list[str]:
        """Precompile ``header`` (torch's and the system's headers only) for the glue units. No
        TORCH_EXTENSION_NAME and no candidate include directory: neither is read by the headers, and
        GCC accepts a .gch made without them, so one .gch serves every module of a toolchain."""
        defines = [d for d in self.defines("m") if not d.startswith("-DTORCH_EXTENSION_NAME=")]
        includes = self.includes(Path("/nonexistent"))[1:]  # drop -I<candidate root>
        return [self.cxx, "-x", "c++-header", "-c", str(header), "-o", str(out), *self.cxx_flags(opt),
                *defines, *includes]

    def nvcc_command(self, src: Path, obj: Path, module: str, root: Path, extra: tuple[str, ...]) -> list[str]:
        if not self.nvcc:
            raise ToolchainError("no nvcc found; install the CUDA toolkit or set CUDA_HOME.")
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

        flags = [KERNEL_OPT, "--use_fast_math", "-std=c++17", "-Xcompiler", "-fPIC", *COMMON_NVCC_FLAGS]
        return [self.nvcc, "-c", str(src), "-o", str(obj), *flags, *self.gencode(), *self.defines(module), *self.includes(root), *extra]

    def gencode(self) -> list[str]:
        flags = []
        for arch in self.arch:
            ptx = arch.endswith("+PTX")
            arch = arch.removesuffix("+PTX")
            number = arch.replace(".", "")
            flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
            if ptx:
                flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
        return flags

    def link_command(self, objects: list[Path], output: Path, cuda: bool, extra: tuple[str, ...]) -> list[str]:
        libs = [f"-L{d}" for d in self.torch_lib] + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
        if cuda:
            if not self.cuda_home:
                raise ToolchainError("linking CUDA code needs the CUDA toolkit; set CUDA_HOME.")
            libs += ["-lc10_cuda", "-ltorch_cuda", f"-L{os.path.join(self.cuda_home, 'lib64')}", "-lcudart"]
        return [self.cxx, "-shared", *map(str, objects), "-o", str(output), *libs, *extra]


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [l for l in out.splitlines() if l.strip()]
    return lines[-1].strip() if "nvcc" in argv[0] else (lines[0].strip() if lines else "unknown")


def find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "include", "cuda_runtime.h").exists():
        return home
    nvcc = shutil.which("nvcc")
    candidates = [Path(os.path.realpath(nvcc)).parent.parent] if nvcc else []
    candidates.append(Path("/usr/local/cuda"))
    for candidate in candidates:
        if (candidate / "include" / "cuda_runtime.h").exists():
            return str(candidate)
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (a container's cpuset, ``taskset``), which
    ``os.cpu_count()`` ignores: in a pod with 8 CPUs of a 128-core host that counts 128."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def default_build_workers() -> int:
    """Candidates compiled at once beside the evaluations: half the usable CPUs (a build compiles its own
    translation units in parallel too)."""
    return max(1, usable_cpus() // 2)


def visible_gpus() -> list[dict[str, str]]:
    """GPUs as nvidia-smi lists them (no CUDA context in this process)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,compute_cap,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5:
            gpus.append(dict(zip(("index", "name", "compute_cap", "driver", "memory"), parts)))
    return gpus


def cuda_arch_list() -> tuple[str, ...]:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return tuple(a for a in env.replace(",", ";").replace(" ", ";").split(";") if a)
    caps = sorted({g["compute_cap"] for g in visible_gpus() if g["compute_cap"]})
    return tuple(caps) or (DEFAULT_CUDA_ARCH,)


@lru_cache(maxsize=None)
def detect_toolchain(backend: str) -> Toolchain:
    if backend not in ("cpu", "cuda"):
        raise ToolchainError(f"unknown backend {backend!r}; use 'cpu' or 'cuda'.")
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ToolchainError("no C++ compiler found; install g++ (Debian: `apt-get install g++`).")
    toolchain = dict(
        backend=backend,
        cxx=cxx,
        cxx_version=_version([cxx, "--version"]),
        torch_version=torch.__version__,
        torch_include=tuple(cpp_extension.include_paths()),
        torch_lib=tuple(cpp_extension.library_paths()),
        python_include=sysconfig.get_paths()["include"],
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    )
    if backend == "cuda":
        cuda_home = find_cuda_home()
        nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
        if not nvcc or not os.path.exists(nvcc):
            raise ToolchainError("the CUDA backend needs nvcc; install the CUDA toolkit or set CUDA_HOME.")
        toolchain.update(
            nvcc=nvcc,
            nvcc_version=_version([nvcc, "--version"]),
            cuda_home=cuda_home,
            torch_cuda=torch.version.cuda,
            arch=cuda_arch_list(),
        )
    return Toolchain(**toolchain)
