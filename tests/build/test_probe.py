"""The toolchain probe: a minimal extension whose imports the symbol audit allows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cuda_agent.build import build, compile_only
from cuda_agent.build.probe import probe_candidate
from cuda_agent.build.toolchain import ToolchainError, detect_toolchain
from cuda_agent.guard import audit_symbols, check_candidate
from cuda_agent.guard.symbols import imported_symbols


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_probe_passes_the_static_checks(backend):
    assert check_candidate(probe_candidate(backend)) == []


@pytest.mark.slow
def test_cpu_probe_builds_and_is_clean_under_its_own_allowance(cache_dir):
    built = build(probe_candidate("cpu"), "cpu", cache_dir=cache_dir)
    assert built.ok, built.error
    paths = [Path(p) for p in built.modules.values()]
    imports = imported_symbols(paths)
    assert "PyBaseObject_Type" in imports  # pybind11's, through the fixed binding
    assert audit_symbols(paths, allowed=imports) == []


@pytest.mark.slow
def test_cuda_probe_compiles(cache_dir):
    try:
        detect_toolchain("cuda")
    except ToolchainError as exc:
        pytest.skip(f"no CUDA toolchain: {exc}")
    probe = probe_candidate("cuda")
    (extension,) = probe.extensions
    # The CPU wheel's headers lack c10/cuda's generated macros, so only the kernel compiles here;
    # the GPU suite builds the whole probe (every GPU evaluation does).
    kernel_only = replace(probe, extensions=(replace(extension, sources={
        k: v for k, v in extension.sources.items() if k != "kernels/probe_binding.cpp"}),))
    result = compile_only(kernel_only, "cuda", cache_dir=cache_dir)
    assert result.ok, [d.message for d in result.diagnostics]
