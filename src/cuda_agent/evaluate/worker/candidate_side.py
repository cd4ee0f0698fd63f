"""The candidate worker (``--role candidate``): the task module first, then the candidate's extension and
``model_new.py``; from then on nothing in this process is the harness's alone (docs/SECURITY.md). It runs
the checked calls and the timed rounds, on inputs it regenerates from seeds it learns at call time."""

from __future__ import annotations

import importlib.util
import secrets
import socket
import sys
import types
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.worker.call_guard import CallGuard
from cuda_agent.evaluate.protocol.messages import LoadRequest, TimeRequest, parse_request
from cuda_agent.evaluate.protocol.outside import ITEMSIZE, describe
from cuda_agent.evaluate.protocol.regions import CHECK_REGION, Ringer
from cuda_agent.evaluate.worker.shared import SharedBuffer, SharedError
from cuda_agent.evaluate.worker.profiling import profile_call
from cuda_agent.evaluate.worker.transfer import TransferError, write_outputs
from cuda_agent.evaluate.worker.triton_runtime import prepare_triton
from cuda_agent.evaluate.protocol.vmm import VmmError, spans as vmm_spans
from cuda_agent.sandbox.nothreads import forbid_new_tasks
from cuda_agent.sandbox.process import receive_fd
from cuda_agent.guard.integrity import (
    allocator_slots, driver_slots, harness_native_functions, native_slots, vdso_slots,
)
from cuda_agent.guard.runtime import RuleBroken, find_overlap
from cuda_agent.tensors import tensors_in

from cuda_agent.evaluate.worker.side import _Side, fingerprint, seed_everything, synchronize

HELD = 1  # recorded timed calls whose outputs stay alive to the end (a reservoir over all of them)



class CandidateSide(_Side):
    guard: CallGuard

    def __init__(self) -> None:
        # Timed calls whose outputs stay alive until the end: the latest (it may turn out to be the last,
        # which is checked whole: its inputs and output) and the outputs of HELD recorded calls chosen
        # at random (a reservoir over all), so that an output handed out twice shows as shared memory.
        # For the largest KernelBench tasks each input or output is 6 GiB.
        self.latest: dict[str, Any] | None = None
        self.held: dict[int, dict[str, Any]] = {}
        self.recorded = 0
        self.code_lock = "not asked"  # "on", or why not (sandbox.nocode), reported with "ready"
        self.gpu_export = "not a GPU"  # "on", or why its GPU memory cannot be read from outside (evaluate.protocol.vmm)
        self.ban_threads = False  # asked by the evaluator (worker.main): no new thread or process once its code loads
        self.thread_ban = "not asked"  # "on", or why not (sandbox.nothreads), reported with "load"
        self.checked_output: Any = None  # a checked call's output the reference copies out (RunRequest.outside)

    def handle(self, op: str, msg: Any) -> dict[str, Any]:
        """Answer request ``op``: its dataclass (``protocol.REQUESTS``), or a dict it is parsed from."""
        import torch

        msg = parse_request(op, msg)
        self.checked_output = None  # copied out before the evaluator asks anything more
        if op == "ready":
            if msg.bell:
                if self.fd_socket is None:
                    raise ValueError("'ready' with bell: no descriptor channel")
                self.ringer = Ringer(socket.socket(fileno=receive_fd(self.fd_socket, 30)))
            cuda = torch.cuda.is_initialized()
            # Data pointers too: the allocators (on a GPU the caching allocator as well) and the C
            # library's clocks, on both backends alike; on a GPU the runtime's pointers to the driver.
            data = allocator_slots(cuda) | vdso_slots() | (driver_slots() if cuda else {})
            return {"slots": native_slots(harness_native_functions(cuda)) | data, "code_lock": self.code_lock,
                    "gpu_export": self.gpu_export}
        if op == "load":
            # The task program runs first, before any candidate code can touch torch;
            # the guard's snapshot of the harness is taken before candidate code too.
            bell_ms, bell_tail_ms = None, 0.0
            try:
                self.load_task(msg)
                if msg.bell_regions and self.ringer is not None:
                    bell_ms, bell_tail_ms = self.bell_calibration(msg)
            except BaseException:
                if msg.bell_regions and self.ringer is not None:
                    self.ringer.fail(0xFFFFFFFF)  # the evaluator waits for brackets no more: this reply says why
                raise
            triton = None
            if msg.language == "triton":
                # Triton's own start-up (on a GPU it runs the C compiler and asks tools their versions) is the
                # harness's, before the ban and before the guard's snapshot.
                triton = prepare_triton(self.device, msg.triton_kernels)
            self.guard = CallGuard(msg.allowed_aten or ())
            if self.ban_threads:
                # The last moment before the candidate's code: the task program and the no-op regions have
                # run, every thread the harness needs is running (worker.warm_up_runtime, on a GPU the
                # driver's since its context was made). From here a new thread or process ends this process.
                self.thread_ban = forbid_new_tasks() or "on"
            self.guard.watch_quiet(lambda: self._load_candidate(msg), "while model_new.py was imported")
            self.guard.verify_harness("while model_new.py was imported")
            reply = {"thread_ban": self.thread_ban} | ({"triton": triton} if triton else {})
            return reply | ({"bell_ms": bell_ms, "bell_tail_ms": bell_tail_ms} if bell_ms is not None else {})
        if op == "weights":
            # A separate step so the candidate can load while the reference still builds Model.
            state = torch.load(msg.state_dict_path, weights_only=True)
            try:
                self.model.load_state_dict(state, strict=True)
            except RuntimeError as exc:
                raise RuleBroken("state-dict", f"state dict of Model does not load into ModelNew: {exc}") from None
            self.model = self.model.to(self.device).eval()
            return {}
        if op == "run":
            inputs = self.inputs(msg.seed)
            prints = fingerprint(inputs)
            kernels = None

            def forward(monitor: bool = True) -> Any:
                return self.guard.watch(lambda: self.model(*inputs), lambda: synchronize(self.device), monitor)

            with torch.no_grad():
                if msg.profile:
                    # One of the checked calls, chosen in secret: its output is compared like any other. No
                    # dispatch mode: code that keys on it to run torch when unwatched runs torch here, where
                    # the profiler sees its operators.
                    output, profiled = profile_call(lambda: forward(monitor=False), self.device,
                                                    on_start=self.guard.trust_new_threads)
                    self.guard.check_profiled_ops(profiled.ops)
                    kernels = profiled.kernels if self.device == "cuda" else None
                else:
                    output = forward()
            self.guard.check_output(output, inputs, self.model)
            if fingerprint(inputs) != prints:
                raise RuleBroken("input-mutation", "forward changed the values of its inputs")
            self.guard.verify_harness("during forward")
            if msg.outside and self.exporter is not None and self.ringer is not None:
                reply = {"fingerprint": prints, "manifest": {}, "described": self._export_checked(output)}
            else:
                reply = {"fingerprint": prints, "manifest": self._write(output, Path(msg.dir))}
            return reply | ({"kernels": kernels} if kernels is not None else {})
        if op == "calibrate":
            warmup = self.calibrate(self.model, msg, self.launch("candidate"))
            self.guard.verify_harness("during warm-up")
            return {"estimate_ms": warmup.estimate_ms, "call_ms": warmup.call_ms}
        if op == "time":
            try:
                return self.time(msg)
            except BaseException:
                if msg.bell and self.ringer is not None:
                    self.ringer.fail(0xFFFFFFFF)
                raise
        if op == "timed":
            return {"checked": self.timed()}
        if op == "output":
            entry = self.latest
            if entry is None or entry["index"] != msg.index:
                raise RuleBroken("harness", f"timed call {msg.index} was not kept")
            # Asked once, last: what the timed calls kept (GBs for the largest tasks) goes once written.
            self.latest, self.held = None, {}
            return {"manifest": self._write(entry["output"], Path(msg.dir))}
        if op == "attach":
            return self.attach(msg)
        raise ValueError(f"unknown request {op!r}")

    def load_unguarded(self, msg: LoadRequest) -> None:
        """After ``load_task``: the candidate without the guard, for the counters' profile run (advice
        that never enters a reward; ``counters_target``)."""
        self._load_candidate(msg)
        self.model = self.model.to(self.device).eval()

    def _load_candidate(self, msg: LoadRequest) -> None:
        if msg.model_new_file is None:
            raise ValueError("'load' request: the candidate needs the field 'model_new_file'")
        modules = {name: load_extension(name, path) for name, path in (msg.modules or {}).items()}
        install_inline_shim(modules)
        namespace = load_model_new(Path(msg.model_new_file))
        if not hasattr(namespace, "ModelNew"):
            raise RuleBroken("interface", "model_new.py defines no ModelNew")
        seed_everything(msg.init_seed)
        self.model = namespace.ModelNew(*self.init_args)

    def time(self, msg: TimeRequest) -> dict[str, Any]:
        """One round of timed calls, fresh inputs for every call (drawn outside the timed region). Every
        call is handled alike: which ones are checked is decided after all rounds, from the records
        sent back with each round, so no call can be told apart as a checked one."""
        chooser = secrets.SystemRandom()
        final = msg.first + msg.trials * msg.calls - 1

        def on_record(index: int, inputs: list[Any], output: Any) -> None:
            if index == final:
                return  # kept anyway as the latest; held, it would be compared with nothing but itself
            self.recorded += 1
            if len(self.held) >= HELD and chooser.randrange(self.recorded) >= HELD:
                return
            # Checked against its inputs now, so that only the output need stay alive.
            self.guard.check_output_memory(output, inputs, self.model)
            entry = {"index": index, "output": output}
            if len(self.held) >= HELD:
                self.held.pop(chooser.choice(list(self.held)))
            self.held[index] = entry

        # The previous round's last call was not the last: its tensors (GBs for some tasks) go now.
        self.latest = self.final_call = None
        host = self.launch("candidate", fixed_us=msg.hold_us)
        samples, records = self.time_calls(self.model, msg, on_record, host)
        index, inputs, box = self.final_call
        self.latest = {"index": index, "inputs": inputs} | ({"output": box["output"]} if "output" in box else {})
        self.guard.verify_harness("during timing")
        return {"samples": samples, "records": records, "host": host.report()}

    def timed(self) -> list[dict[str, Any]]:
        """After the last round: the last call's inputs unchanged, and the outputs kept (the last call's,
        the held ones') their own memory."""
        entry = self.latest
        if entry is None or "output" not in entry:
            raise RuleBroken("harness", "the last timed call did not run")
        others = {f"the output of timed call {j}": t for j, other in self.held.items() if j != entry["index"]
                  for t in tensors_in(other["output"])}
        hit = find_overlap(entry["output"], others)
        if hit:
            raise RuleBroken("output-reuse", f"a timed output shares memory with {hit}")
        for held in self.held.values():
            self.guard.check_output_memory(held["output"], [], self.model)  # its inputs: when it was held
        self.guard.check_output_memory(entry["output"], entry["inputs"], self.model)
        return [{"index": entry["index"], "fingerprint": fingerprint(entry["inputs"])}]

    def attach(self, msg: Any) -> dict[str, Any]:
        """Map the memory the reference shared; without it, outputs go through files."""
        if self.fd_socket is None:
            return {"attached": False, "reason": "no descriptor channel"}
        try:
            fd = receive_fd(self.fd_socket, 30)
            self.shared = SharedBuffer.attach(fd, int(msg.bytes), self.device)
        except (OSError, SharedError) as exc:
            return {"attached": False, "reason": f"{type(exc).__name__}: {exc}"}
        return {"attached": True, "pinned": self.shared.pinned}

    def _export_checked(self, output: Any) -> dict[str, Any]:
        """A checked call's output described, and the allocations it lies in that were not sent before sent through
        the brackets, for the reference to copy it out of them; it stays alive until the next request."""
        self.checked_output = output
        described = describe(0, output, [])
        try:
            chunks, fds, looked_up = self.exporter.export(vmm_spans([described], ITEMSIZE))
        except VmmError as exc:
            self.ringer.chunks_failed(CHECK_REGION, str(exc))
        else:
            self.ringer.chunks(CHECK_REGION, chunks, fds, looked_up)
        return described

    def _write(self, output: Any, directory: Path) -> dict[str, Any]:
        try:
            return write_outputs(output, directory, self.shared)
        except TransferError as exc:
            raise RuleBroken("output-type", str(exc)) from None


def load_extension(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuleBroken("harness", f"cannot load the built extension {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def install_inline_shim(modules: dict[str, types.ModuleType]) -> None:
    """Answer ``load_inline(name=...)`` with the module we built from the same sources."""
    from torch.utils import cpp_extension

    def load_inline(name: str, *args: Any, **kwargs: Any) -> types.ModuleType:
        if name not in modules:
            raise RuleBroken("harness", f"load_inline({name!r}) was not found when the sources were read statically")
        return modules[name]

    cpp_extension.load_inline = load_inline


def load_model_new(path: Path) -> types.ModuleType:
    module = types.ModuleType("model_new")
    module.__file__ = str(path)
    sys.modules["model_new"] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102
    return module


