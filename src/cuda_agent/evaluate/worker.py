"""Entry point of the two evaluation processes (``python -m cuda_agent.evaluate.worker``).

``--role reference`` runs only the pristine task program: it writes the state
dict, times the baselines and holds the expected outputs, which never leave it.
``--role candidate`` imports the candidate's code and runs it on inputs it
regenerates from seeds it learns only at call time. Requests and replies are
JSON lines on private pipes; whatever the code under test prints goes to the
captured stdout/stderr instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import secrets
import socket
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.call_guard import CallGuard
from cuda_agent.evaluate.compare import compare_outputs, precision_allowance
from cuda_agent.evaluate.policy import TimingConfig
from cuda_agent.evaluate.protocol import (REQUESTS, CalibrateRequest, CompareRequest, CompileRequest,
                                          DegenerateRequest, ExpectRequest, LoadRequest, RecordsRequest, TimeRequest,
                                          parse_request)
from cuda_agent.evaluate.outside import describe
from cuda_agent.evaluate.records import RECORDED_PER_REGION, Recorder, compare_record, same_outputs, sample_output
from cuda_agent.evaluate.regions import Ringer, encode_calls
from cuda_agent.evaluate.shared import SharedBuffer, SharedError
from cuda_agent.evaluate.timing import HostLaunch, calibrate, profile_call, time_round, trial_seed
from cuda_agent.evaluate.transfer import TransferError, manifest_devices, packed_bytes, read_outputs, write_outputs
from cuda_agent.sandbox.process import receive_fd, send_fd
from cuda_agent.guard.integrity import (
    allocator_slots, driver_slots, harness_native_functions, native_slots, vdso_slots,
)
from cuda_agent.sandbox.nocode import LOCK_CODE_ENV, forbid_new_code
from cuda_agent.guard.runtime import RuleBroken, find_overlap
from cuda_agent.tensors import tensors_in, wide_squares, wide_sum
from cuda_agent.tasks.task import Task, TaskError, describe_inputs, exec_task_module


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.random.manual_seed(seed)  # seeds CUDA too; unaffected by torch._dynamo's rebinding of torch.manual_seed


def pin_precision(tf32: str) -> None:
    """Set the precision flags for a ``Policy.tf32`` mode: off, torch (torch's defaults) or on."""
    import torch

    matmul = tf32 == "on"
    torch.backends.cuda.matmul.allow_tf32 = matmul
    torch.backends.cudnn.allow_tf32 = tf32 != "off"
    torch.backends.cudnn.benchmark = False
    torch.set_float32_matmul_precision("high" if matmul else "highest")


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def make_inputs(module: types.ModuleType, seed: int, device: str, source: str) -> list[Any]:
    """``get_inputs()`` under ``seed``, created on ``device`` (fast for large inputs, and
    identical in both processes because both use the same generator on the same device)."""
    import torch

    seed_everything(seed)
    with torch.device(device):
        values = module.get_inputs()
    values = describe_inputs(values, source, "get_inputs")
    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def init_inputs(module: types.ModuleType, seed: int, source: str) -> list[Any]:
    seed_everything(seed)
    values = module.get_init_inputs()
    if not isinstance(values, (list, tuple)):
        raise TaskError(f"{source}: get_init_inputs() must return a list, got {type(values).__name__}.")
    return list(values)


def fingerprint(values: list[Any]) -> list[Any]:
    """A cheap summary that tells whether both processes saw the same inputs."""
    import torch

    prints: list[Any] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            data = value.detach()
            if data.is_complex():
                data = data.abs()
            # A piece at a time: no float64 copy of a GB-sized input (tensors.PIECE).
            prints.append([list(data.shape), str(value.dtype), wide_sum(data), wide_squares(data)])
        else:
            prints.append(repr(value))
    return prints


HELD = 1  # recorded timed calls whose outputs stay alive to the end (a reservoir over all of them)


class _Side:
    device = "cpu"
    task_module: types.ModuleType
    model: Any
    source = "task"
    fd_socket: socket.socket | None = None  # descriptors to and from the evaluator
    ringer: Ringer | None = None  # this worker's end of the region brackets (evaluate.regions)
    final_call: tuple[int, list[Any], dict[str, Any]] | None = None  # the latest round's last call
    shared: SharedBuffer | None = None  # where outputs are handed over, once shared

    def load_task(self, msg: LoadRequest) -> None:
        self.device = msg.device
        self.tf32 = msg.tf32
        pin_precision(self.tf32)
        task = Task(name=msg.task_name, code=Path(msg.task_file).read_text(), source=msg.task_source)
        self.source = task.source
        self.task_module = exec_task_module(task)
        self.init_args = init_inputs(self.task_module, msg.init_seed, task.source)

    def inputs(self, seed: int) -> list[Any]:
        return make_inputs(self.task_module, seed, self.device, self.source)

    def launch(self, side: str, adaptive: bool = False, fixed_us: float | None = None,
               first_call: bool = False) -> HostLaunch:
        """What the host takes to enqueue ``side``'s calls, learned over this process's warm-ups and
        rounds (``timing.HostLaunch``), with the hold this request asks for."""
        launches: dict[str, HostLaunch] = self.__dict__.setdefault("launches", {})
        host = launches.setdefault(side, HostLaunch())
        host.adaptive, host.fixed_us, host.first_call = adaptive, fixed_us, first_call
        return host

    def calibrate(self, fn: Any, msg: CalibrateRequest, host: HostLaunch | None = None) -> float:
        """Warm ``fn`` up on fresh inputs from ``msg.seed``; its wall time per call (ms)."""
        import torch

        drawn: list[Any] = [None, 0]  # the inputs of the next call, and how many calls were drawn

        def setup() -> None:
            drawn[0] = None  # the previous draw's memory may be reused, as between real calls
            drawn[0] = self.inputs(trial_seed(msg.seed, drawn[1]))
            drawn[1] += 1

        with torch.no_grad():
            return calibrate(lambda: fn(*drawn[0]), self.device, TimingConfig.from_dict(msg.timing), setup, host)

    def time_calls(self, fn: Any, msg: TimeRequest, on_record: Any = None, host: HostLaunch | None = None,
                   fence: bool = True) -> tuple[list[float], list[dict[str, Any]]]:
        """One round: ``msg.trials`` regions of ``msg.calls`` calls of ``fn``, call ``first + i``
        on the inputs of ``trial_seed(seed, first + i)``. Right after each region ends, up to
        ``RECORDED_PER_REGION`` of its calls, chosen then, are recorded (``evaluate.records``);
        ``on_record(index, inputs, output)`` sees each. Returns the samples and the records."""
        import torch

        last = msg.first + msg.trials * msg.calls - 1
        count = iter(range(msg.first, last + 1))
        # No probe (read from outside, or a round nobody checks): nothing is recorded in this process.
        recorder = Recorder(msg.probe) if msg.probe is not None else None
        keys: dict[str, list[Any]] = self.__dict__.setdefault("record_keys", {})
        if recorder is not None:
            recorder.prime(keys.get(msg.side or "", []))
        region: list[tuple[int, list[Any], dict[str, Any]]] = []
        chooser = secrets.SystemRandom()

        def prepare() -> Any:
            index = next(count)
            inputs = self.inputs(trial_seed(msg.seed, index))
            box: dict[str, Any] = {}
            region.append((index, inputs, box))

            def call() -> None:
                box["output"] = fn(*inputs)
            return call

        def after_end() -> bytes | None:
            # Described for the evaluator's reads from outside: the region's calls stay alive (the timing
            # loop holds them) until the evaluator says CONT.
            payload = encode_calls([describe(index, box.get("output"), inputs) for index, inputs, box in region]) \
                if msg.outside else None
            if recorder is not None:
                for index, inputs, box in chooser.sample(region, min(len(region), RECORDED_PER_REGION)):
                    recorder.record(index, box.get("output"), inputs)
                    if on_record:
                        on_record(index, inputs, box.get("output"))
            # Only the round's very last call outlives its region: for the largest KernelBench tasks
            # each call is a 6 GiB input and output, and the next region draws its inputs next.
            if region[-1][0] == last:
                self.final_call = region[-1]
            region.clear()
            return payload

        # A round that raises says FAIL on the brackets where it is handled (CandidateSide.handle).
        with torch.no_grad():
            samples = time_round(prepare, self.device, TimingConfig.from_dict(msg.timing), msg.trials, msg.calls,
                                 after_end, host, fence, self.ringer if msg.bell else None)
        synchronize(self.device)
        if recorder is None:
            return samples, []
        keys[msg.side or ""] = recorder.keys()
        return samples, recorder.finish()

    def bell_calibration(self, msg: LoadRequest) -> list[float]:
        """No-op regions through the brackets, on the task's own input draws, before any candidate code:
        what the brackets add to a region in this process (``regions.Overhead``)."""
        import torch

        marker = torch.zeros(1, device=self.device)
        outside = self.device == "cpu"
        # Where the rounds record their calls in this process (GPU), these regions record theirs too: the
        # records' gathers are inside every bracket, and so in what the brackets are found to cost.
        request = TimeRequest(seed=msg.bell_seed, first=0, trials=msg.bell_regions, calls=1,
                              timing=msg.timing or TimingConfig().to_dict(), hold_us=msg.bell_hold_us, bell=True,
                              outside=outside, probe=None if outside else msg.bell_seed)
        return self.time_calls(lambda *args: marker, request, host=self.launch("bell", fixed_us=msg.bell_hold_us))[0]


class ReferenceSide(_Side):
    expected: Any = None
    kept: Any = None  # a candidate output sampled with keep=True, for the next sample to be compared with
    allowance = 1.0  # factor on the tolerance for the expected output held now
    compiled: dict[str, Any] | None = None  # torch.compile(Model) (or its error) and its compile time
    output_specs: list[tuple[Any, Any, Any]] = []  # (shape, dtype, device) of the Model's output tensors

    def handle(self, op: str, msg: Any) -> dict[str, Any]:
        """Answer request ``op``: its dataclass (``protocol.REQUESTS``), or a dict it is parsed from."""
        import torch

        msg = parse_request(op, msg)
        if op == "load":
            self.load_task(msg)
            seed_everything(msg.init_seed)
            model = self.task_module.Model(*self.init_args)
            if not isinstance(model, torch.nn.Module):
                raise TaskError(f"{self.source}: Model(...) is not a torch.nn.Module.")
            torch.save(model.state_dict(), msg.state_dict_path)
            self.model = model.to(self.device).eval()
            info = {}
            if self.device == "cuda":
                info["gpu"] = torch.cuda.get_device_name()
            if msg.warm is not None:
                # One expected output, computed and dropped: the first forward in a process (kernels
                # loaded, libraries started) costs seconds, here at once with the candidate's load.
                # Its size is the size of the memory the outputs are handed over in.
                self.handle("expect", msg.warm)
                info["share"] = self.share()
                self.expected = None
            return {"parameters": sum(p.numel() for p in model.parameters())} | info
        if op == "compile":
            return self.compile(msg)
        if op == "calibrate":
            host = self._launch(msg)
            return {"estimate_ms": self.calibrate(self._baseline(msg.side), msg, host), "host_us": host.per_call_us}
        if op == "time":
            host = self._launch(msg)
            # torch's own calls leave nothing running past the end event: no fence to judge them by. The
            # empty round stands for the candidate's harness time, fence measurements included.
            samples = self.time_calls(self._baseline(msg.side), msg, host=host, fence=msg.side == "empty")[0]
            if msg.side == "empty" and self.device == "cuda":
                torch.cuda.empty_cache()  # its outputs were never the Model's: hold no memory for them
            return {"samples": samples, "host": host.report()}
        if op == "records":
            return {"verdicts": self.check_records(msg)}
        if op == "expect":
            inputs = self.inputs(msg.seed)
            self.expected = self.forward(inputs, msg.strict)
            self.allowance = self.precision_allowance(inputs, msg) if msg.strict else 1.0
            self.output_specs = [(t.shape, t.dtype, t.device) for t in tensors_in(self.expected)]
            output_bytes = sum(t.numel() * t.element_size() for t in tensors_in(self.expected))
            return {"fingerprint": fingerprint(inputs), "output_bytes": output_bytes, "allowance": self.allowance}
        if op == "release":
            # Stay alive for the checks of timed outputs, holding as little as possible.
            self.expected = self.kept = None
            if self.device == "cuda":
                torch.cuda.empty_cache()
                return {"reserved": torch.cuda.memory_reserved()}
            return {"reserved": 0}
        if op == "compare":
            return {"reports": self.compare(msg)}
        if op == "sample":
            kept, self.kept = self.kept, None
            try:
                actual = read_outputs(msg.manifest, Path(msg.dir), self.device, self.shared)
            except TransferError as exc:
                return {"outputs": [], "reason": f"unreadable output: {exc}"}
            reply = {"outputs": sample_output(actual, msg.probe)}
            if kept is not None:
                reply["same_as_kept"] = same_outputs(kept, actual)
            if msg.keep:
                self.kept = actual
            return reply
        if op == "degenerate":
            return self.degenerate(msg)
        raise ValueError(f"unknown request {op!r}")

    def share(self) -> dict[str, Any]:
        """Memory for the candidate's outputs, sized from the expected output held now, sent to
        the evaluator as a descriptor; the reason instead where it cannot be (files are used then)."""
        if self.fd_socket is None:
            return {"shared": False, "reason": "no descriptor channel"}
        nbytes = packed_bytes(self.expected)
        if nbytes == 0:
            return {"shared": False, "reason": "the output holds no tensor data"}
        try:
            self.shared = SharedBuffer.create(nbytes, self.device)
        except (OSError, SharedError) as exc:
            return {"shared": False, "reason": f"{type(exc).__name__}: {exc}"}
        send_fd(self.fd_socket, self.shared.fd)
        return {"shared": True, "bytes": nbytes, "pinned": self.shared.pinned}

    def precision_allowance(self, inputs: list[Any], msg: ExpectRequest) -> float:
        """How far the baselines' own arithmetic (this Model under the pinned flags) is from
        the strict truth, times the policy's slack, where that exceeds the tolerance."""
        import torch

        slack = msg.slack
        if not slack or self.tf32 == "off":
            return 1.0
        with torch.no_grad():
            own = self.model(*inputs)
        return precision_allowance(self.expected, own, msg.atol, msg.rtol, msg.scale, slack)

    def degenerate(self, msg: DegenerateRequest) -> dict[str, Any]:
        """Which trivial candidates pass: the constant is fitted on the first draw
        and tested, like the others, on the later ones."""
        import torch

        from cuda_agent.evaluate.degenerate import TRIVIAL_CANDIDATES, leaf_means, trivial_failures

        failed: dict[str, str] = {}
        constants: list[float] | None = None
        for seed in msg.seeds:
            inputs = self.inputs(seed)
            with torch.no_grad():
                expected = self.model(*inputs)
            if constants is None:
                constants = leaf_means(expected)
                continue
            for name, reason in trivial_failures(inputs, expected, constants, msg.atol, msg.rtol, msg.scale).items():
                if reason is not None:
                    failed.setdefault(name, reason)
        passing = [name for name in TRIVIAL_CANDIDATES if name not in failed]
        return {"passing": passing, "details": failed}

    def compare(self, msg: CompareRequest) -> list[dict[str, Any]]:
        # The directory is the candidate's; the evaluator deletes it (this process may not write there).
        expected, self.expected = self.expected, None
        claimed = manifest_devices(msg.manifest)
        wanted = [t.device.type for t in tensors_in(expected)]
        if claimed != wanted:
            return [{"path": "output", "ok": False, "reason": f"output devices {claimed} != expected {wanted}"}]
        try:
            actual = read_outputs(msg.manifest, Path(msg.dir), self.device, self.shared)
        except TransferError as exc:
            return [{"path": "output", "ok": False, "reason": f"unreadable output: {exc}"}]
        k = self.allowance
        return compare_outputs(expected, actual, msg.atol * k, msg.rtol * k, scale=msg.scale)

    def compile(self, msg: CompileRequest) -> dict[str, Any]:
        """torch.compile the model and make its first call, which is when compilation happens: apart
        from the timing, so that compiling (CPU work, seconds to minutes) needs no exclusive GPU."""
        import torch

        inputs = self.inputs(msg.seed)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                compiled = torch.compile(self.model)
                compiled(*inputs)
            synchronize(self.device)
        except Exception as exc:
            self.compiled = {"compile_error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        else:
            self.compiled = {"model": compiled, "compile_seconds": time.perf_counter() - start}
        return {k: v for k, v in self.compiled.items() if k != "model"}

    def forward(self, inputs: list[Any], strict: bool) -> Any:
        """Model on ``inputs``, synchronised; ``strict``: with TF32 off (the expected output's precision)."""
        import torch

        if strict:
            pin_precision("off")
        try:
            with torch.no_grad():
                output = self.model(*inputs)
            synchronize(self.device)
        finally:
            pin_precision(self.tf32)
        return output

    def check_records(self, msg: RecordsRequest) -> list[dict[str, Any]]:
        """Each record against the expected output of its call's inputs (strict precision where asked),
        read at the same secret positions; the tolerance is widened by the verified checks' allowance."""
        verdicts = []
        for check in msg.checks:
            inputs = self.inputs(check.seed)
            expected = self.forward(inputs, msg.strict)
            verdicts.append(compare_record(expected, inputs, check.record, check.probe, msg.atol, msg.rtol, msg.scale))
            del expected, inputs  # one call's tensors at a time: outputs of GBs each
        return verdicts

    def _launch(self, msg: CalibrateRequest | TimeRequest) -> HostLaunch:
        """Eager's and torch.compile's holds cover their host's enqueue time (a region's or, by
        default, its first call's); the empty round keeps the candidate's hold, since it stands for
        the candidate's harness time."""
        mode = TimingConfig.from_dict(msg.timing).baseline_hold
        adaptive = msg.side in ("eager", "compile") and mode != "fixed"
        return self.launch(msg.side or "", adaptive, getattr(msg, "hold_us", None), first_call=mode == "first-call")

    def _baseline(self, side: str | None) -> Any:
        """The function a baseline side times: eager Model, torch.compile(Model), or nothing
        ("empty": the round's draws, flushes and holds alone, which the outside clock subtracts)."""
        import torch

        if side == "empty":
            # Outputs allocated like the Model's (not written): their allocation and release are the
            # harness's share of a round too.
            specs = self.output_specs
            return lambda *inputs: [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs]
        if side == "eager":
            return self.model
        if side != "compile":
            raise ValueError(f"unknown baseline {side!r}")
        if self.compiled is None or "model" not in self.compiled:
            raise TaskError(f"{self.source}: torch.compile baseline unavailable: "
                            f"{(self.compiled or {}).get('compile_error', 'not compiled')}")
        return self.compiled["model"]


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

    def handle(self, op: str, msg: Any) -> dict[str, Any]:
        """Answer request ``op``: its dataclass (``protocol.REQUESTS``), or a dict it is parsed from."""
        import torch

        msg = parse_request(op, msg)
        if op == "ready":
            if msg.bell:
                if self.fd_socket is None:
                    raise ValueError("'ready' with bell: no descriptor channel")
                self.ringer = Ringer(socket.socket(fileno=receive_fd(self.fd_socket, 30)))
            cuda = torch.cuda.is_initialized()
            # Data pointers too: the allocators (on a GPU the caching allocator as well) and the C
            # library's clocks, on both backends alike; on a GPU the runtime's pointers to the driver.
            data = allocator_slots(cuda) | vdso_slots() | (driver_slots() if cuda else {})
            return {"slots": native_slots(harness_native_functions(cuda)) | data, "code_lock": self.code_lock}
        if op == "load":
            # The task program runs first, before any candidate code can touch torch;
            # the guard's snapshot of the harness is taken before candidate code too.
            bell_ms = None
            try:
                self.load_task(msg)
                if msg.bell_regions and self.ringer is not None:
                    bell_ms = self.bell_calibration(msg)
            except BaseException:
                if msg.bell_regions and self.ringer is not None:
                    self.ringer.fail(0xFFFFFFFF)  # the evaluator waits for brackets no more: this reply says why
                raise
            self.guard = CallGuard(msg.allowed_aten or ())
            self.guard.watch_quiet(lambda: self._load_candidate(msg), "while model_new.py was imported")
            self.guard.verify_harness("while model_new.py was imported")
            return {"bell_ms": bell_ms} if bell_ms is not None else {}
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
            reply = {"fingerprint": prints, "manifest": self._write(output, Path(msg.dir))}
            return reply | ({"kernels": kernels} if kernels is not None else {})
        if op == "calibrate":
            estimate = self.calibrate(self.model, msg, self.launch("candidate"))
            self.guard.verify_harness("during warm-up")
            return {"estimate_ms": estimate}
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

    def _write(self, output: Any, directory: Path) -> dict[str, Any]:
        try:
            return write_outputs(output, directory, self.shared)
        except TransferError as exc:
            raise RuleBroken("output-type", str(exc)) from None


def warm_up_runtime(device: str, profiler: bool = False) -> None:
    """Start the threads torch, the CUDA runtime and (if asked) the profiler start on first use, so
    that any thread that appears later belongs to the candidate; run the harness's own operations
    (input draws, fingerprints, comparison) once, so their first use costs no check anything."""
    import torch

    for where in dict.fromkeys(("cpu", device)):
        sample = torch.randn(1 << 18, device=where)
        fingerprint([sample, torch.rand(64, device=where), torch.randint(0, 9, (64,), device=where)])
        compare_outputs(sample, sample * (1 + 1e-6), 1e-3, 1e-3, scale=True)
    if device == "cuda":
        # The timing path once, so that whatever the runtime resolves on first use of it is in place
        # before the runtime's pointers to the driver are read (``integrity.driver_slots``).
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        end.synchronize()
        start.elapsed_time(end)
        start.query()
        torch.cuda.synchronize()
    if profiler:
        profile_call(lambda: torch.randn(1 << 10, device=device).sum(), device)


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


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "OutOfMemoryError" in text or "out of memory" in text.lower() or "can't allocate memory" in text:
        return "out_of_memory"
    if isinstance(exc, TaskError):
        return "task"
    if isinstance(exc, RuleBroken):
        return "rule"
    return "exception"


def short_traceback(exc: BaseException, limit: int = 4000) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= limit else "...\n" + text[-limit:]


def serve(side: Any, registry: dict[str, type] = REQUESTS) -> None:
    """Answer requests until ``exit`` or end of input: each message is parsed into its dataclass
    (``registry``, by op) before ``side.handle(op, request)``; one that does not parse is answered
    with an error naming the op and the field."""
    # Out of the environment before any code under test runs (the pipes can still
    # be found in /proc/self/fd: the reply nonce is what stops forged replies).
    requests = os.fdopen(int(os.environ.pop("CUDA_AGENT_REQUEST_FD")), "rb", buffering=0)
    replies = os.fdopen(int(os.environ.pop("CUDA_AGENT_RESPONSE_FD")), "wb", buffering=0)
    if "CUDA_AGENT_FD_SOCKET" in os.environ:
        side.fd_socket = socket.socket(fileno=int(os.environ.pop("CUDA_AGENT_FD_SOCKET")))
    buffer = b""
    while True:
        while b"\n" not in buffer:
            chunk = requests.read(1 << 16)
            if not chunk:
                return
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        msg = json.loads(line)
        op = msg.pop("op")
        nonce = msg.pop("nonce", None)
        if op == "exit":
            replies.write((json.dumps({"ok": True, "nonce": nonce}) + "\n").encode())
            return
        started = time.perf_counter()
        try:
            reply = {"ok": True} | side.handle(op, parse_request(op, msg, registry))
        except BaseException as exc:  # noqa: BLE001 - everything the code under test raises is reported
            reply = {
                "ok": False,
                "kind": classify(exc),
                "rule": getattr(exc, "rule", None),
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": short_traceback(exc),
            }
        reply["seconds"] = time.perf_counter() - started
        reply["nonce"] = nonce
        replies.write((json.dumps(reply) + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("reference", "candidate"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    # Start-up work that involves no candidate code happens before the first
    # request, so it overlaps with the other process instead of adding to it.
    import torch

    if args.device == "cuda":
        torch.cuda.init()
    # What every evaluation needs first (threads torch, CUDA and the profiler start on first use,
    # kernels loaded on first use), done before the first request: a started worker is ready sooner,
    # and the candidate's guard counts these threads as the harness's.
    warm_up_runtime(args.device, profiler=args.role == "candidate")
    side: Any = ReferenceSide() if args.role == "reference" else CandidateSide()
    if args.role == "candidate" and os.environ.pop(LOCK_CODE_ENV, None):
        side.code_lock = forbid_new_code() or "on"
    serve(side)


if __name__ == "__main__":
    main()
