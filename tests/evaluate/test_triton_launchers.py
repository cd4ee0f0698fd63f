"""Triton's per-signature launchers (Triton 3.6 and earlier compile one C module per kernel signature at its first
launch): the build stage records the signatures, the evaluator builds the launchers itself into the kept cache, and
the evaluated process finds them there without a compiler; one it does not find is refused as ``triton-compile``.

The end-to-end test needs a Triton that makes such launchers (3.6: ``python3 -m venv --system-site-packages VENV &&
VENV/bin/pip install triton==3.6.0``, then run pytest with VENV's python); under a Triton whose launcher is generic
(3.9) it skips and the rest still runs. No GPU is used: ptxas compiles for sm_90 here, and the launchers link and
load against a stand-in ``libcuda.so.1`` that defines the driver's functions (never called)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cuda_agent.evaluate.protocol.channel import Stop
from cuda_agent.evaluate.triton_build import _keep, _recorded_launchers, build_recorded_launchers, copy_kernels
from cuda_agent.evaluate.worker.triton_runtime import LAUNCHERS_FILE, MAX_LAUNCHERS, launcher_records

ROOT = Path(__file__).resolve().parents[2]
SIGNATURE = ["*fp32", "*fp32", "i32", "fp32", "constexpr"]


def test_recorded_launchers_are_checked_as_data_and_kept_once():
    plain = {"signature": SIGNATURE, "tensordesc_meta": []}
    nested = {"signature": ["*fp16", ["i32", ["i64", "constexpr"]], "tensordesc<fp16[64, 64]>"],
              "tensordesc_meta": [{"swizzle": 3, "elem_size": 2, "block_size": [64, 64], "fp4_padded": False}]}
    assert launcher_records([plain, nested, dict(plain)]) == [plain, nested]
    assert launcher_records([]) == []
    refused = [
        {"signature": SIGNATURE},  # a field missing
        {"signature": SIGNATURE, "tensordesc_meta": [], "extra": 1},
        {"signature": ["*fp32", 'i32"); system("sh'], "tensordesc_meta": None},  # C text in a type
        {"signature": ["*fp32", "i32;"], "tensordesc_meta": None},
        {"signature": ["i32\n#include"], "tensordesc_meta": None},
        {"signature": "*fp32", "tensordesc_meta": None},
        {"signature": [1], "tensordesc_meta": None},
        {"signature": [[[[[["i32"]]]]]], "tensordesc_meta": None},  # nested deeper than Triton's tuples go
        {"signature": SIGNATURE, "tensordesc_meta": "x"},
        {"signature": SIGNATURE, "tensordesc_meta": [{"swizzle": object.__name__ * 300}]},
    ]
    for record in refused:
        with pytest.raises(ValueError):
            launcher_records([record])
    with pytest.raises(ValueError, match="more than"):
        launcher_records([{"signature": ["i32"] * (n + 1), "tensordesc_meta": None} for n in range(MAX_LAUNCHERS + 1)])
    with pytest.raises(ValueError):
        launcher_records({"signature": SIGNATURE})


def test_a_record_that_is_not_tritons_stops_the_build(tmp_path):
    path = tmp_path / LAUNCHERS_FILE
    assert _recorded_launchers(path) == []  # a Triton whose launcher is generic records none
    path.write_text(json.dumps([{"signature": ["*fp32", "i32)"], "tensordesc_meta": None}]))
    with pytest.raises(Stop) as stopped:
        _recorded_launchers(path)
    assert (stopped.value.status, stopped.value.stage) == ("failed", "build")
    path.write_text("not json")
    with pytest.raises(Stop):
        _recorded_launchers(path)
    path.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps([{"signature": ["*fp32"], "tensordesc_meta": None}]))
    path.symlink_to(tmp_path / "elsewhere.json")  # a file that is not the build stage's, however well formed
    with pytest.raises(Stop, match="not a plain file"):
        _recorded_launchers(path)


def test_a_launcher_that_does_not_build_is_the_harness_error_and_leaves_no_cache(tmp_path, monkeypatch):
    source = tmp_path / "kernels"
    (source / "HASH").mkdir(parents=True)
    (source / "HASH" / "k.json").write_text("{}")
    setup = types.SimpleNamespace(gpu_index=None, timeouts=types.SimpleNamespace(build_s=60))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the builder process fails, whatever it was asked
    home = tmp_path / "home"
    records = [{"signature": SIGNATURE, "tensordesc_meta": None}]
    with pytest.raises(Stop) as stopped:
        _keep(source, home, lambda staging: build_recorded_launchers(setup, records, staging))
    assert (stopped.value.status, stopped.value.stage) == ("error", "build")
    assert not home.exists() and list(tmp_path.iterdir()) == [source]


@pytest.mark.slow
def test_a_record_tritons_template_refuses_fails_the_candidates_build(tmp_path, monkeypatch):
    """A type of the allowed characters that Triton does not know (or, under a Triton whose launcher is generic, any
    record at all): the build stage's record was not Triton's, the candidate's build fails and nothing is kept."""
    pytest.importorskip("triton")
    for name, value in _env().items():
        monkeypatch.setenv(name, value)
    source = tmp_path / "kernels"
    (source / "HASH").mkdir(parents=True)
    (source / "HASH" / "k.json").write_text("{}")
    setup = types.SimpleNamespace(gpu_index=None, timeouts=types.SimpleNamespace(build_s=300))
    records = [{"signature": ["*fp32", "i33"], "tensordesc_meta": None}]
    with pytest.raises(Stop) as stopped:
        _keep(source, tmp_path / "home", lambda staging: build_recorded_launchers(setup, records, staging))
    assert (stopped.value.status, stopped.value.stage) == ("failed", "build")
    assert "not Triton's" in stopped.value.reason and not (tmp_path / "home").exists()


REFUSE_BUILD = r'''
import json, subprocess, sys
from cuda_agent.evaluate.worker.triton_runtime import load_only, remember_platform
from cuda_agent.guard.runtime import RuleBroken
from triton.runtime.build import compile_module_from_src

def banned(*args, **kwargs):
    raise AssertionError("a process was started")

remember_platform()  # of the harness's start-up, the part a machine without a GPU can run
load_only(sys.argv[1])
subprocess.Popen.__init__ = banned  # the thread ban, as a failure this process can report
try:
    compile_module_from_src(src="int answer = 42;", name="m")
except RuleBroken as exc:
    print(json.dumps({"rule": exc.rule, "error": str(exc)}))
'''


@pytest.mark.slow
def test_a_c_module_after_start_up_is_refused_before_any_compiler_runs(tmp_path):
    """Whatever Triton's version: after the harness's start-up, a native module missing from the cache is refused as
    triton-compile, and no compiler process is started for it."""
    pytest.importorskip("triton")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    ran = subprocess.run([sys.executable, "-c", REFUSE_BUILD, str(kernels)], env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    assert found["rule"] == "triton-compile" and "launcher module (m)" in found["error"]


KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_add(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(y_ptr + offsets, x * scale + 1.0, mask=offsets < n)
'''

# Both sides of the build: "build" is the build stage's process (the harness's recorder first, then a kernel compiled
# and its launcher made as a first launch makes them: CompiledKernel._init_handles), "evaluate" the evaluated
# process after the harness's start-up (load_only: the kept cache, read-only, compiling refused), with every new
# process failing as the thread ban would end it.
SIDES = r'''
import json, subprocess, sys
sys.path.insert(0, sys.argv[1])
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia_driver
from triton.compiler.compiler import make_backend
from cuda_agent.evaluate.worker.triton_runtime import LAUNCHERS_FILE, load_only, record_launchers, remember_platform
from cuda_agent.guard.runtime import RuleBroken

mode, where = sys.argv[2], sys.argv[3]
target = GPUTarget("cuda", 90, 32)
if mode == "build":
    launchers = record_launchers()
else:
    # The harness's start-up (triton_runtime._start_triton), the part a machine without a GPU can run: ptxas's
    # version, the platform and the driver library's directory asked before the ban.
    make_backend(target).hash()
    remember_platform()
    nvidia_driver.library_dirs()
    load_only(where)
    started = []

    def banned(self, args, *rest, **kwargs):
        started.append(str(args))
        raise OSError("a new process in the evaluated process")

    subprocess.Popen.__init__ = banned
import kernel

source = triton.compiler.ASTSource(fn=kernel.scale_add, constexprs={"BLOCK": 1024},
                                   signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "scale": "fp32",
                                              "BLOCK": "constexpr"})
found = {}
try:
    compiled = triton.compile(source, target=target)
    launcher = nvidia_driver.CudaLauncher(compiled.src, compiled.metadata)
    found["launch"] = type(launcher.launch).__name__
except RuleBroken as exc:
    found["rule"], found["error"] = exc.rule, str(exc)
if mode == "build":
    with open(where, "w") as out:
        json.dump(launchers, out)
else:
    found["started"] = started
print(json.dumps(found))
'''


@pytest.mark.slow
def test_the_evaluator_builds_the_launcher_and_the_evaluated_process_finds_it_without_a_compiler(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    from triton.backends.nvidia import driver as nvidia_driver

    if not hasattr(nvidia_driver, "make_launcher"):
        pytest.skip(f"Triton {triton.__version__} has a generic launcher: no per-signature launcher to build "
                    "(run this test under Triton 3.6, as the module's docstring says)")
    if shutil.which("gcc") is None and shutil.which("clang") is None:
        pytest.skip("no C compiler: Triton builds its launchers with one")
    (tmp_path / "kernel.py").write_text(KERNEL)
    stub = _stub_libcuda(tmp_path / "libcuda", Path(nvidia_driver.include_dirs[0]))
    for name, value in _env(stub).items():
        monkeypatch.setenv(name, value)  # the evaluator's own environment: its launcher build finds the driver so
    job = tmp_path / "job"

    def side(mode: str, where: Path, cache: Path) -> dict:
        env = _env(stub) | {"TRITON_CACHE_DIR": str(cache)}
        ran = subprocess.run([sys.executable, "-c", SIDES, str(tmp_path), mode, str(where)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        return json.loads(ran.stdout.strip().splitlines()[-1])

    assert side("build", job / LAUNCHERS_FILE, job / "kernels") == {"launch": "builtin_function_or_method"}
    made = list((job / "kernels").rglob("__triton_launcher*"))
    assert len(made) == 1  # the build stage's own launcher, beside the candidate's code: never kept
    records = _recorded_launchers(job / LAUNCHERS_FILE)
    assert records == [{"signature": SIGNATURE, "tensordesc_meta": []}]

    home = tmp_path / "cache" / "key"
    home.parent.mkdir()
    setup = types.SimpleNamespace(gpu_index=None, timeouts=types.SimpleNamespace(build_s=300))
    _keep(job / "kernels", home, lambda staging: build_recorded_launchers(setup, records, staging))
    kept = list(home.rglob("__triton_launcher*"))
    # The evaluator's build lies where a launch with that signature looks: under the hash of the same source.
    assert [p.relative_to(home) for p in kept] == [made[0].relative_to(job / "kernels")]
    assert not list(home.rglob("*.ttir")) and (home / "done").exists()

    copy = copy_kernels(home, tmp_path / "eval-job")
    _read_only(copy)
    found = side("evaluate", copy, copy)
    assert found == {"launch": "builtin_function_or_method", "started": []}

    # The same kernel, its launcher missing (a signature the build stage's record lacked): refused, not compiled.
    bare = copy_kernels(home, tmp_path / "eval-job-2")
    for path in bare.rglob("__triton_launcher*"):
        path.unlink()
    _read_only(bare)
    found = side("evaluate", bare, bare)
    assert found["rule"] == "triton-compile" and "launcher" in found["error"] and found["started"] == []


def _env(stub: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    if stub is not None:
        env["TRITON_LIBCUDA_PATH"] = str(stub)
        env["LD_LIBRARY_PATH"] = str(stub) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    return env


def _stub_libcuda(where: Path, include: Path) -> Path:
    """A ``libcuda.so.1`` defining every function Triton's ``cuda.h`` declares (none is called): what a launcher
    links and loads against on a machine without the driver."""
    where.mkdir()
    cc = shutil.which("gcc") or shutil.which("clang")
    header = subprocess.run([cc, "-E", "-P", f"-I{include}", "-"], input='#include "cuda.h"\n', capture_output=True,
                            text=True, check=True).stdout
    names = sorted(set(re.findall(r"\b(cu[A-Za-z0-9_]+)\s*\(", header)))
    (where / "stub.c").write_text("".join(f"int {name}(void) {{ return 999; }}\n" for name in names))
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(where / "libcuda.so.1"),
                    str(where / "stub.c")], check=True)
    return where


def _read_only(tree: Path) -> None:
    for path in [tree, *tree.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
