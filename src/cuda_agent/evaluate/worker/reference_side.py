"""The reference worker (``--role reference``): only the pristine task program runs here. It writes the
state dict, computes and holds the expected outputs (which never leave it), compares what the candidate
handed over, checks the records of timed calls, and times the baselines."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

from cuda_agent.evaluate.protocol.compare import compare_outputs, precision_allowance
from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.outside import span_bytes
from cuda_agent.evaluate.protocol.messages import (CalibrateRequest, CompareRequest, CompileRequest, DegenerateRequest,
                                          DrawRequest, ExpectRequest, GpuHeld, KeepGpuRequest, ReadGpuRequest,
                                          RecordsRequest, TimeRequest, WriteGpuRequest, parse_request)
from cuda_agent.evaluate.protocol.quiet import Doorbell, after_done, probe_us, quiet_within
from cuda_agent.evaluate.protocol.records import compare_record, same_outputs, sample_output
from cuda_agent.evaluate.worker.shared import SharedBuffer, SharedError, aligned
from cuda_agent.evaluate.protocol.timing import HostLaunch
from cuda_agent.evaluate.worker.transfer import TransferError, manifest_devices, packed_bytes, read_outputs
from cuda_agent.sandbox.process import receive_fds, send_fd
from cuda_agent.tensors import tensor_bytes, tensors_in
from cuda_agent.tasks.task import TaskError

from cuda_agent.evaluate.worker.side import (_Side, fingerprint, make_inputs, pin_precision, refuse_if_too_big,
                                      seed_everything, share_inductor_headers, synchronize)


class ReferenceSide(_Side):
    expected: Any = None
    kept: Any = None  # a candidate output sampled with keep=True, for the next sample to be compared with
    allowance = 1.0  # factor on the tolerance for the expected output held now
    compiled: dict[str, Any] | None = None  # torch.compile(Model) (or its error) and its compile time
    output_specs: list[tuple[Any, Any, Any]] = []  # (shape, dtype, device) of the Model's output tensors
    importer: Any = None  # holds the candidate's exported GPU memory mapped (evaluate.protocol.vmm.Importer), once needed
    drawn: SharedBuffer | None = None  # timed calls' inputs for the evaluator to write into the candidate's (``draw``)
    flush: Any = None  # zeroed after a GPU write of the candidate's inputs (``write_gpu``)
    kept_output: list[Any] | None = None  # a timed call's output tensors copied out of the candidate's (``keep_gpu``)
    doorbell: Doorbell | None = None  # rung by the evaluator at a candidate's region's DONE (``after_done``)

    def handle(self, op: str, msg: Any) -> dict[str, Any]:
        """Answer request ``op``: its dataclass (``protocol.REQUESTS``), or a dict it is parsed from."""
        import torch

        msg = parse_request(op, msg)
        if op == "load":
            self.load_task(msg)
            if self.device == "cpu":  # host memory is what the limit bounds; a GPU task's tensors live on the GPU
                refuse_if_too_big(self.task_module, self.init_args, msg.memory_limit, self.source)
            seed_everything(msg.init_seed)
            model = self.task_module.Model(*self.init_args)
            if not isinstance(model, torch.nn.Module):
                raise TaskError(f"{self.source}: Model(...) is not a torch.nn.Module.")
            torch.save(model.state_dict(), msg.state_dict_path)
            self.model = model.to(self.device).eval()
            info = {}
            if self.device == "cuda":
                info["gpu"] = torch.cuda.get_device_name()
                info["device_bytes"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            info["fixed_inputs"] = self.fixed_inputs()
            if msg.warm is not None:
                # One expected output, computed and dropped: the first forward in a process (kernels
                # loaded, libraries started) costs seconds, here at once with the candidate's load.
                # Its size is the size of the memory the outputs are handed over in.
                self.handle("expect", msg.warm)
                info["output_bytes"] = packed_bytes(self.expected)
                info["share"] = self.share()
                self.expected = None
            return {"parameters": sum(p.numel() for p in model.parameters())} | info
        if op == "compile":
            return self.compile(msg)
        if op == "calibrate":
            host = self._launch(msg)
            warmup = self.calibrate(self._baseline(msg.side), msg, host)
            return {"estimate_ms": warmup.estimate_ms, "call_ms": warmup.call_ms, "host_us": host.per_call_us}
        if op == "time":
            host = self._launch(msg)
            # torch's own calls leave nothing running past the end event: no fence to judge them by. The
            # empty round stands for the candidate's harness time, fence measurements included.
            # Before each baseline region the GPU must be quiet: no context of the candidate's left with work
            # (``evaluate.protocol.quiet``); the empty round stands for the candidate's harness and is not probed.
            waits: list[float] = []
            probe = (lambda: waits.append(probe_us())) if self.device == "cuda" and msg.side != "empty" else None
            samples = self.time_calls(self._baseline(msg.side), msg, host=host, fence=msg.side == "empty",
                                      before_region=probe)[0]
            if msg.side == "empty" and self.device == "cuda":
                torch.cuda.empty_cache()  # its outputs were never the Model's: hold no memory for them
            return {"samples": samples, "host": host.report()} | ({"busy_us": max(waits)} if waits else {})
        if op == "quiet":
            return {"after_ms": quiet_within(msg.within_s)}
        if op == "after_done":
            if msg.page:
                if self.fd_socket is None:
                    raise ValueError("'after_done': no descriptor channel")
                if self.doorbell is not None:
                    self.doorbell.close()
                self.doorbell = Doorbell(receive_fds(self.fd_socket, 1, 30)[0])
            if self.doorbell is None:
                raise ValueError("'after_done': no doorbell was handed over")
            wait_us, launched_ns = after_done(self.doorbell, msg.region, msg.within_s)
            return {"wait_us": wait_us, "launched_ns": launched_ns}
        if op == "records":
            return {"verdicts": self.check_records(msg)}
        if op == "expect":
            inputs = self.inputs(msg.seed)
            self.expected = self.forward(inputs, msg.strict)
            self.allowance = self.precision_allowance(inputs, msg) if msg.strict else 1.0
            self.output_specs = [(t.shape, t.dtype, t.device) for t in tensors_in(self.expected)]
            return {"fingerprint": fingerprint(inputs), "output_bytes": tensor_bytes(self.expected),
                    "input_bytes": tensor_bytes(inputs), "allowance": self.allowance}
        if op == "release":
            # Stay alive for the checks of timed outputs, holding as little as possible.
            self.expected = self.kept = None
            if msg.ended:
                self.kept_output = None  # the evaluation's, as the allocations it was copied from
                if self.importer is not None:
                    self.importer.forget()  # the evaluation's allocations: the candidate's memory, not to outlive it
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
        if op == "read_gpu":
            return self.read_gpu(msg)
        if op == "draw":
            return self.draw(msg)
        if op == "write_gpu":
            return self.write_gpu(msg)
        if op == "keep_gpu":
            return self.keep_gpu(msg)
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

    def _drawn(self, seeds: list[int], leaves: list[list[list[Any]]]) -> tuple[list[tuple[Any, int]], str | None]:
        """Each call's inputs drawn from its seed, each tensor with its span's bytes, where every tensor is laid out
        as described (``[dtype, shape, strides]``); else nothing and what differs (the candidate's doing)."""
        if len(seeds) != len(leaves):
            return [], f"{len(leaves)} calls described for {len(seeds)} drawn"
        planned = []
        for call, (seed, described) in enumerate(zip(seeds, leaves)):
            drawn = list(tensors_in(self.inputs(seed)))
            if len(drawn) != len(described):
                return [], f"call {call}: {len(described)} input tensors described, the task draws {len(drawn)}"
            for leaf, (tensor, wanted) in enumerate(zip(drawn, described)):
                own = [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), list(tensor.stride())]
                if list(wanted[:3]) != own:
                    return [], f"call {call}: input {leaf} described as {wanted[:3]}, the task draws {own}"
                planned.append((tensor.detach(), span_bytes(own[1], own[2], tensor.element_size())))
        return planned, None

    def draw(self, msg: DrawRequest) -> dict[str, Any]:
        """The inputs of ``msg.seeds``' calls, packed into memory shared with the evaluator, each tensor's span as
        the candidate described its own (``outside.InputWriter``, CPU backend). A description that is not what the
        task draws is said in the reply (the candidate's doing), not raised."""
        import torch

        if self.device != "cpu" or self.fd_socket is None:
            raise ValueError("'draw': the CPU backend's inputs, over a descriptor channel")
        planned, error = self._drawn(msg.seeds, msg.leaves)
        if error:
            return {"spans": [], "error": error}
        spans, total, at = [], 0, iter(planned)
        for call in msg.leaves:
            spans.append([])
            for _ in call:
                spans[-1].append([total, next(at)[1]])
                total += aligned(spans[-1][-1][1])
        grown = self.drawn is None or self.drawn.nbytes < total
        if grown:
            if self.drawn is not None:
                self.drawn.close()
            self.drawn = SharedBuffer.create(max(total, 1), "cpu")
        if grown or msg.send:
            send_fd(self.fd_socket, self.drawn.fd)
        for (tensor, nbytes), offset in zip(planned, (s[0] for call in spans for s in call)):
            if nbytes:
                flat = torch.as_strided(tensor, (nbytes // tensor.element_size(),), (1,), tensor.storage_offset())
                self.drawn.host[offset:offset + nbytes].copy_(flat.view(torch.uint8))
        return {"spans": spans, "bytes": self.drawn.nbytes, "grown": grown or msg.send}

    def write_gpu(self, msg: WriteGpuRequest) -> dict[str, Any]:
        """The inputs of ``msg.seeds``' calls written into the candidate's GPU memory from here (``evaluate.protocol.vmm``),
        then the L2 flushed: what was written is not left in a cache the baselines' inputs are flushed from; then
        the GPU probed for other contexts' work (``evaluate.protocol.quiet``): none may start on the values before GO."""
        import torch

        from cuda_agent.evaluate.protocol.vmm import VmmError

        steps = _Steps()
        try:
            with self._descriptors("write_gpu", msg.held) as fds:
                steps("descriptors")
                planned, error = self._drawn(msg.seeds, msg.leaves)
                if error:
                    return {"error": error}
                torch.cuda.synchronize()  # the copy below waits for the draw anyway: here it is timed as the draw's
                steps("draw")
                ats = [leaf[3] if len(leaf) == 4 and isinstance(leaf[3], int) else -1 for call in msg.leaves
                       for leaf in call]
                mapped = self._held(msg.held, msg.sizes, fds)
                steps("map")
                self.importer.write(mapped, msg.offsets, [(tensor.data_ptr(), at, nbytes)
                                                          for (tensor, nbytes), at in zip(planned, ats) if nbytes])
                steps("copy")
                if msg.flush_bytes:
                    if self.flush is None or self.flush.numel() != msg.flush_bytes:
                        self.flush = torch.empty(msg.flush_bytes, dtype=torch.int8, device=self.device)
                    self.flush.zero_()
                busy_us = probe_us()  # after the writes and the flush, before GO: quiet (``evaluate.protocol.quiet``)
                steps("flush and probe")
        except VmmError as exc:
            return {"error": str(exc)}
        return {"busy_us": busy_us, "steps_ms": steps.ms}

    @contextlib.contextmanager
    def _descriptors(self, op: str, held: GpuHeld) -> Iterator[list[int]]:
        """The descriptors request ``op`` hands over (of the candidate's allocations this process does not hold
        yet), received now and closed once it is answered (``_held`` imports what it maps)."""
        if self.fd_socket is None:
            raise ValueError(f"'{op}': no descriptor channel")
        fds = receive_fds(self.fd_socket, len(held.new), 30)
        try:
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def _held(self, held: GpuHeld, sizes: list[int], fds: list[int]) -> list[tuple[int, int]]:
        """The candidate's allocations a request uses, mapped here (kept from request to request: ``vmm.Importer``)."""
        import torch

        from cuda_agent.evaluate.protocol.vmm import Importer

        if self.importer is None:
            self.importer = Importer(torch.cuda.current_device())
        return self.importer.hold(held.ids, sizes, held.new, fds, held.drop)

    def keep_gpu(self, msg: KeepGpuRequest) -> dict[str, Any]:
        """A timed call's output copied out of the candidate's GPU memory into this process's (``evaluate.protocol.vmm``),
        while its processes are stopped, for a later ``compare`` (``kept``): never handed over by its code."""
        import torch

        from cuda_agent.evaluate.protocol.vmm import VmmError

        self.kept_output = None  # the one kept before goes first
        try:
            with self._descriptors("keep_gpu", msg.held) as fds:
                mapped = self._held(msg.held, msg.sizes, fds)
                outputs, copies = [], []
                for dtype, shape, strides, at in msg.leaves:
                    kind = getattr(torch, str(dtype))
                    nbytes = span_bytes(shape, strides, torch.empty((), dtype=kind).element_size())
                    memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    if nbytes:
                        copies.append((memory.data_ptr(), int(at), nbytes))
                    outputs.append(memory.view(kind).as_strided(shape, strides))
                self.importer.copy_out(mapped, msg.offsets, copies)
        except VmmError as exc:
            return {"error": str(exc)}
        self.kept_output = outputs
        return {}

    def fixed_inputs(self) -> bool:
        """Whether the task's draws differ in their tensors' values alone (dtype, shape, strides and every other
        input the same from seed to seed): only then can a draw from another seed be written over the candidate's.
        Drawn on the meta device (no memory, no values: a shape that depends on a drawn value fails there), else
        on the CPU backend for real; a GPU task that cannot be drawn on the meta device is taken as not fixed (its
        real draws can be GBs)."""
        import torch

        def layout(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return [str(value.dtype), list(value.shape), list(value.stride())]
            if isinstance(value, (list, tuple)):
                return [layout(v) for v in value]
            if isinstance(value, dict):
                return {k: layout(v) for k, v in value.items()}
            return repr(value)
        try:
            return layout(make_inputs(self.task_module, 1, "meta", self.source)) == \
                layout(make_inputs(self.task_module, 2, "meta", self.source))
        except Exception:  # noqa: BLE001 - a draw the meta device cannot make: drawn for real, or not fixed
            if self.device != "cpu":
                return False
        return layout(self.inputs(1)) == layout(self.inputs(2))

    def read_gpu(self, msg: ReadGpuRequest) -> dict[str, Any]:
        """The candidate's GPU memory read here, where its code cannot reach (``evaluate.protocol.vmm``): what fails
        because of what it exported is said in the reply (the candidate's failure), not raised."""
        from cuda_agent.evaluate.protocol.vmm import VmmError

        steps = _Steps()
        try:
            with self._descriptors("read_gpu", msg.held) as fds:
                steps("descriptors")
                reads = [(int(c), int(o), int(n)) for c, o, n in msg.reads]
                mapped = self._held(msg.held, msg.sizes, fds)
                steps("map")
                data, changed = self.importer.read(mapped, reads, msg.apart_s)
                steps("read twice, apart")
        except VmmError as exc:
            return {"data": [], "changed": [], "error": str(exc)}
        return {"data": [d.hex() for d in data], "changed": changed, "steps_ms": steps.ms}

    def precision_allowance(self, inputs: list[Any], msg: ExpectRequest) -> float:
        """How far the baselines' own arithmetic (this Model under the pinned flags) is from
        the strict truth, times the policy's slack, where that exceeds the tolerance."""
        import torch

        slack = msg.slack
        if not slack or self.tf32 == "off":
            return 1.0
        with torch.no_grad():
            own = self.model(*inputs)
        if same_outputs(self.expected, own):
            # The flags changed nothing (elementwise tasks): the comparison would find no error over the tolerance
            # (identical values, or NaN where the truth has NaN, which never widens it), a pass over a 6 GiB
            # output's pieces (a tenth of a second) for every check.
            return 1.0
        return precision_allowance(self.expected, own, msg.atol, msg.rtol, msg.scale, slack)

    def degenerate(self, msg: DegenerateRequest) -> dict[str, Any]:
        """Which trivial candidates pass: the constant is fitted on the first draw
        and tested, like the others, on the later ones."""
        import torch

        from cuda_agent.evaluate.protocol.degenerate import TRIVIAL_CANDIDATES, leaf_means, trivial_failures

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
        if msg.kept:
            kept, self.kept_output = self.kept_output, None
            if kept is None:
                raise ValueError("'compare': no output was kept")
            wanted = list(tensors_in(expected))
            if len(kept) != len(wanted):
                return [{"path": "output", "ok": False, "reason": f"{len(kept)} output tensors, expected {len(wanted)}"}]
            k = self.allowance
            return compare_outputs(wanted, kept, msg.atol * k, msg.rtol * k, scale=msg.scale)
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

        share_inductor_headers()
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


class _Steps:
    """A request's steps by wall clock, each from the one before (ms): what a region's cost is made of."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.ms[step] = round((now - self.last) * 1e3, 4)
        self.last = now
