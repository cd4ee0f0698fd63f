"""What both evaluation workers share (runs inside them): seeds, precision flags, the task's inputs drawn
from a seed on the device, their fingerprints, and ``_Side``, the task loaded and its calls timed."""

from __future__ import annotations

import os
import random
import secrets
import socket
import statistics
import types
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.protocol.policy import TimingConfig
from cuda_agent.evaluate.protocol.messages import CalibrateRequest, LoadRequest, TimeRequest
from cuda_agent.evaluate.protocol.outside import ITEMSIZE, describe
from cuda_agent.evaluate.protocol.records import RECORDED_PER_REGION, Recorder
from cuda_agent.evaluate.protocol.regions import Ringer, encode_calls
from cuda_agent.evaluate.worker.shared import SharedBuffer
from cuda_agent.evaluate.protocol.timing import HostLaunch, Warmup, calibrate, time_round, trial_seed
from cuda_agent.evaluate.protocol.vmm import VmmError, spans as vmm_spans
from cuda_agent.guard.runtime import require_plain_output
from cuda_agent.tensors import tensor_bytes, wide_squares, wide_sum
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


def input_memory(module: types.ModuleType, seed: int, device: str, source: str) -> list[Any]:
    """Tensors laid out as ``make_inputs`` lays out ``get_inputs()``'s under ``seed`` (the scalars its), their values
    unset: for timed calls whose values the evaluator writes from outside (``TimeRequest.written``), which cost a
    1 GiB draw a region (cuda_gelu) that was overwritten at once. The layout comes from the draw on the meta device,
    where nothing is computed; a draw that cannot run there (a value read back, a tensor made elsewhere) is made for
    real, as is any tensor it made off the meta device."""
    import torch

    seed_everything(seed)
    try:
        with torch.device("meta"):
            values = module.get_inputs()
    except Exception:  # noqa: BLE001 - whatever the meta device cannot do, the real draw can
        return make_inputs(module, seed, device, source)
    values = describe_inputs(values, source, "get_inputs")
    if any(isinstance(v, torch.Tensor) and v.device.type != "meta" for v in values):
        return make_inputs(module, seed, device, source)
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).requires_grad_(v.requires_grad)
            if isinstance(v, torch.Tensor) else v for v in values]


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


class _Side:
    device = "cpu"
    task_module: types.ModuleType
    model: Any
    source = "task"
    fd_socket: socket.socket | None = None  # descriptors to and from the evaluator
    ringer: Ringer | None = None  # this worker's end of the region brackets (evaluate.protocol.regions)
    final_call: tuple[int, list[Any], dict[str, Any]] | None = None  # the latest round's last call
    shared: SharedBuffer | None = None  # where outputs are handed over, once shared
    exporter: Any = None  # candidate on a GPU: exports its timed regions' memory (evaluate.protocol.vmm.Exporter)

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

    def calibrate(self, fn: Any, msg: CalibrateRequest, host: HostLaunch | None = None) -> Warmup:
        """Warm ``fn`` up on fresh inputs from ``msg.seed``."""
        import torch

        drawn: list[Any] = [None, 0]  # the inputs of the next call, and how many calls were drawn

        def setup() -> None:
            drawn[0] = None  # the previous draw's memory may be reused, as between real calls
            drawn[0] = self.inputs(trial_seed(msg.seed, drawn[1]))
            drawn[1] += 1

        with torch.no_grad():
            return calibrate(lambda: fn(*drawn[0]), self.device, TimingConfig.from_dict(msg.timing), setup, host)

    def time_calls(self, fn: Any, msg: TimeRequest, on_record: Any = None, host: HostLaunch | None = None,
                   fence: bool = True, before_region: Any = None) -> tuple[list[float], list[dict[str, Any]]]:
        """One round: ``msg.trials`` regions of ``msg.calls`` calls of ``fn``, call ``first + i``
        on the inputs of ``trial_seed(seed, first + i)`` (with ``msg.written`` their memory only: the evaluator
        writes the values it is timed on, after READY). Right after each region ends, up to
        ``RECORDED_PER_REGION`` of its calls, chosen then, are recorded (``evaluate.protocol.records``);
        ``on_record(index, inputs, output)`` sees each; ``before_region()`` runs before each region opens
        (``timing.time_round``). Returns the samples and the records."""
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

        # On a GPU the memory the region's tensors span is looked up and exported before the region (its inputs,
        # and the last region's outputs, whose memory its outputs reuse) and handed over once the region's calls are
        # queued, before its synchronise and DONE (``before_done``); only what was not looked up before is looked up
        # then, within the bracket.
        exporter, ringer = self.exporter, self.ringer if msg.bell else None
        exporting = msg.outside and exporter is not None and ringer is not None
        spans: list[tuple[int, int]] = []
        outputs_before: list[tuple[int, int]] = self.__dict__.setdefault("output_spans", [])

        draw = ((lambda seed: input_memory(self.task_module, seed, self.device, self.source)) if msg.written
                else self.inputs)

        def prepare() -> Any:
            index = next(count)
            inputs = draw(trial_seed(msg.seed, index))
            box: dict[str, Any] = {}
            region.append((index, inputs, box))
            if exporting and len(region) == msg.calls:
                exporter.check(vmm_spans([describe(i, None, drawn) for i, drawn, _ in region], ITEMSIZE)
                               + outputs_before)

            def call() -> None:
                box["output"] = fn(*inputs)
            return call

        def after_end() -> bytes | None:
            # Described for the evaluator's reads from outside: the region's calls stay alive (the timing
            # loop holds them) until the evaluator says CONT. Only what runs no code of its own when looked
            # into: this runs after the region's end event, before its DONE.
            for index, _, box in region:
                require_plain_output(box.get("output"), f"what timed call {index} returned")
            payload = None
            if msg.outside:
                described = [describe(index, box.get("output"), inputs) for index, inputs, box in region]
                payload = encode_calls(described)
                if exporting:
                    spans[:] = vmm_spans(described, ITEMSIZE)
                    outputs_before[:] = vmm_spans([dict(call, **{"in": []}) for call in described], ITEMSIZE)
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

        def announce(number: int) -> None:
            # Where the region's inputs lie, for the evaluator to write their values into before GO; on a GPU
            # with the allocations they lie in that were exported while they were drawn.
            ringer.ready(number, encode_calls([describe(index, None, inputs) for index, inputs, _ in region]))
            if exporting:
                try:
                    chunks, fds = exporter.take_pending()
                except VmmError as exc:
                    ringer.chunks_failed(number, str(exc))
                    return
                ringer.chunks(number, chunks, fds, 0)

        def before_done(number: int) -> None:
            try:
                chunks, fds, looked_up = exporter.finish(spans)
            except VmmError as exc:
                ringer.chunks_failed(number, str(exc))
                return
            ringer.chunks(number, chunks, fds, looked_up)

        # A round that raises says FAIL on the brackets where it is handled (CandidateSide.handle).
        with torch.no_grad():
            samples = time_round(prepare, self.device, TimingConfig.from_dict(msg.timing), msg.trials, msg.calls,
                                 after_end, host, fence, ringer, before_done if exporting else None,
                                 announce if msg.written and ringer is not None else None, before_region)
        synchronize(self.device)
        if recorder is None:
            return samples, []
        keys[msg.side or ""] = recorder.keys()
        return samples, recorder.finish()

    def bell_calibration(self, msg: LoadRequest) -> tuple[list[float], float]:
        """No-op regions through the brackets, on the task's own input draws, before any candidate code:
        what the brackets add to a region in this process (``region_clock.Overhead``), and on a GPU the median
        of their tails (``HostLaunch.tails_us``, ms; 0.0 where none was timed)."""
        import torch

        marker = torch.zeros(1, device=self.device)
        outside = self.device == "cpu" or self.exporter is not None
        # Where the rounds record their calls in this process (a GPU without exports), these regions record
        # theirs too: the records' gathers are inside every bracket, and so in what the brackets are found to cost.
        request = TimeRequest(seed=msg.bell_seed, first=0, trials=msg.bell_regions, calls=1,
                              timing=msg.timing or TimingConfig().to_dict(), hold_us=msg.bell_hold_us, bell=True,
                              outside=outside, probe=None if outside else msg.bell_seed, written=msg.bell_written)
        host = self.launch("bell", fixed_us=msg.bell_hold_us)
        host.tails_us.clear()
        samples = self.time_calls(lambda *args: marker, request, host=host)[0]
        return samples, statistics.median(host.tails_us) / 1e3 if host.tails_us else 0.0




GIB = 1024**3


def memory_needed(module: types.ModuleType, init_args: list[Any]) -> int | None:
    """Bytes the task needs at the least: its inputs, Model's weights and one output, sized on the meta device
    (nothing allocated, no values computed); None where the task cannot be sized that way."""
    import torch

    try:
        with torch.device("meta"):
            inputs = module.get_inputs()
            model = module.Model(*init_args)
            with torch.no_grad():
                output = model(*inputs)
    except Exception:  # noqa: BLE001 - an operator without a meta kernel: the real load decides
        return None
    return tensor_bytes([inputs, list(model.parameters()), list(model.buffers()), output])


def refuse_if_too_big(module: types.ModuleType, init_args: list[Any], limit: int | None, source: str) -> None:
    """Fail before any real tensor is made when the task cannot fit the memory each process may use."""
    need = memory_needed(module, init_args) if limit else None
    if need is not None and need > limit:
        raise TaskError(f"{source}: needs at least {need / GIB:.1f} GiB of memory (its inputs, weights and one output, "
                        f"sized without allocating them), more than the {limit / GIB:.1f} GiB each evaluation process "
                        "may use: raise it with --memory-limit GIB (Evaluator(memory_limit=...)), or choose a smaller task")


def share_inductor_headers() -> None:
    """Inductor keeps its C++ precompiled header (150 MB, seconds to build) under $TMPDIR, not
    under TORCHINDUCTOR_CACHE_DIR, and each reference process has a TMPDIR of its own: every torch.compile on
    the CPU would rebuild it, three times the cost of a compile with it kept. Pointed into the shared inductor cache, where
    inductor's own file lock makes concurrent builds safe; a torch without these names is left as it is."""
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:
        return
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = os.path.join(cache, "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
