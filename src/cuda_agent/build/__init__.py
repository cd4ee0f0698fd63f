"""Build: candidate sources -> an importable extension (cached), or compile-only diagnostics."""

from cuda_agent.build.diagnostics import Diagnostic, parse_diagnostics
from cuda_agent.build.toolchain import Toolchain, detect_toolchain
from cuda_agent.build.builder import BuildResult, build, compile_only, prepare

__all__ = [
    "BuildResult",
    "Diagnostic",
    "Toolchain",
    "build",
    "compile_only",
    "detect_toolchain",
    "parse_diagnostics",
    "prepare",
]
