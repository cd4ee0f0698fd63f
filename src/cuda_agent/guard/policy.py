"""What a candidate may use (``CodePolicy``), what a check reports (``Violation``) and
the names of the rules (``RULES``), in one place so tests and reports agree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Every rule a check can report, with what it means. Names are stable: tests and
# result records refer to them.
STATIC_RULES: dict[str, str] = {
    "syntax": "model_new.py does not parse",
    "torch-compute": "a torch op (function, tensor method, nn.Module call) reached from ModelNew.forward",
    "aten-compute": "an ATen/torch compute op in C++/CUDA source, or imported by a built object",
    "forbidden-import": "an import a candidate does not need (anything beyond torch, math and a few pure helpers)",
    "dynamic-access": "code the check cannot see through: eval/exec/__import__, non-literal getattr, "
    "dunder or private torch access, star imports, Python called from C++",
    "frame-access": "frames, gc, inspect or sys: reaching objects that are not the candidate's own",
    "monkeypatch": "assigning, deleting or registering over torch, imported modules, global flags or runtime symbols",
    "tensor-subclass": "a torch.Tensor subclass or a __torch_function__/__torch_dispatch__ hook",
    "thread": "threads or processes the candidate starts (threading, std::thread, OpenMP, at::parallel_for, ...)",
    "subprocess": "running programs: subprocess, os.system, fork/exec, popen",
    "ctypes": "foreign calls from Python (ctypes, cffi)",
    "native-load": "native code loaded outside the build (dlopen/dlsym, load_library, cpp_extension.load, cuModuleLoad)",
    "syscall": "raw system access: syscalls, files, sockets, ptrace, memory protection, host inline assembly",
    "stream": "work on a stream other than the current one (side streams, CUDA graphs, per-thread default stream)",
    "library": "a vendor library (cuBLAS, cuDNN, cuFFT, ...) the policy does not allow",
    "token-paste": "preprocessor or namespace tricks that hide a name from the scan (##, aliasing macros, using-directives)",
    "build-flag": "a compiler or linker flag beyond what a kernel needs (macros, forced includes, link tricks)",
    "triton-api": "a Triton name beyond writing and launching kernels (jit, language, autotune, Config, heuristics, "
    "cdiv, next_power_of_2): Triton's compiler, runtime, driver, cache and knobs are the harness's",
    "triton-kernel": "a Triton kernel body reads something other than triton.language, its arguments, module "
    "constants and other kernels, holds a statement Triton's compiler refuses, or reaches the interpreter's host "
    "values (under the interpreter it would run host Python)",
    "cache-control": "L2 persistence controls (persisting-L2 limit, access policy windows) that keep data "
    "cached across the flush before each timed call",
}

# Found at run time (guard.runtime, the evaluator, the worker channel).
RUNTIME_RULES: dict[str, str] = {
    "output-alias": "an output shares memory with an input, a parameter or a buffer",
    "output-reuse": "an output shares memory with an earlier call's output (stored results)",
    "output-type": "an output that is not a plain torch.Tensor (subclasses defer work into the comparison)",
    "output-memory": "an output whose memory no torch allocator made (torch::from_blob, an external buffer): "
    "memory the harness cannot vouch for, such as pages filled only when read",
    "input-mutation": "forward changed the values of its inputs",
    "input-generation": "the candidate process drew different inputs from the same seed",
    "guard-tamper": "the dispatch mode that watches forward was removed",
    "global-flag": "a precision or backend flag changed after candidate code ran",
    "wrong-output": "a checked call's output is outside the policy's tolerance",
    "timed-output": "a timed call's output is outside the tolerance (right only when checked)",
    "unwatched-compute": "a timed call's output differs bit for bit from the same call run again under check, "
    "which gave the same bits twice (other work when unwatched, such as a torch fallback)",
    "implausible-speedup": "faster than the policy's ceiling allows; needs review before any reward",
    "l2-persistence": "the persisting-L2 limit changed after candidate code ran (persisting lines survive the "
    "L2 flush)",
    "decoy": "the extension's own kernels did not run in forward (the work came from elsewhere)",
    "coverage": "the candidate's own kernels carried less of forward's GPU time than the policy asks",
    "forged-reply": "a reply on the worker channel that its request loop did not write",
    "clock": "the candidate's reported timed regions leave more of a round unexplained than the evaluator's own "
    "clock allows (a timer changed below Python)",
    "signal-handler": "the candidate's process installed a signal handler (seen from outside): a fault handler "
    "can fill an output only when it is read, after the timed region",
    "integrity": "an import-table slot of a harness library, the C function behind a harness builtin, the code "
    "of a library loaded before candidate code, or a pointer the harness's clock or allocations go through was "
    "changed by candidate code (read from outside the process)",
    "baseline-interference": "the candidate's processes could not be stopped while the baselines were timed",
    "gpu-busy": "work the candidate left queued on the GPU (in a context of its own) ran while it was stopped: "
    "before a baseline's region or once a region's inputs were written, before its GO (evaluate.protocol.quiet)",
    "memory": "the candidate's process ran out of the memory it is allowed (Evaluator memory_limit)",
    "state-dict": "Model's state dict does not load into ModelNew",
    "interface": "model_new.py does not define ModelNew",
    "triton-compile": "a Triton kernel the build stage did not compile for this launch (another shape, dtype or "
    "specialisation, or a kernel first launched in a timed call): the candidate's process only loads kernels",
    "triton-autotune": "Triton autotuning in the candidate's process (configs are chosen in the build stage, on the "
    "task's shapes; benchmarking configs on the evaluated inputs is not the candidate's to do)",
    "harness": "the candidate cannot be run by the harness's protocol (extension not loadable, unknown "
    "load_inline name, a timing run cut short)",
}

RULES: dict[str, str] = STATIC_RULES | RUNTIME_RULES


@dataclass(frozen=True)
class CodePolicy:
    """What candidate code may use beyond writing its own kernels.

    ``libraries`` names the vendor library families a candidate may call (the
    paper allows cuBLAS for GEMM and cuDNN for convolutions); ``allowed_aten``
    names extra torch/ATen ops allowed beyond allocation, views and metadata.
    """

    libraries: tuple[str, ...] = ("cublas", "cudnn")
    allow_streams: bool = False
    allowed_aten: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "libraries": list(self.libraries),
            "allow_streams": self.allow_streams,
            "allowed_aten": list(self.allowed_aten),
        }


@dataclass(frozen=True)
class Violation:
    """One breach of the policy, located as precisely as the check can."""

    rule: str
    file: str
    line: int | None
    message: str

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; rules are listed in cuda_agent.guard.RULES")

    def describe(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        return f"{where}: [{self.rule}] {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "file": self.file, "line": self.line, "message": self.message}


def sorted_unique(violations: list[Violation]) -> list[Violation]:
    """One report per (rule, place, message), in file and line order."""
    unique = {(v.file, v.line or 0, v.rule, v.message): v for v in violations}
    return [unique[k] for k in sorted(unique)]
