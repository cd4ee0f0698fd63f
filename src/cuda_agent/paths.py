"""Where cuda-agent keeps its caches (builds, baselines, inductor), and reading the files users give it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["cache_root", "PACKAGE_ROOT", "EXAMPLES", "CHECKOUT", "install_hint", "PASSED_ENV", "PASSED_ENV_PREFIXES",
           "passed_env", "compiler_env", "worker_env", "read_text"]


def cache_root() -> Path:
    """``$CUDA_AGENT_CACHE``, else ``$XDG_CACHE_HOME/cuda-agent``, else ``~/.cache/cuda-agent``."""
    explicit = os.environ.get("CUDA_AGENT_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuda-agent"


# The directory that holds the ``cuda_agent`` package (``src/`` in a checkout). Workers import the
# package from here; it may lie under /tmp or /dev/shm, which are private in the sandbox, so
# sandboxed workers are given it as a readable path.
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # the repository's bundled examples
CHECKOUT = Path(__file__).resolve().parents[2]  # the repository, where the package runs from a checkout


def install_hint(extra: str) -> str:
    """The command that adds an optional extra (pyproject's ``[project.optional-dependencies]``) to this
    installation: from a checkout, as the README installs, ``pip install -e '.[extra]'`` in it; else from the
    package index."""
    if (CHECKOUT / "pyproject.toml").is_file():
        return f"pip install -e '.[{extra}]' (in {CHECKOUT})"
    return f"pip install 'cuda-agent[{extra}]'"


# The only variables of the evaluator's environment that reach a sandboxed process (a worker, a compiler,
# a linker, the agent's shell), each with why it is needed there. Nothing else passes: the evaluator's
# environment holds what a trainer or an agent was given (API keys, tokens, service URLs, credentials),
# and whatever a candidate's process can read reaches the policy's trajectories. None of these is a
# secret; a variable is added here only when an evaluation needs it and it names no secret or service.
PASSED_ENV: dict[str, str] = {
    "PATH": "compilers, nvcc's host compiler, ncu and the agent's shell commands are found on it",
    "LANG": "the locale of compiler messages and Python's text encoding",
    "LANGUAGE": "as LANG",
    "TZ": "timestamps in logs",
    "CUDA_HOME": "the CUDA toolkit (nvcc, headers, libraries) for the compilers, torch and Triton",
    "CUDA_PATH": "as CUDA_HOME",
    "CUDA_VISIBLE_DEVICES": "which GPU the evaluation uses (the evaluator sets it per slot as well)",
    "CUDA_DEVICE_ORDER": "how CUDA_VISIBLE_DEVICES indices map to GPUs",
    "CUDA_MODULE_LOADING": "lazy loading of CUDA modules (start-up time and memory)",
    "NVIDIA_VISIBLE_DEVICES": "a container runtime's GPU selection",
    "NVIDIA_DRIVER_CAPABILITIES": "a container runtime's driver features",
    "LD_LIBRARY_PATH": "the driver's and the toolkit's libraries where the loader's cache does not list them",
    "TORCH_CUDA_ARCH_LIST": "the architectures torch builds for (the builder reads it in the evaluator too)",
    "PYTORCH_CUDA_ALLOC_CONF": "the operator's allocator settings (a candidate's is replaced on a GPU)",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "how torch asks whether CUDA is available without a context",
    "TRITON_PTXAS_PATH": "Triton's ptxas where the toolkit's is not found (torch.compile baselines)",
    "TRITON_LIBCUDA_PATH": "Triton's libcuda where the loader's cache does not list it",
    "TORCHINDUCTOR_COMPILE_THREADS": "torch.compile's worker threads for the baselines on a small host",
    "OMP_NUM_THREADS": "the threads torch's CPU kernels use: the same for the reference and the candidate",
    "MKL_NUM_THREADS": "as OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS": "as OMP_NUM_THREADS",
    "VIRTUAL_ENV": "the agent's shell finds the evaluator's Python environment",
    "CONDA_PREFIX": "as VIRTUAL_ENV",
}
PASSED_ENV_PREFIXES: tuple[str, ...] = ("LC_",)  # the locale's categories, as LANG


def passed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted part (PASSED_ENV, PASSED_ENV_PREFIXES) of ``environ`` (the evaluator's own by
    default): the base of every sandboxed process's environment."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if name in PASSED_ENV or name.startswith(PASSED_ENV_PREFIXES)}


def compiler_env() -> dict[str, str]:
    """The environment of a sandboxed compiler or linker: the allowlist, with its temporary files in
    the sandbox's private /tmp and no home of the evaluator's."""
    return passed_env() | {"HOME": "/tmp", "TMPDIR": "/tmp"}


def worker_env(home: Path, inductor_cache: Path | None = None) -> dict[str, str]:
    """The environment of a sandboxed worker process running this package: the allowlist
    (``passed_env``) and what the worker needs. The sandbox leaves only ``home`` (and
    ``inductor_cache``, when given) writable, so every cache goes there."""
    # Never an MPS client: its contexts would run beside other processes' instead of taking turns with them, and the
    # GPU quiet probe (``evaluate.protocol.quiet``) and the timing's device to itself rest on taking turns. The sandbox's
    # private /tmp hides MPS's default pipe directory; none of its variables is on the allowlist.
    env = passed_env()
    # The package first, then the evaluator's own path entries (paths, not secrets: where torch may live).
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("HOME", "TMPDIR", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "TORCH_EXTENSIONS_DIR"):
        env[name] = str(home)
    if inductor_cache is not None:
        # Compiled Triton kernels too: under ``home`` each process compiled again what the last one had.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
        env["TRITON_CACHE_DIR"] = str(inductor_cache / "triton")
    return env


def read_text(path: Path | str, error: type[Exception] = ValueError) -> str:
    """A text file the user gave (a task, a candidate's source). One that is not UTF-8 raises
    ``error`` naming the file: Python's own UnicodeDecodeError names only the byte."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                    "give a Python/C++ source file saved as UTF-8.") from None
