"""Guards that run inside the candidate's process, around its code.

Static checks read the source; these watch what the code does. They run in the
worker (``cuda_agent.evaluate.worker.loop``) and raise :class:`RuleBroken` with a
stable rule name, which becomes ``EvalResult.rule``:

- ``torch-compute``: an ATen operator other than allocation, views and metadata
  ran during ``ModelNew.forward``. A dispatch mode sees operators called from
  Python and from the extension's C++ alike, so a torch fallback hidden in the
  binding is caught too.
- ``output-alias`` / ``output-reuse``: an output shares memory with an input,
  a parameter or buffer, or the previous call's output (cached results).
- ``output-memory``: an output's storage was not made by a torch allocator
  (``torch::from_blob``, DLPack): memory the harness cannot vouch for.
- ``input-mutation``: the inputs changed during the call (zeroing them makes
  the reference trivial too, when both see the same tensors).
- ``thread`` / ``subprocess``: work left running after the call returned.
- ``monkeypatch`` / ``global-flag``: timing or harness functions replaced, or
  precision flags changed, once candidate code has run.
- ``guard-tamper``: the dispatch mode was removed from the stack.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from cuda_agent.tensors import foreign_object, tensors_in


class RuleBroken(Exception):
    """The candidate broke a rule of the harness; ``rule`` names which one."""

    def __init__(self, rule: str, message: str):
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


# ATen operators a forward may run: allocation, views, metadata and scalar
# reads. Everything else is computation that the candidate's kernels must do.
ALLOWED_ATEN = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "zeros", "zeros_like", "new_zeros",
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "permute", "transpose", "t",
    "unsqueeze", "squeeze", "select", "slice", "narrow", "detach", "alias", "unbind", "split",
    "split_with_sizes", "unflatten", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
})


def _op_name(func: Any) -> str:
    # "aten.relu.default" -> "relu"; overload packets carry their own name.
    packet = getattr(func, "overloadpacket", func)
    return getattr(packet, "__name__", str(func)).split(".")[-1]


def _allowed(name: str, allowed: frozenset[str]) -> bool:
    namespace, _, short = name.partition("::")  # the profiler's "aten::relu"
    return short in allowed or f"{namespace}.{short}" in allowed


def composite_only(name: str) -> bool:
    """Whether every overload of operator ``name`` ("aten::reshape") is a composite of others
    (CompositeImplicitAutograd): recorded with nothing below it, such an operator ran nothing
    (``contiguous`` of a contiguous tensor returns it)."""
    import torch

    namespace, _, short = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), short)
        names = [getattr(packet, overload).name() for overload in packet.overloads()]
    except (AttributeError, RuntimeError):
        return False
    composite = []
    for qualified in names:
        try:
            composite.append(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd"))
        except RuntimeError:  # TorchScript-only overloads (aten::to.prim_Device) are not in the dispatcher
            continue
    return bool(composite) and all(composite)


def unlisted_aten(ops: Iterable[tuple[str, Any]], allowed: frozenset[str],
                  composite: Callable[[str], bool] = composite_only) -> dict[str, int]:
    """ATen operators that computed, with counts, in a profiled call's operator tree (``(name,
    children)`` nodes, outermost first, as ``evaluate.worker.profiling.profile_call`` records them).

    The profiler records each operator where the dispatcher is entered, so composites appear
    above what they run. An allowed operator's subtree is its own business (``zeros_like`` fills);
    any other ATen operator with a kernel of its own computes; a ``composite`` (which the dispatch
    mode never sees either), a custom op or a range is looked through (``reshape`` is views,
    ``softmax`` runs ``_softmax``).
    """
    seen: dict[str, int] = {}

    def visit(name: str, children: Any) -> None:
        if name.startswith("aten::"):
            if _allowed(name, allowed):
                return
            if not composite(name):
                seen[name] = seen.get(name, 0) + 1
                return
        for child in children:
            visit(*child)

    for node in ops:
        visit(*node)
    return seen


def _make_monitor_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class ComputeMonitor(TorchDispatchMode):
        """Records every ATen operator outside the allowlist that runs under it."""

        def __init__(self, allowed: frozenset[str]):
            super().__init__()
            self.allowed = allowed
            self.seen: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not _allowed(f"{func.namespace}::{_op_name(func)}", self.allowed):
                self.seen[str(func)] = self.seen.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    return ComputeMonitor


def _dispatch_mode_stack() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


# -- memory ---------------------------------------------------------------------------
def _span(tensor: Any) -> tuple[str, int, int] | None:
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    if storage.nbytes() == 0 or start == 0:
        return None
    return tensor.device.type, start, start + storage.nbytes()


def require_plain_output(output: Any, what: str) -> None:
    """``output-type`` where ``output`` holds anything but exact tensors in plain containers (``foreign_object``: its
    types alone are asked, so none of its code runs); ``what`` names it in the reason."""
    foreign = foreign_object(output)
    if foreign is not None:
        raise RuleBroken("output-type", f"{what} is a {foreign}: outputs must be plain torch.Tensor (in plain lists, "
                         "tuples or dicts)")


def find_overlap(outputs: Any, others: dict[str, Any]) -> str | None:
    """The label of the first tensor in ``others`` whose memory an output shares."""
    spans = [(label, s) for label, t in others.items() if (s := _span(t)) is not None]
    for out in tensors_in(outputs):
        mine = _span(out)
        if mine is None:
            continue
        for label, (device, start, end) in spans:
            if device == mine[0] and start < mine[2] and mine[1] < end:
                return label
    return None


# -- threads and processes ------------------------------------------------------------
def native_threads() -> dict[int, str]:
    """Thread id -> name for every thread of this process (Linux)."""
    threads = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    threads[int(tid)] = f.read().strip()
            except OSError:
                pass
    except OSError:
        pass
    return threads


def child_processes() -> list[int]:
    children: list[int] = []
    for tid in native_threads():
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                children += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    return children


# Threads the CUDA driver and runtime start on first use; anything else that
# appears during a forward was started by the candidate.
_RUNTIME_THREAD_PREFIXES = ("cuda", "pt_", "nvidia", "cupti")


# -- identities of the functions the harness trusts -----------------------------------
def _harness_functions(trusted: Mapping[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """Getters of the functions the harness relies on, by the name a ``monkeypatch`` verdict
    reports, in the order they are checked: the standard library's, ``trusted`` (the caller's
    own, such as the evaluation core's timing and output functions, which this layer cannot
    import), then torch's."""
    import json

    import torch
    from torch.utils import _python_dispatch

    return {
        "time.perf_counter": lambda: time.perf_counter,
        "time.perf_counter_ns": lambda: time.perf_counter_ns,
        "time.time": lambda: time.time,
        "time.monotonic": lambda: time.monotonic,
        "statistics.median": lambda: statistics.median,
        "statistics.fmean": lambda: statistics.fmean,
        "statistics.pstdev": lambda: statistics.pstdev,
        "math.ceil": lambda: math.ceil,
        "json.dumps": lambda: json.dumps,
        "json.loads": lambda: json.loads,
        **trusted,
        "torch.Tensor.zero_": lambda: torch.Tensor.zero_,
        "torch.cuda.synchronize": lambda: torch.cuda.synchronize,
        "torch.cuda.Event": lambda: torch.cuda.Event,
        "torch.cuda.Event.record": lambda: torch.cuda.Event.record,
        "torch.cuda.Event.elapsed_time": lambda: torch.cuda.Event.elapsed_time,
        "torch.cuda.Event.synchronize": lambda: torch.cuda.Event.synchronize,
        "torch.profiler.profile": lambda: torch.profiler.profile,
        "torch.no_grad": lambda: torch.no_grad,
        # Input generation: both processes must draw the same inputs from the same seeds.
        # torch.random's own function: importing torch._dynamo rebinds torch.manual_seed to a
        # wrapper, and importing dynamo before the snapshot takes seconds.
        "torch.random.manual_seed": lambda: torch.random.manual_seed,
        "torch.randn": lambda: torch.randn,
        "torch.rand": lambda: torch.rand,
        "torch.randint": lambda: torch.randint,
        "torch.Tensor.normal_": lambda: torch.Tensor.normal_,
        "torch.Tensor.uniform_": lambda: torch.Tensor.uniform_,
        "torch.utils._python_dispatch.TorchDispatchMode": lambda: _python_dispatch.TorchDispatchMode,
    }


L2_LIMIT_FLAG = "CUDA persisting-L2 limit (bytes)"


def _global_flags() -> dict[str, Any]:
    import torch

    readers: dict[str, Callable[[], Any]] = {
        "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
        "torch.backends.cudnn.benchmark": lambda: torch.backends.cudnn.benchmark,
        "torch.backends.cudnn.deterministic": lambda: torch.backends.cudnn.deterministic,
        "torch.backends.cudnn.enabled": lambda: torch.backends.cudnn.enabled,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.get_default_dtype()": lambda: str(torch.get_default_dtype()),
        "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled,
    }
    if torch.cuda.is_initialized():
        from cuda_agent.guard.device_state import persisting_l2_limit

        readers[L2_LIMIT_FLAG] = persisting_l2_limit
    flags: dict[str, Any] = {}
    for name, read in readers.items():
        try:
            flags[name] = read()
        except Exception as exc:  # noqa: BLE001 - torch refuses to read some flags once they were set inconsistently
            flags[name] = f"unreadable ({type(exc).__name__})"
    return flags


@dataclass
class HarnessSnapshot:
    """What the harness relies on, taken before any candidate code runs."""

    functions: dict[str, Any]
    flags: dict[str, Any]
    trusted: dict[str, Callable[[], Any]] = field(default_factory=dict)  # the caller's own getters

    @classmethod
    def take(cls, trusted: Mapping[str, Callable[[], Any]] | None = None) -> "HarnessSnapshot":
        trusted = dict(trusted or {})
        return cls({name: get() for name, get in _harness_functions(trusted).items()}, _global_flags(), trusted)

    def verify(self, when: str) -> None:
        for name, get in _harness_functions(self.trusted).items():
            if get() is not self.functions[name]:
                raise RuleBroken("monkeypatch", f"{name} was replaced {when}")
        flags = _global_flags()
        for name, value in self.flags.items():
            if flags.get(name) != value:
                rule = "l2-persistence" if name == L2_LIMIT_FLAG else "global-flag"
                raise RuleBroken(rule, f"{name} changed from {value!r} to {flags.get(name)!r} {when}")


# -- one watched call -------------------------------------------------------------------
class CallGuard:
    """Watches calls of ``ModelNew.forward``; one per candidate process.

    ``watch(fn)`` runs ``fn`` under the compute monitor and checks what it
    left behind; ``check_output`` checks the memory of what it returned.
    ``trusted``: getters of the caller's own functions whose identities the
    harness snapshot holds too (``evaluate.worker.call_guard`` passes the timing and
    output functions).
    """

    def __init__(self, allowed_aten: Iterable[str] = (), trusted: Mapping[str, Callable[[], Any]] | None = None):
        self.allowed = ALLOWED_ATEN | frozenset(allowed_aten)
        self.snapshot = HarnessSnapshot.take(trusted)
        self.known_threads = native_threads()
        self._monitor_class = _make_monitor_class()
        self._previous: list[Any] = []

    def verify_harness(self, when: str) -> None:
        self.snapshot.verify(when)

    def trust_new_threads(self) -> None:
        """Count the threads alive now as the harness's (the profiler starts some). Safe between
        watched calls: a thread the candidate started was reported at the end of its call."""
        self.known_threads = native_threads()

    def watch(self, fn: Callable[[], Any], sync: Callable[[], None], monitor: bool = True) -> Any:
        """Run ``fn`` (a forward call) and check what it left running; with ``monitor``, under the
        dispatch mode that fails torch computation. Without it the call looks like a timed one from
        inside, and the profiled call checks its operators instead (``check_profiled_ops``)."""
        python_threads = set(threading.enumerate())
        if monitor:
            mode = self._monitor_class(self.allowed)
            with mode:
                output = fn()
                stack_inside = _dispatch_mode_stack()
            sync()
            if not any(entry is mode for entry in stack_inside):
                raise RuleBroken("guard-tamper", "the torch dispatch mode watching forward was removed during the call")
            self._refuse_compute(mode.seen, "")
        else:
            output = fn()
            sync()
        self._check_left_running(python_threads, "after forward returned")
        return output

    def check_profiled_ops(self, ops: Iterable[tuple[str, Any]]) -> None:
        """The profiled call's operator tree (``evaluate.worker.profiling.CallProfile.ops``) against the allowlist."""
        self._refuse_compute(unlisted_aten(ops, self.allowed), " (seen by the profiler)")

    @staticmethod
    def _refuse_compute(seen: Mapping[str, int], how: str) -> None:
        if seen:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(seen.items()))
            raise RuleBroken("torch-compute", f"forward ran torch operators instead of its own kernels{how}: {ops}")

    def _check_left_running(self, python_threads: set[threading.Thread], when: str) -> None:
        extra = [t for t in threading.enumerate() if t not in python_threads and t.is_alive()]
        if extra:
            raise RuleBroken("thread", f"Python thread(s) left running {when}: {', '.join(t.name for t in extra)}")
        started = {tid: name for tid, name in native_threads().items()
                   if tid not in self.known_threads and not name.startswith(_RUNTIME_THREAD_PREFIXES)}
        if started:
            names = ", ".join(sorted(set(started.values())))
            raise RuleBroken("thread", f"{len(started)} native thread(s) left running {when} ({names})")
        children = child_processes()
        if children:
            raise RuleBroken("subprocess", f"{len(children)} child process(es) left running {when}")

    def watch_quiet(self, fn: Callable[[], Any], when: str) -> Any:
        """Run trusted-but-hosting code (the candidate's import) and check nothing was left running."""
        python_threads = set(threading.enumerate())
        output = fn()
        self._check_left_running(python_threads, when)
        return output

    def check_output(self, output: Any, inputs: list[Any], model: Any) -> None:
        """Type and memory of a checked call's output, including reuse of the previous call's."""
        self.check_output_memory(output, inputs, model)
        hit = find_overlap(output, {f"output of the previous call ({i})": t for i, t in enumerate(self._previous)})
        if hit:
            raise RuleBroken("output-reuse", f"an output shares memory with the {hit}; every call must return new tensors")
        self._previous = list(tensors_in(output))

    def check_output_memory(self, output: Any, inputs: list[Any], model: Any) -> None:
        import torch

        require_plain_output(output, "an output")
        for leaf in tensors_in(output):
            # A storage an allocator made can be resized; one wrapped around memory from elsewhere
            # (torch::from_blob, DLPack) cannot, and such memory can be anything: pages filled only when
            # read, a buffer written after the call returned.
            if not leaf.untyped_storage().resizable():
                raise RuleBroken("output-memory", "an output's memory was not allocated by torch (torch::from_blob or "
                                                  "an external buffer); allocate outputs with torch::empty or "
                                                  "torch::empty_like")
        others: dict[str, Any] = {f"input {i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        others |= {f"parameter {n}": p for n, p in model.named_parameters()}
        others |= {f"buffer {n}": b for n, b in model.named_buffers()}
        hit = find_overlap(output, others)
        if hit:
            raise RuleBroken("output-alias", f"an output shares memory with {hit}; outputs must be freshly allocated")
