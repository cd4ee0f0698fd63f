"""Where cuda-agent keeps its caches (builds, baselines, inductor), and reading the files users give it."""

from __future__ import annotations

import os
from pathlib import Path


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


def worker_env(home: Path, inductor_cache: Path | None = None) -> dict[str, str]:
    """The environment of a sandboxed worker process running this package. The sandbox leaves only
    ``home`` (and ``inductor_cache``, when given) writable, so every cache goes there."""
    # Never an MPS client: its contexts would run beside other processes' instead of taking turns with them, and the
    # GPU quiet probe (``evaluate.quiet``) and the timing's device to itself rest on taking turns. The sandbox's
    # private /tmp hides MPS's default pipe directory; one named in the environment is dropped here.
    env = {name: value for name, value in os.environ.items() if not name.startswith("CUDA_MPS_")}
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
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
