"""Triton in the candidate's process, set up by the harness before the candidate's code loads.

Triton compiles at run time (its frontend and LLVM in the process, ``ptxas`` and the C compiler as
subprocesses, autotuning by timing configs, a cache on disk). None of that may happen where a candidate
is evaluated: from its load on, a new thread or process ends the process (``sandbox.nothreads``) and
whatever is timed must be the kernels alone. So (docs/SECURITY.md, "Triton candidates"):

* On a GPU, every kernel was compiled and every autotuned choice made in the build stage
  (``evaluate.triton_build``), on the task's own input shapes; the candidate's process reads them from a
  copy of that cache. Before the candidate's code loads, Triton's own start-up runs here (its launcher
  module, built from Triton's source, and the tool versions it asks subprocesses for). Where Triton
  compiles a C launcher per kernel signature (3.6 and earlier), each launcher the build stage's launches
  needed was built by the evaluator from the signatures recorded there (``record_launchers``,
  ``build_kernel_launchers``) and lies in the same cache, found there at the first launch. Then a compile
  is refused with rule ``triton-compile`` (a launch the build stage did not see: another shape, dtype or
  specialisation; a launcher the evaluator did not build), and autotuning that finds no choice from the
  build stage with ``triton-autotune``.
* On the CPU, kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): nothing is compiled. The
  interpreter's copies of arguments to the host and back are skipped for tensors already on it, so that
  forward dispatches no torch operator of the harness's for the compute guard to tell apart from the
  candidate's. Autotuned kernels run their first config (the interpreter's timings say nothing of a GPU's).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from cuda_agent.guard.runtime import RuleBroken

INTERPRET_ENV = "TRITON_INTERPRET"
CACHE_ENV = "TRITON_CACHE_DIR"
AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"
TRITON_KEY_FILE = "triton_key"  # beside the launcher: Triton's own key, as ``triton.runtime.cache.triton_key`` says
LAUNCHER_DIR = "triton-harness"  # in a job: Triton's launcher module as the evaluator built it (``build_launcher``)
LAUNCHERS_FILE = "launchers.json"  # beside the build stage's spec: the kernel signatures Triton made launchers for


def triton_missing() -> str | None:
    """Why Triton cannot be imported here (with the fix), or None."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc}); pip install 'cuda-agent[triton]' (or pip install triton)."
    return None


def prepare_triton(device: str, kernels: str | None) -> str:
    """Set Triton up in this process before a Triton candidate loads; returns how (for the result's notes).
    ``kernels``: the build stage's cache (GPU), read-only to this process. Triton's own launcher module is the
    evaluator's build copied beside it (``LAUNCHER_DIR``), else built here, under this process's own directory
    (``TRITON_CACHE_DIR``, set by ``paths.worker_env``)."""
    # Read as Triton imports: its own library kernels (tl.sigmoid, ...) are made interpreted or compiled then.
    if device == "cpu":
        os.environ[INTERPRET_ENV] = "1"
    else:
        os.environ.pop(INTERPRET_ENV, None)
    missing = triton_missing()
    if missing:
        raise RuleBroken("harness", missing)
    if device == "cpu":
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sigmoid, InterpretedFunction):
            raise RuleBroken("harness", f"Triton was imported before {INTERPRET_ENV}=1 was set in this process, so its "
                             "own kernels are compiled ones; start the worker with it set (evaluate.processes)")
        _interpret_on_host()
        return "Triton's interpreter (TRITON_INTERPRET=1): kernels run on the CPU, timings are the interpreter's"
    if kernels is None:
        raise RuleBroken("harness", "a Triton candidate on a GPU needs the build stage's kernel cache")
    os.environ[AUTOTUNE_CACHE_ENV] = "1"
    point_at_libcuda()
    harness = Path(os.environ.get(CACHE_ENV) or tempfile.gettempdir()) / "triton-harness"
    built = Path(kernels).parent / LAUNCHER_DIR
    if built.is_dir() and not harness.exists():
        shutil.copytree(built, harness)  # the evaluator's build of Triton's launcher: found, not compiled again
    _start_triton(harness)
    load_only(kernels)
    return f"Triton kernels loaded from the build stage's cache; compiling and autotuning refused ({kernels})"


def load_only(kernels: str) -> None:
    """From here on, kernels (and, where Triton has them, their launchers) are looked up in the build stage's
    cache, read-only; whatever is not there is refused, never compiled."""
    from triton import knobs

    knobs.cache.dir = kernels
    knobs.cache.manager_class = _read_only_cache()
    _refuse_compiles()


def point_at_libcuda() -> None:
    """Tell Triton where the CUDA driver library is (``TRITON_LIBCUDA_PATH``): the one this process has loaded
    (torch's CUDA context), so that Triton does not ask ``ldconfig``, which a sandbox may not hold."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcuda.so" in line and "/" in line}
    except OSError:
        return
    if paths:
        os.environ["TRITON_LIBCUDA_PATH"] = os.path.dirname(sorted(paths)[0])


def _read_only_cache() -> type:
    """Triton's cache manager over the build stage's kernels: it finds what is there and writes nothing (a write
    would be a compile's or an autotuning's result, which the rules below refuse first)."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    class ReadOnlyCache(FileCacheManager):
        def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
            self.key, self.lock_path = key, None
            self.cache_dir = os.path.join(knobs.cache.dir, key)

        def put(self, data: Any, filename: str, binary: bool = True) -> str:
            raise RuleBroken("triton-compile", f"Triton tried to add {filename} to the build stage's cache: something "
                             "was compiled or tuned in the candidate's process")

    return ReadOnlyCache


def _start_triton(harness: Path) -> None:
    """What Triton does once per process, done before the candidate's code (it runs the C compiler and asks
    ``ptxas`` its version): its launcher module, built from Triton's own source into ``harness`` or found there;
    and Triton's own key (a hash of its sources and its 500 MB library, part of every cache key), read from
    ``harness`` where the evaluator's build wrote it."""
    import triton.runtime.autotuner
    import triton.runtime.cache
    from triton import knobs
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    harness.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(harness)
    remember_platform()
    active = driver.active
    active.utils  # noqa: B018 - builds (the C compiler runs here, before the ban) or loads Triton's launcher
    backend = make_backend(active.get_current_target())
    backend.hash()  # ptxas --version, remembered by Triton
    active.get_current_device()
    saved = harness / TRITON_KEY_FILE
    key = saved.read_text().strip() if saved.is_file() else triton.runtime.cache.triton_key()
    if not saved.is_file():
        saved.write_text(key)
    triton.runtime.cache.triton_key = triton.runtime.autotuner.triton_key = lambda: key


def remember_platform() -> None:
    """Triton keys each native module it builds (its launchers) by the platform too, which
    ``platform.architecture`` learns by running ``file`` on the interpreter: asked here, before the ban, and
    remembered by Triton for every launcher looked up after it."""
    from triton.runtime import build

    key = getattr(build, "platform_key", None)
    if key is not None:
        key()


def _refuse_compiles() -> None:
    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.autotuner import Autotuner

    def add_stages(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuleBroken("triton-compile", "a Triton kernel was launched with arguments the build stage did not "
                         "compile it for (another shape, dtype, alignment or constexpr than the task's inputs give): "
                         "the candidate's process only loads kernels compiled in the build stage")

    def bench(self: Any, *args: Any, config: Any, **meta: Any) -> Any:
        raise RuleBroken("triton-autotune", f"{self.base_fn.__name__} was autotuned in the candidate's process (a key "
                         "the build stage did not tune on the task's shapes): configs are chosen in the build stage")

    def build(name: str, *args: Any, **kwargs: Any) -> str:
        # Triton's C compiler, asked for a module its cache lacks: in the candidate's process only a kernel's launcher
        # (Triton's own start-up built the rest), for a signature the build stage's launches never had.
        raise RuleBroken("triton-compile", f"Triton's launcher module ({name}) for a kernel's argument types was not "
                         "built by the evaluator: a launch with a signature the build stage did not see, whose "
                         "launcher would be compiled in the candidate's process")

    CUDABackend.add_stages = add_stages
    Autotuner._bench = bench
    knobs.build.impl = build  # consulted by triton.runtime.build before it runs any compiler


def _interpret_on_host() -> None:
    import torch
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    executor = interpreter.GridExecutor
    if getattr(executor, "_cuda_agent_host", False):
        return
    to_host, back = executor._init_args_hst, executor._restore_args_dev

    def on_host(value: Any) -> bool:
        if isinstance(value, tuple):
            return all(on_host(v) for v in value)
        # Plain tensors and parameters (weights a kernel reads); anything else takes the interpreter's own path.
        return not hasattr(value, "data_ptr") or (type(value) in (torch.Tensor, torch.nn.Parameter)
                                                  and value.device.type == "cpu")

    def init_args(self: Any, args_dev: Any, kwargs: dict[str, Any]) -> Any:
        if on_host(tuple(args_dev)) and on_host(tuple(kwargs.values())):
            return list(args_dev), dict(kwargs)
        return to_host(self, args_dev, kwargs)

    def restore_args(self: Any, args_dev: Any, args_hst: Any, kwargs: Any, kwargs_hst: Any) -> None:
        if all(a is b for a, b in zip(args_dev, args_hst)) and all(kwargs[k] is kwargs_hst[k] for k in kwargs):
            return
        back(self, args_dev, args_hst, kwargs, kwargs_hst)

    def first_config(self: Any, *args: Any, config: Any, **meta: Any) -> list[float]:
        return [float(self.configs.index(config))] * 3 if config in self.configs else [float("inf")] * 3

    executor._init_args_hst, executor._restore_args_dev = init_args, restore_args
    executor._cuda_agent_host = True
    Autotuner._bench = first_config


def build_launcher(where: Path) -> None:
    """Triton's launcher module built from Triton's own source into ``where`` (a Triton cache), as an evaluated
    process would build it: torch's CUDA context first, so that the driver library is found the same way."""
    import torch

    torch.cuda.init()
    point_at_libcuda()
    _start_triton(where)


def record_launchers() -> list[dict[str, Any]]:
    """In the build stage's process, before the candidate's code: the list that fills with what each per-signature
    launcher Triton makes is made from (its kernel's argument types, its tensor descriptors' metadata), for the
    evaluator to build the same launchers itself; stays empty where Triton's launcher is generic (3.9)."""
    seen: list[dict[str, Any]] = []
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:
        return seen
    make = getattr(nvidia_driver, "make_launcher", None)
    if make is None:
        return seen

    def recording(constants: Any, signature: dict[Any, Any], tensordesc_meta: Any, *args: Any, **kwargs: Any) -> str:
        seen.append({"signature": list(signature.values()), "tensordesc_meta": tensordesc_meta})
        return make(constants, signature, tensordesc_meta, *args, **kwargs)

    nvidia_driver.make_launcher = recording  # CudaLauncher looks it up in its module as it makes each launcher
    return seen


MAX_LAUNCHERS = 64  # distinct launcher signatures of one candidate (autotuned configs of a kernel share one)
MAX_RECORD_CHARS = 64 * 1024
MAX_NESTING = 4  # tuples of arguments within tuples
# A type in a kernel's signature as Triton writes it: ``*fp32``, ``i32``, ``constexpr``, ``nvTmaDesc``,
# ``tensordesc<fp16[64, 64]>``. Triton's launcher source maps each to fixed C text and never copies one into it;
# the characters C would read as more than a name are refused all the same.
TYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_*<>[], .#=:-")


def launcher_records(raw: Any) -> list[dict[str, Any]]:
    """The build stage's recorded launchers (``record_launchers``, written by a process where candidate code ran),
    checked and each once, or ValueError: a signature is a list of type names or of such lists, tensor descriptors'
    metadata none or a list of plain JSON values, and there are at most ``MAX_LAUNCHERS``."""
    if not isinstance(raw, list):
        raise ValueError("not a list of launchers")
    kept: dict[str, dict[str, Any]] = {}
    for record in raw:
        if not isinstance(record, dict) or set(record) != {"signature", "tensordesc_meta"}:
            raise ValueError("a launcher is not {signature, tensordesc_meta}")
        text = json.dumps(record, sort_keys=True)
        if len(text) > MAX_RECORD_CHARS:
            raise ValueError(f"a launcher's record is longer than {MAX_RECORD_CHARS} characters")
        _check_types(record["signature"], 0)
        meta = record["tensordesc_meta"]
        if meta is not None and not (isinstance(meta, list) and all(_plain(m, 0) for m in meta)):
            raise ValueError("tensor descriptors' metadata that is not a list of plain values")
        kept.setdefault(text, record)
        if len(kept) > MAX_LAUNCHERS:
            raise ValueError(f"more than {MAX_LAUNCHERS} launcher signatures")
    return list(kept.values())


def _check_types(types_: Any, depth: int) -> None:
    if not isinstance(types_, list) or depth > MAX_NESTING:
        raise ValueError("a signature that is not a list of types")
    for ty in types_:
        if isinstance(ty, list):
            _check_types(ty, depth + 1)
        elif not (isinstance(ty, str) and 0 < len(ty) <= 256 and set(ty) <= TYPE_CHARS):
            raise ValueError(f"not a type Triton writes: {str(ty)[:80]!r}")


def _plain(value: Any, depth: int) -> bool:
    if depth > MAX_NESTING:
        return False
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= 256
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _as_signature(types_: list[Any]) -> dict[int, Any]:
    def typed(ty: Any) -> Any:  # JSON made Triton's tuples of types lists
        return tuple(typed(t) for t in ty) if isinstance(ty, list) else ty

    return {i: typed(ty) for i, ty in enumerate(types_)}


class RecordRefused(ValueError):
    """A recorded launcher that is not one Triton makes: the build stage's record was not Triton's."""


REFUSED_EXIT = 3  # the launcher build's exit status when a record is refused (the candidate's failure)


def build_kernel_launchers(where: Path, records: Any) -> list[str]:
    """Triton's launcher for each recorded signature, made by Triton's own ``CudaLauncher`` (its source from
    Triton's template, the C compiler run here) into the Triton cache ``where``, where a launch with that signature
    finds it by the hash of the same source; the modules' paths. For the evaluator's own process, which runs no
    candidate code: the records are data, checked again here, and each must make a source with Triton's template
    before any is built (else ``RecordRefused``)."""
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia_driver

    try:
        checked = launcher_records(records)
    except ValueError as exc:
        raise RecordRefused(str(exc)) from None
    make = getattr(nvidia_driver, "make_launcher", None)
    if checked and make is None:
        raise RecordRefused(f"Triton {_triton_version()}'s launcher is generic: it records no per-signature launchers")
    for record in checked:
        try:
            make({}, _as_signature(record["signature"]), record["tensordesc_meta"])
        except (KeyError, ValueError, TypeError, AttributeError, IndexError, AssertionError) as exc:
            raise RecordRefused(f"Triton's template refuses a recorded signature ({type(exc).__name__}: "
                                f"{str(exc)[:200]})") from None
    _find_libcuda()
    where.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(where)
    knobs.cache.manager_class = None  # Triton's own file cache: each module under the hash of its source
    for record in checked:
        # What CudaLauncher reads of a kernel: the source (argument types) and the tensor descriptors' metadata
        # shape the launcher; the rest (scratch sizes, launch flags) only what it passes at each launch.
        source = types.SimpleNamespace(constants={}, signature=_as_signature(record["signature"]),
                                       fn=types.SimpleNamespace(arg_names=[]))
        metadata = types.SimpleNamespace(tensordesc_meta=record["tensordesc_meta"], num_ctas=1,
                                         global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                                         profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False)
        nvidia_driver.CudaLauncher(source, metadata)
    return sorted(str(p) for p in where.rglob("__triton_launcher*"))


def _triton_version() -> str:
    import triton

    return triton.__version__


def _find_libcuda() -> None:
    """``TRITON_LIBCUDA_PATH`` for the launchers' link: the driver library the dynamic loader finds, loaded without
    a CUDA context (none is needed to build); Triton asks ``ldconfig`` where none is found this way."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    point_at_libcuda()


def _main(argv: list[str]) -> None:
    if argv[:1] == ["--launchers"]:  # the records on stdin: the kernels' launchers, built by the evaluator
        try:
            print(json.dumps(build_kernel_launchers(Path(argv[1]), json.loads(sys.stdin.read()))))
        except RecordRefused as exc:
            print(f"the build stage's record of Triton's launchers is not Triton's: {exc}", file=sys.stderr)
            sys.exit(REFUSED_EXIT)
    else:
        build_launcher(Path(argv[0]))


if __name__ == "__main__":  # python -m cuda_agent.evaluate.worker.triton_runtime [--launchers] DIR: the evaluator's builds
    _main(sys.argv[1:])
