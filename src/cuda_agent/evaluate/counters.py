"""Hardware counters for the agent: what each kernel of one call did, and how far the call is from the
speed of light. Advisory only: nothing here enters the reward.

One correct candidate call is profiled with Nsight Compute (``ncu``) in the sandbox (``Evaluator.counters``
runs :mod:`cuda_agent.evaluate.worker.counters_target` under it). ``ncu`` writes one CSV row per kernel launch
(``--page raw``); this module parses it, names each kernel's origin (the candidate's own, a library's,
or torch's/other), says what limits it (memory, compute, latency/occupancy, launch) with the counters
behind the verdict, and renders a report of at most ~40 lines for ``utils/profile.py``.

The counters come from the candidate's own process, so a candidate can make them say anything; that is
why they are advice and never a measurement the reward depends on (docs/SECURITY.md).

Choices (their measurements: docs/CONSTANTS.md):
- ``--clock-control none``: ncu's default locks the GPU's clocks to base for the run, a machine-wide
  change to a shared card; the timing loop runs at the card's own clocks, and the report should too.
- ncu's default cache control flushes the caches before each replay pass, so durations are cold-cache
  and a little longer than the timing loop's warm ones for inputs that fit in L2.
- Explicit metrics, not sections: a handful of counters profile faster than whole sections, and each one
  is named below with what it is for.
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from cuda_agent.evaluate.plausibility import memory_system
from cuda_agent.guard.attribution import base_name

# name in ncu's raw page -> our field; ``launch__*`` are static facts of the launch, the rest are counters.
METRICS: dict[str, str] = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    # The memory side of ncu's speed-of-light (the busiest of DRAM, L2, L1/shared): high when memory-bound.
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory_pct",
    # The compute side (the busiest SM pipeline or issue stage).
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block": "shared_bytes",
    "launch__block_size": "block",
    "launch__grid_size": "grid",
    "launch__waves_per_multiprocessor": "waves",
    "launch__sm_count": "sms",
    "launch__occupancy_limit_registers": "limit_registers",
    "launch__occupancy_limit_shared_mem": "limit_shared_mem",
    "launch__occupancy_limit_warps": "limit_warps",
    "launch__occupancy_limit_blocks": "limit_blocks",
    # Peaks at the clocks the kernel ran at: DRAM bytes per cycle x DRAM cycles per second, FP32 FMAs
    # per cycle x SM cycles per second.
    "dram__bytes.sum.peak_sustained": "dram_bytes_per_cycle",
    "dram__cycles_elapsed.avg.per_second": "dram_hz",
    "sm__cycles_elapsed.avg.per_second": "sm_hz",
    "sm__sass_thread_inst_executed_op_ffma_pred_on.sum.peak_sustained": "ffma_per_cycle",
}
MAX_KERNELS = 200  # launches profiled in one call; each is replayed several times
MAX_NCU_BYTES = 64 * 2**20  # ncu's CSV for MAX_KERNELS launches is well under 10 MB
NCU_FLAGS = ("--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
             "--print-units", "base", "--launch-count", str(MAX_KERNELS))

# Dense tensor-core FLOPs per SM per clock for 16-bit inputs, by compute capability (NVIDIA's data
# sheets: A100 312 TFLOPs = 108 SMs x 1.41 GHz x 2048; H100 SXM 989 = 132 x 1.83 x 4096; L40S 362 =
# 142 x 2.52 x 1024; B200 ~2250 = 148 x 1.97 x 8192). TF32 runs at half of this rate, FP8 at twice.
TENSOR_FLOPS_PER_SM_CLOCK: dict[tuple[int, int], int] = {
    (8, 0): 2048, (8, 6): 1024, (8, 7): 1024, (8, 9): 1024, (9, 0): 4096, (10, 0): 8192,
}
TINY_KERNEL_NS = 5_000  # below this, a kernel's launch costs about as much as its work
LAUNCH_FLOOR_US = 2.0  # one kernel launch, end to end (docs/CONSTANTS.md): no call is faster
SATURATED_PCT = 60.0  # ncu's own line: a unit above 60% of its peak is what limits the kernel
NEAR_PEAK_PCT = 80.0

_LIBRARY = re.compile(r"cublas|cudnn|cutlass|cufft|curand|cusparse|cusolver|nccl|xmma|nvjet|\bcub::|magma|"
                      r"flash_?(fwd|bwd|attn)|sm\d+_[a-z0-9_]*gemm|gemv|gemmk|splitk", re.IGNORECASE)


class CountersError(RuntimeError):
    """ncu's output could not be read."""


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def parse_ncu_raw(text: str) -> list[dict[str, Any]]:
    """Rows of ``ncu --csv --page raw --print-units base`` output, one per profiled launch: the
    identifying columns as text, every metric as a float (None where ncu printed n/a). Lines before
    the header (ncu's ``==PROF==`` messages, the program's own output) are skipped. The text comes from
    a process that ran candidate code: anything malformed is a ``CountersError``, never another error."""
    if len(text) > MAX_NCU_BYTES:
        raise CountersError(f"ncu's output is {len(text)} bytes, more than {MAX_NCU_BYTES} (not ncu's)")
    start = text.find('"ID","Process ID"')
    if start < 0:
        raise CountersError("no kernel table in ncu's output (no kernel ran between the profiler's start and stop, "
                            "or ncu failed before profiling)")
    try:
        rows = list(csv.reader(io.StringIO(text[start:])))
    except csv.Error as exc:
        raise CountersError(f"ncu's CSV is malformed: {exc}") from None
    header = rows[0]
    out = []
    for row in rows[1:]:
        if len(row) != len(header) or not row[0].strip():
            continue  # the units row (empty ID), or a line ncu or the program wrote in between
        record: dict[str, Any] = {}
        for key, value in zip(header, row):
            if "__" in key and key != "device__attribute_display_name":
                record[key] = _number(value)
            else:
                record[key] = value
        out.append(record)
    return out


@dataclass
class KernelCounters:
    """One kernel of the profiled call (its launches merged: counters of the longest launch)."""

    name: str
    origin: str  # "own" (the candidate's extension), "library" (cuBLAS, cuDNN, CUTLASS, ...), "other" (torch's)
    launches: int
    duration_us: float  # all launches together
    dram_read_bytes: float | None = None
    dram_write_bytes: float | None = None
    dram_pct: float | None = None
    memory_pct: float | None = None
    sm_pct: float | None = None
    tensor_pct: float | None = None
    fma_pct: float | None = None
    achieved_occupancy_pct: float | None = None
    theoretical_occupancy_pct: float | None = None
    registers: float | None = None
    shared_bytes: float | None = None
    block: float | None = None
    grid: float | None = None
    waves: float | None = None
    occupancy_limiter: str | None = None
    bound: str = "unknown"  # "memory", "compute", "latency", "launch"
    why: str = ""


@dataclass
class SpeedOfLight:
    """The least time the task's call can take here: its bytes at the DRAM peak, its FLOPs at the peak of
    the units its dtype can use; the larger of the two."""

    bytes: int  # inputs read once and outputs written once
    flops: float  # matmul/convolution/attention FLOPs (torch's FLOP counter); elementwise work counts 0
    flop_unit: str  # which peak the FLOPs were held against
    bandwidth_gbs: float | None
    peak_tflops: float | None
    time_us: float | None
    limit: str  # "memory" or "compute"


@dataclass
class CounterReport:
    available: bool
    reason: str = ""  # why there are no counters (CPU backend, no ncu, profile failed)
    gpu: str | None = None
    kernels: list[KernelCounters] = field(default_factory=list)
    truncated: bool = False  # more launches than MAX_KERNELS
    speed_of_light: SpeedOfLight | None = None
    times_ms: dict[str, float] = field(default_factory=dict)  # candidate / eager / compile medians
    seconds: float | None = None  # what the profile cost
    verdict: str = ""

    @property
    def gpu_us(self) -> float:
        return sum(k.duration_us for k in self.kernels)

    def share(self, origin: str) -> float:
        total = self.gpu_us
        return sum(k.duration_us for k in self.kernels if k.origin == origin) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"gpu_us": self.gpu_us}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CounterReport":
        kernels = [KernelCounters(**k) for k in data.get("kernels", [])]
        sol = SpeedOfLight(**data["speed_of_light"]) if data.get("speed_of_light") else None
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k not in ("kernels", "speed_of_light")}
        return cls(**fields, kernels=kernels, speed_of_light=sol)

    def text(self, max_lines: int = 40) -> str:
        return render(self, max_lines)


def origin_of(name: str, is_own: Callable[[str], bool]) -> str:
    if is_own(name):
        return "own"
    return "library" if _LIBRARY.search(name) else "other"


def _limiter(row: dict[str, Any]) -> str | None:
    """What caps the blocks per SM: the smallest of ncu's per-resource limits."""
    limits = {"registers": row.get("launch__occupancy_limit_registers"),
              "shared memory": row.get("launch__occupancy_limit_shared_mem"),
              "warps (block size)": row.get("launch__occupancy_limit_warps"),
              "blocks per SM": row.get("launch__occupancy_limit_blocks")}
    known = {k: v for k, v in limits.items() if v is not None}
    return min(known, key=lambda k: known[k]) if known else None


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


def classify(k: KernelCounters, launches_us: float) -> tuple[str, str]:
    """(bound, why) of one kernel, from the counters of its longest launch (``launches_us``)."""
    memory, sm = k.memory_pct or 0.0, k.sm_pct or 0.0
    if launches_us * 1e3 < TINY_KERNEL_NS and max(memory, sm) < SATURATED_PCT:
        return "launch", (f"tiny: {launches_us:.1f} us a launch, memory {_pct(k.memory_pct)}, SM {_pct(k.sm_pct)} "
                          "of peak; the launch costs about as much as the work: fuse it into a neighbour or give "
                          "each launch more work")
    if memory >= SATURATED_PCT and memory >= sm:
        dram = k.dram_pct or 0.0
        if dram >= NEAR_PEAK_PCT:
            return "memory", (f"DRAM at {_pct(k.dram_pct)} of peak, near it: only moving fewer bytes helps "
                              "(fuse producers/consumers, keep data in registers/shared memory, narrower dtypes)")
        if dram >= SATURATED_PCT:
            return "memory", (f"DRAM at {_pct(k.dram_pct)} of peak: wider loads (float4), more bytes in flight per "
                              "thread, fewer passes over the data")
        return "memory", (f"caches/shared memory at {_pct(k.memory_pct)} of peak, DRAM {_pct(k.dram_pct)}: the "
                          "bottleneck is L1/L2/shared traffic: data read again and again (tile it into shared "
                          "memory/registers and reuse it), uncoalesced access or bank conflicts")
    if sm >= SATURATED_PCT:
        if (k.tensor_pct or 0.0) >= SATURATED_PCT:
            return "compute", f"tensor pipe at {_pct(k.tensor_pct)}: near the tensor cores' peak"
        return "compute", (f"SM at {_pct(k.sm_pct)} of peak (FMA pipe {_pct(k.fma_pct)}, tensor pipe "
                           f"{_pct(k.tensor_pct)}): cut instructions, or move the math onto tensor cores (mma/WMMA)")
    parts = [f"neither memory ({_pct(k.memory_pct)}) nor SM ({_pct(k.sm_pct)}) is busy: stalls on latency"]
    if k.waves is not None and k.waves < 1:
        parts.append(f"grid too small: {k.grid or 0:.0f} blocks fill {k.waves:.2f} of one wave of the GPU's SMs")
    if k.achieved_occupancy_pct is not None:
        parts.append(f"occupancy {_pct(k.achieved_occupancy_pct)} achieved of {_pct(k.theoretical_occupancy_pct)} "
                     f"possible" + (f", capped by {k.occupancy_limiter}" if k.occupancy_limiter else ""))
    return "latency", "; ".join(parts)


def kernels_from_rows(rows: list[dict[str, Any]], is_own: Callable[[str], bool]) -> list[KernelCounters]:
    """Launches merged per kernel name, longest first in GPU time."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("Kernel Name", "?"), []).append(row)
    out = []
    for name, launches in groups.items():
        durations = [(r.get("gpu__time_duration.sum") or 0.0) for r in launches]
        longest = launches[max(range(len(launches)), key=lambda i: durations[i])]
        values = {ours: longest.get(theirs) for theirs, ours in METRICS.items()
                  if ours in KernelCounters.__dataclass_fields__}
        kernel = KernelCounters(name=name, origin=origin_of(name, is_own), launches=len(launches),
                                duration_us=sum(durations) / 1e3, occupancy_limiter=_limiter(longest), **values)
        kernel.bound, kernel.why = classify(kernel, max(durations) / 1e3)
        out.append(kernel)
    return sorted(out, key=lambda k: -k.duration_us)


def _device_peaks(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU's name, compute capability, SMs, clocks and the DRAM/FP32 peaks ncu reports."""
    row = rows[0] if rows else {}
    cc = str(row.get("CC") or "0.0").split(".")
    dram = None
    if row.get("dram__bytes.sum.peak_sustained") and row.get("dram__cycles_elapsed.avg.per_second"):
        dram = row["dram__bytes.sum.peak_sustained"] * row["dram__cycles_elapsed.avg.per_second"] / 1e9
    fp32 = None
    if row.get("sm__sass_thread_inst_executed_op_ffma_pred_on.sum.peak_sustained") and row.get("sm__cycles_elapsed.avg.per_second"):
        fp32 = 2 * row["sm__sass_thread_inst_executed_op_ffma_pred_on.sum.peak_sustained"] * \
            row["sm__cycles_elapsed.avg.per_second"] / 1e12
    return {"gpu": row.get("device__attribute_display_name") or None,
            "cc": (int(cc[0]), int(cc[1])) if all(c.isdigit() for c in cc[:2]) and len(cc) >= 2 else (0, 0),
            "sms": row.get("launch__sm_count"), "sm_hz": row.get("sm__cycles_elapsed.avg.per_second"),
            "dram_gbs": dram, "fp32_tflops": fp32}


def speed_of_light(facts: dict[str, Any], peaks: dict[str, Any]) -> SpeedOfLight | None:
    """From the task's facts (``bytes``, ``flops``, ``dtype``, ``tf32``: measured before candidate code loaded) and
    the GPU's peaks. The data sheet's DRAM bandwidth where the GPU is known (ncu's sustained peak is a
    little lower), else ncu's."""
    try:
        nbytes, flops, dtype = int(facts["bytes"]), float(facts.get("flops") or 0.0), str(facts.get("dtype", ""))
    except (KeyError, TypeError, ValueError):
        return None
    known = memory_system(peaks.get("gpu"))
    bandwidth = known.bandwidth_gbs if known else peaks.get("dram_gbs")
    per_clock = TENSOR_FLOPS_PER_SM_CLOCK.get(peaks.get("cc") or (0, 0))
    tensor = per_clock * peaks["sms"] * peaks["sm_hz"] / 1e12 if per_clock and peaks.get("sms") and peaks.get("sm_hz") else None
    if dtype in ("float16", "bfloat16") and tensor:
        unit, peak = "16-bit tensor cores (dense)", tensor
    elif dtype.startswith("float8") and tensor:
        unit, peak = "FP8 tensor cores (dense)", 2 * tensor
    elif dtype == "float32" and facts.get("tf32") and tensor:
        unit, peak = "TF32 tensor cores (dense; the policy allows TF32)", tensor / 2
    else:
        unit, peak = "FP32 CUDA cores", peaks.get("fp32_tflops")
    memory_us = nbytes / (bandwidth * 1e9) * 1e6 if bandwidth else None
    compute_us = flops / (peak * 1e12) * 1e6 if peak and flops else 0.0
    if memory_us is None:
        return SpeedOfLight(nbytes, flops, unit, None, peak, None, "unknown")
    limit = "compute" if compute_us > memory_us else "memory"
    return SpeedOfLight(nbytes, flops, unit, bandwidth, peak, max(memory_us, compute_us), limit)


def _call_verdict(report: CounterReport) -> str:
    candidate = report.times_ms.get("candidate")
    gpu_ms = report.gpu_us / 1e3
    if not report.kernels:
        return "no kernel ran in the profiled call"
    parts = []
    if candidate and gpu_ms < 0.5 * candidate:
        parts.append(f"launch-bound call: kernels take {gpu_ms:.3f} ms of a {candidate:.3f} ms call "
                     f"({gpu_ms / candidate:.0%}); the GPU waits on the host: fewer launches (fuse kernels), "
                     "fewer host-side ops, or CUDA graphs")
    top = report.kernels[0]
    parts.append(f"largest kernel: {top.origin}, {top.duration_us / max(report.gpu_us, 1e-9):.0%} of GPU time, "
                 f"{top.bound}-bound")
    if report.share("own") < 0.5:
        parts.append(f"own kernels hold {report.share('own'):.0%} of GPU time: the rest is where time goes")
    return "; ".join(parts)


def build_report(text: str, facts: dict[str, Any], is_own: Callable[[str], bool],
                 times_ms: dict[str, float]) -> CounterReport:
    rows = parse_ncu_raw(text)
    facts = facts if isinstance(facts, dict) else {}  # written where candidate code ran: trust its shape to nothing
    peaks = _device_peaks(rows)
    report = CounterReport(available=True, gpu=peaks["gpu"], kernels=kernels_from_rows(rows, is_own),
                           truncated=len(rows) >= MAX_KERNELS, speed_of_light=speed_of_light(facts, peaks),
                           times_ms=dict(times_ms))
    report.verdict = _call_verdict(report)
    return report


def _short(name: str, width: int = 44) -> str:
    cut = base_name(name).replace("{anonymous}::", "") or name
    return cut if len(cut) <= width else cut[: width - 3] + "..."


def _ms(us: float) -> str:
    return f"{us / 1e3:.4f} ms" if us >= 10 else f"{us:.2f} us"


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def render(report: CounterReport, max_lines: int = 40) -> str:
    """The report as an agent reads it: at most ``max_lines`` lines."""
    if not report.available:
        lines = [f"counters: not available: {report.reason}"]
        for side in ("candidate", "eager", "compile"):
            if side in report.times_ms:
                lines.append(f"  {side:>9}: {report.times_ms[side]:.4f} ms")
        return "\n".join(lines)
    head = [f"counters ({report.gpu or 'GPU'}, one call under Nsight Compute, cold caches; advice, not scored)"]
    sol = report.speed_of_light
    if sol and sol.time_us:
        head.append(f"speed of light: {_ms(sol.time_us)} ({sol.limit}: {_bytes(sol.bytes)} at "
                    f"{sol.bandwidth_gbs:.0f} GB/s" + (f", {sol.flops / 1e9:.2f} GFLOP at {sol.peak_tflops:.0f} TFLOP/s "
                                                       f"{sol.flop_unit.split(' (')[0]}" if sol.flops and sol.peak_tflops else "")
                    + ")")
        # Below one launch the launch is the floor: multiples of a nanosecond figure would mislead.
        floor_us, floor = (sol.time_us, "the speed of light") if sol.time_us >= LAUNCH_FLOOR_US else \
            (LAUNCH_FLOOR_US, f"one kernel launch (~{LAUNCH_FLOOR_US:g} us), the real floor here")
        standing = [f"{side} {report.times_ms[side]:.4f} ms = {report.times_ms[side] * 1e3 / floor_us:.1f}x"
                    for side in ("candidate", "eager", "compile") if report.times_ms.get(side)]
        if standing:
            head.append("  " + ", ".join(standing) + f" {floor}")
    head.append(f"GPU time {report.gpu_us / 1e3:.4f} ms in {sum(k.launches for k in report.kernels)} launch(es): "
                f"own {report.share('own'):.0%}, library {report.share('library'):.0%}, other {report.share('other'):.0%}"
                + (f" (first {MAX_KERNELS} launches only)" if report.truncated else ""))
    table = ["  share  origin   us      DRAM  mem  SM   occ  regs smem     bound    kernel"]
    for k in report.kernels:
        table.append(f"  {k.duration_us / max(report.gpu_us, 1e-9):>5.0%}  {k.origin:<7}  {k.duration_us:<7.1f} "
                     f"{_pct(k.dram_pct):>4} {_pct(k.memory_pct):>4} {_pct(k.sm_pct):>4} "
                     f"{_pct(k.achieved_occupancy_pct):>4} {k.registers or 0:>4.0f} {_bytes(k.shared_bytes):<8} "
                     f"{k.bound:<8} {_short(k.name)}" + (f" x{k.launches}" if k.launches > 1 else ""))
    whys = [f"- {_short(k.name, 30)}: {k.bound}-bound: {k.why}" for k in report.kernels[:3]]
    tail = [f"verdict: {report.verdict}"]
    room = max_lines - len(head) - len(whys) - len(tail) - 1
    if len(table) > room:
        hidden = len(table) - room + 1
        table = table[: room - 1] + [f"  ... {hidden} more kernel(s), {sum(k.duration_us for k in report.kernels[-hidden:]) / 1e3:.4f} ms"]
    return "\n".join([*head, *table, *whys, *tail])


def unavailable(reason: str, times_ms: dict[str, float] | None = None) -> CounterReport:
    return CounterReport(available=False, reason=reason, times_ms=dict(times_ms or {}))


def times_of(result: Any) -> dict[str, float]:
    """Median times (ms) of an evaluation's candidate and baselines."""
    times = getattr(result, "times", None) or {}
    return {side: float(stats["median_ms"]) for side, stats in times.items()
            if isinstance(stats, dict) and isinstance(stats.get("median_ms"), (int, float)) and math.isfinite(stats["median_ms"])}
