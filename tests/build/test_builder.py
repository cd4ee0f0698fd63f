import shutil

import pytest

from cuda_agent.build import build, compile_only
from cuda_agent.build.builder import build_key
from cuda_agent.build.toolchain import detect_toolchain
from cuda_agent.candidates import load_candidate

pytestmark = pytest.mark.slow

BAD_CU = """#include <cuda_runtime.h>
__global__ void broken(float* x) {
  x[threadIdx.x] = 1.0f
}
"""


def test_cpu_build_is_cached(examples, cache_dir):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    first = build(candidate, "cpu", cache_dir=cache_dir)
    assert first.ok, first.log
    second = build(candidate, "cpu", cache_dir=cache_dir)
    assert second.cached and second.modules == first.modules
    assert second.seconds < 1.0


def test_build_key_covers_sources_and_mode(examples):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    toolchain = detect_toolchain("cpu")
    assert build_key(candidate, toolchain, "link") != build_key(candidate, toolchain, "compile")
    ext = candidate.extensions[0]
    changed = type(candidate)(
        model_new=candidate.model_new,
        extensions=(type(ext)(ext.name, {**ext.sources, "kernels/extra.cpp": "int x;"}),),
        kind=candidate.kind,
        origin=candidate.origin,
    )
    assert build_key(changed, toolchain, "link") != build_key(candidate, toolchain, "link")


def make_workspace(root, files):
    (root / "kernels").mkdir(parents=True)
    (root / "model_new.py").write_text("import cuda_extension\nclass ModelNew:\n    pass\n")
    for name, text in files.items():
        (root / name).write_text(text)
    return load_candidate(root)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_compile_only_reports_cuda_syntax_error(tmp_path, cache_dir):
    candidate = make_workspace(tmp_path / "ws", {"kernels/bad.cu": BAD_CU})
    result = compile_only(candidate, "cuda", cache_dir=cache_dir)
    assert not result.ok and not result.modules
    errors = result.errors
    assert errors, result.log
    assert errors[0].file == "kernels/bad.cu" and errors[0].line in (3, 4)
    assert "bad.cu" in result.error


def test_cpp_error_has_file_and_line(tmp_path, cache_dir):
    candidate = make_workspace(tmp_path / "ws", {"kernels/bad.cpp": "int f() {\n  return undefined_name;\n}\n"})
    result = compile_only(candidate, "cpu", cache_dir=cache_dir)
    assert not result.ok
    assert [(d.file, d.line) for d in result.errors][:1] == [("kernels/bad.cpp", 2)]
    assert "undefined_name" in result.errors[0].message


def test_cpu_backend_rejects_cuda_sources(tmp_path, cache_dir):
    candidate = make_workspace(tmp_path / "ws", {"kernels/k.cu": "__global__ void k() {}\n"})
    result = build(candidate, "cpu", cache_dir=cache_dir)
    assert not result.ok and "cannot build CUDA sources (kernels/k.cu)" in result.error


def test_compile_timeout_is_reported_and_not_cached(tmp_path, cache_dir):
    candidate = make_workspace(tmp_path / "ws", {"kernels/a.cpp": "int a() { return 1; }\n"})
    result = compile_only(candidate, "cpu", cache_dir=cache_dir, timeout_s=0.01)
    assert not result.ok and "timed out" in result.error
    assert not (cache_dir / "builds" / result.key).exists()
