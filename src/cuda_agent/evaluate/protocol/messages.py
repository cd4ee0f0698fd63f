"""The workers' request protocol, typed: one frozen dataclass per request a worker accepts and per
reply the evaluator reads fields from.

Requests travel as JSON lines ``{"op": ..., field: value, ...}``: ``to_message()`` writes one,
``from_message()`` reads one back and refuses a missing, unknown or ill-typed field with a
``ValueError`` that names the op and the field. Replies come from processes that may run untrusted
code (the candidate's): ``from_reply()`` checks every field's type, so a forged or ill-typed reply is
refused before the evaluator reads it (``Channel.ask_typed`` turns the refusal into a ``Stop``).

``REQUESTS`` holds the evaluation workers' requests (``evaluate.worker.loop``, roles reference and
candidate: a request both roles accept, with fields only one of them reads, is one class with
optional fields); ``SCREEN_REQUESTS`` the synth screener's (``synth.screen``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from cuda_agent.evaluate.protocol.fields import _Fields, _Reply, _Request


# -- requests of the evaluation workers ------------------------------------------------------------
@dataclass(frozen=True)
class ExpectRequest(_Request):
    """Reference: compute (and hold) the expected output of the inputs drawn from ``seed``."""
    op: ClassVar[str] = "expect"
    seed: int
    atol: float
    rtol: float
    scale: bool = False
    strict: bool = False  # TF32 off for the expected output
    slack: float = 0.0  # Policy.precision_slack


@dataclass(frozen=True)
class LoadRequest(_Request):
    """Both roles: run the task program; the reference builds Model and writes its state dict, the
    candidate imports model_new.py (``model_new_file``, ``modules``)."""
    op: ClassVar[str] = "load"
    task_file: str
    task_name: str
    task_source: str
    device: str
    tf32: str
    init_seed: int
    state_dict_path: str
    allowed_aten: list[str] | None = None
    memory_limit: int | None = None  # bytes each evaluation process may use (CPU: refused early if the task needs more)
    warm: ExpectRequest | None = None  # reference: one expected output computed and dropped
    model_new_file: str | None = None  # candidate
    modules: dict[str, str] | None = None  # candidate: extension name -> built file
    language: str = "cuda"  # candidate: "triton" sets Triton up before its code loads (``evaluate.worker.triton_runtime``)
    triton_kernels: str | None = None  # candidate, Triton on a GPU: the build stage's kernel cache, copied into the job
    # candidate: no-op regions through the brackets once the task is loaded and before its code is, which
    # tell the evaluator what the brackets cost (region_clock.Overhead), with this hold and seed
    bell_regions: int = 0
    bell_hold_us: float = 0.0
    bell_seed: int = 0
    bell_written: bool = False  # those regions' inputs written from outside as the rounds' are (TimeRequest.written)
    timing: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReadyRequest(_Request):
    """Candidate: answered once the worker's own start-up is done, before any candidate code loads
    (what the process looks like then is the harness's alone)."""
    op: ClassVar[str] = "ready"
    bell: bool = False  # the region brackets' socket follows on the descriptor channel (evaluate.protocol.regions)


@dataclass(frozen=True)
class WeightsRequest(_Request):
    op: ClassVar[str] = "weights"
    state_dict_path: str


@dataclass(frozen=True)
class AttachRequest(_Request):
    op: ClassVar[str] = "attach"
    bytes: int


@dataclass(frozen=True)
class RunRequest(_Request):
    op: ClassVar[str] = "run"
    seed: int
    dir: str
    profile: bool = False
    # On a GPU whose memory is read from outside: the output described (``RunReply.described``) and its
    # allocations sent through the brackets (``regions.CHECK_REGION``) for the reference to copy it out while the
    # process is stopped, instead of its bytes handed over in ``dir``.
    outside: bool = False


@dataclass(frozen=True)
class CalibrateRequest(_Request):
    op: ClassVar[str] = "calibrate"
    seed: int
    timing: dict[str, Any]
    side: str | None = None  # reference: the baseline ("eager" or "compile")


@dataclass(frozen=True)
class TimeRequest(_Request):
    op: ClassVar[str] = "time"
    seed: int
    first: int
    trials: int
    calls: int
    timing: dict[str, Any]
    side: str | None = None  # reference: the baseline, or "empty" (the round without the calls)
    probe: int | None = None  # the secret the recorded positions are drawn from (evaluate.protocol.records)
    hold_us: float | None = None  # candidate and empty rounds: the hold the evaluator set (timing.HostLaunch)
    bell: bool = False  # each region bracketed by the evaluator (evaluate.protocol.regions)
    outside: bool = False  # its calls described in DONE and read from outside (evaluate.protocol.outside); on a GPU the
    # candidate exports their memory after DONE (evaluate.protocol.vmm)
    # Its inputs described in READY and their values written from outside while it is stopped, drawn from seeds
    # it never learns (evaluate.protocol.outside.InputWriter): what it drew from ``seed`` only gives them their memory.
    written: bool = False


@dataclass(frozen=True)
class LeafSample(_Reply):
    """One tensor of a call, read at the positions ``evaluate.protocol.records.positions`` draws."""
    shape: list[int]
    dtype: str
    values: list[float]


@dataclass(frozen=True)
class CallRecord(_Reply):
    """What a timed call left right after its region ended (``evaluate.protocol.records``)."""
    index: int
    outputs: list[LeafSample]
    inputs: list[LeafSample]


@dataclass(frozen=True)
class RecordCheck(_Reply):
    """One record to check: the call's input seed and the round's probe."""
    seed: int
    probe: int
    record: CallRecord


@dataclass(frozen=True)
class RecordsRequest(_Request):
    """Reference: compare records of timed calls with the expected outputs at the same positions."""
    op: ClassVar[str] = "records"
    checks: list[RecordCheck]
    atol: float
    rtol: float
    scale: bool = False
    strict: bool = False


@dataclass(frozen=True)
class SampleRequest(_Request):
    """Reference: a candidate's output, handed over as a checked one is, read at the positions a record
    of ``probe`` reads (``records.sample_output``)."""
    op: ClassVar[str] = "sample"
    dir: str
    manifest: dict[str, Any]
    probe: int
    keep: bool = False  # hold the output, to be compared whole with the next one sampled (then let go)


@dataclass(frozen=True)
class TimedRequest(_Request):
    op: ClassVar[str] = "timed"


@dataclass(frozen=True)
class OutputRequest(_Request):
    op: ClassVar[str] = "output"
    index: int
    dir: str


@dataclass(frozen=True)
class ReleaseRequest(_Request):
    op: ClassVar[str] = "release"
    ended: bool = False  # the evaluation is over: the candidate's GPU allocations held for it released too


@dataclass(frozen=True)
class QuietRequest(_Request):
    """Reference: probe the GPU until no other context has work (``evaluate.protocol.quiet``), for up to ``within_s``."""
    op: ClassVar[str] = "quiet"
    within_s: float


@dataclass(frozen=True)
class AfterDoneRequest(_Request):
    """Reference, asked before a candidate's region's GO: one quiet probe as soon as the evaluator rings ``region``
    on the doorbell (``quiet.after_done``), whose page is handed over first where ``page``."""
    op: ClassVar[str] = "after_done"
    region: int
    within_s: float
    page: bool = False


@dataclass(frozen=True)
class CompareRequest(_Request):
    op: ClassVar[str] = "compare"
    dir: str
    manifest: dict[str, Any]
    atol: float
    rtol: float
    scale: bool = False
    kept: bool = False  # the output kept by ``KeepGpuRequest`` compared, not one handed over in ``dir``


@dataclass(frozen=True)
class DegenerateRequest(_Request):
    op: ClassVar[str] = "degenerate"
    seeds: list[int]
    atol: float
    rtol: float
    scale: bool


@dataclass(frozen=True)
class CompileRequest(_Request):
    op: ClassVar[str] = "compile"
    seed: int


@dataclass(frozen=True)
class GpuHeld(_Fields):
    """The candidate's exported allocations a GPU request uses, as the reference holds them mapped from one request
    to the next until the evaluation ends (``vmm.Importer``, released by ``ReleaseRequest(ended=True)``): ``ids`` in the request's
    order, ``new`` the positions in ``ids`` whose descriptors were sent on the descriptor channel just before (not
    held yet), ``drop`` held ones to release first (another allocation took their place)."""
    ids: list[int]
    new: list[int]
    drop: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class ReadGpuRequest(_Request):
    """Reference: read the candidate's GPU memory from outside it (``evaluate.protocol.vmm``): the ``held`` allocations,
    each ``sizes[i]`` bytes; each read ``[allocation, offset, bytes]``, all read twice ``apart_s`` apart."""
    op: ClassVar[str] = "read_gpu"
    held: GpuHeld
    sizes: list[int]
    reads: list[list[int]]
    apart_s: float


@dataclass(frozen=True)
class DrawRequest(_Request):
    """Reference: the inputs of timed calls drawn from ``seeds`` (secrets the candidate's process never sees),
    each tensor laid out as the candidate described its own (``leaves``: per call, per tensor ``[dtype, shape,
    strides]``), packed into memory it shares with the evaluator (``evaluate.protocol.outside.InputWriter``)."""
    op: ClassVar[str] = "draw"
    seeds: list[int]
    leaves: list[list[list[Any]]]
    send: bool = False  # the shared memory's descriptor wanted (the evaluator's first draw of an evaluation)


@dataclass(frozen=True)
class WriteGpuRequest(_Request):
    """Reference: as ``DrawRequest``, the drawn inputs written into the candidate's GPU memory: the ``held``
    allocations, lying at ``offsets`` from the lowest as in the candidate's address space (a tensor may span
    several that follow one another); each tensor ``[dtype, shape, strides, at]``, ``at`` its first element's
    offset from that lowest. Then the L2 flushed (``flush_bytes`` zeroed) and the device synchronised."""
    op: ClassVar[str] = "write_gpu"
    held: GpuHeld
    sizes: list[int]
    offsets: list[int]
    seeds: list[int]
    leaves: list[list[list[Any]]]
    flush_bytes: int = 0


@dataclass(frozen=True)
class KeepGpuRequest(_Request):
    """Reference: as ``WriteGpuRequest``'s memory, timed call ``call``'s output tensors (``leaves``: ``[dtype,
    shape, strides, at]``) copied out of the candidate's GPU memory into the reference's own, kept for a later
    ``CompareRequest(kept=True)`` (the one kept before is dropped first)."""
    op: ClassVar[str] = "keep_gpu"
    held: GpuHeld
    sizes: list[int]
    offsets: list[int]
    leaves: list[list[Any]]
    call: int


REQUESTS: dict[str, type[_Request]] = {cls.op: cls for cls in (
    ReadyRequest, LoadRequest, WeightsRequest, AttachRequest, RunRequest, CalibrateRequest, TimeRequest, TimedRequest,
    OutputRequest, ExpectRequest, ReleaseRequest, CompareRequest, DegenerateRequest, CompileRequest,
    RecordsRequest, SampleRequest, ReadGpuRequest, DrawRequest, WriteGpuRequest, KeepGpuRequest, QuietRequest,
    AfterDoneRequest)}


# -- requests of the synth screener ----------------------------------------------------------------
@dataclass(frozen=True)
class ScreenCheckRequest(_Request):
    op: ClassVar[str] = "check"
    path: str
    name: str
    atol: float
    rtol: float
    scale: bool
    seeds: list[int]
    stochastic_ops: list[str] | None = None


@dataclass(frozen=True)
class ScreenTimeRequest(_Request):
    op: ClassVar[str] = "time"
    compiled: bool = False
    tf32: str = "on"


@dataclass(frozen=True)
class ScreenCompileRequest(_Request):
    op: ClassVar[str] = "compile"


SCREEN_REQUESTS: dict[str, type[_Request]] = {cls.op: cls for cls in (
    ScreenCheckRequest, ScreenTimeRequest, ScreenCompileRequest)}


def parse_request(op: str, message: Any, requests: dict[str, type[_Request]] = REQUESTS) -> Any:
    """The request ``message`` (a dict without its op, or already a request) as ``op``'s dataclass."""
    cls = requests.get(op)
    if cls is None:
        raise ValueError(f"unknown request {op!r}")
    if isinstance(message, cls):
        return message
    return cls.from_message(message)


# -- replies the evaluator reads -------------------------------------------------------------------
@dataclass(frozen=True)
class ShareInfo(_Reply):
    shared: bool
    reason: str | None = None
    bytes: int | None = None
    pinned: bool | None = None


@dataclass(frozen=True)
class ReadyReply(_Reply):
    """Candidate, before any candidate code: where the C function pointers behind the harness's builtins
    live in this process (``guard.integrity.native_slots``), and the data pointers that reach the
    allocators and the C library's clocks (``allocator_slots``, ``vdso_slots``), for the evaluator to read
    from outside;
    whether nothing can become executable in it any more (``sandbox.nocode``: "on", or why not); on a GPU
    whether its memory can be exported for reads from outside (``evaluate.protocol.vmm``: "on", or why not)."""
    slots: dict[str, int] | None = None
    code_lock: str | None = None
    gpu_export: str | None = None


@dataclass(frozen=True)
class LoadReply(_Reply):
    """The reference's (parameters, gpu, share) or the candidate's (nothing)."""
    parameters: int | None = None
    gpu: str | None = None
    share: ShareInfo | None = None
    bell_ms: list[float] | None = None  # candidate: the no-op regions as the pristine harness timed them
    bell_tail_ms: float = 0.0  # candidate, GPU: their median time from the last synchronise to DONE (HostLaunch)
    fixed_inputs: bool | None = None  # reference: its draws differ in tensor values alone (DrawRequest, WriteGpuRequest)
    device_bytes: int = 0  # reference: its GPU's memory (0: the CPU backend), what sizes a region's calls
    output_bytes: int = 0  # reference: its warm call's output, what says a task is memory-hungry (``HUNGRY_SHARE``)
    thread_ban: str | None = None  # candidate: whether the kernel ends it on a new thread or process (``sandbox.nothreads``)
    triton: str | None = None  # candidate, a Triton one: how Triton runs in its process (``evaluate.worker.triton_runtime``)


@dataclass(frozen=True)
class ExpectReply(_Reply):
    fingerprint: list[Any]
    output_bytes: int
    input_bytes: int = 0  # the call's input tensors (with its output: what a timed call keeps alive)
    allowance: float = 1.0


@dataclass(frozen=True)
class RunReply(_Reply):
    fingerprint: list[Any]
    manifest: dict[str, Any]  # empty where the output was described instead (``RunRequest.outside``)
    described: dict[str, Any] | None = None  # ``outside.describe`` of the output
    kernels: Any = None  # the profiled call's kernel report (parse_kernel_report checks it)


@dataclass(frozen=True)
class CalibrateReply(_Reply):
    estimate_ms: float  # wall time per call, its input draw included (sizes a round)
    call_ms: float = 0.0  # the call alone (sizes a region); 0: not known
    host_us: float = 0.0  # the longest recent host enqueue per call (us), learned in the warm-up


@dataclass(frozen=True)
class HostReport(_Reply):
    """A round's host side (``timing.HostLaunch``): the longest region enqueue, the longest hold, and
    the regions whose enqueue outlasted their hold (the GPU waited for the host inside them), and
    those timed to the fence (``TimeReply.samples`` holds the fence's time for them), and whether
    the side's warm-up found it launch-bound."""
    enqueue_us: float = 0.0
    hold_us: float = 0.0
    late: int = 0
    fenced: int = 0
    host_bound: bool = False


@dataclass(frozen=True)
class TimeReply(_Reply):
    samples: list[float]
    records: list[CallRecord] = dataclasses.field(default_factory=list)  # candidate: its calls' records
    host: HostReport | None = None
    busy_us: float | None = None  # reference, a baseline's round on a GPU: its regions' longest quiet probe


@dataclass(frozen=True)
class RecordVerdict(_Reply):
    ok: bool
    reason: str | None = None
    rule: str | None = None


@dataclass(frozen=True)
class RecordsReply(_Reply):
    verdicts: list[RecordVerdict]


@dataclass(frozen=True)
class SampleReply(_Reply):
    outputs: list[LeafSample]
    reason: str | None = None  # why the output could not be read (then no outputs)
    same_as_kept: bool | None = None  # whether every element equals the output kept before (None: none kept)


@dataclass(frozen=True)
class TimedCall(_Reply):
    index: int
    fingerprint: list[Any]


@dataclass(frozen=True)
class TimedReply(_Reply):
    checked: list[TimedCall]


@dataclass(frozen=True)
class OutputReply(_Reply):
    manifest: dict[str, Any]


@dataclass(frozen=True)
class AttachReply(_Reply):
    attached: bool
    reason: str | None = None
    pinned: bool | None = None


@dataclass(frozen=True)
class ReadGpuReply(_Reply):
    data: list[str]  # each read's bytes (hex), as first read
    changed: list[int]  # the reads whose bytes differed the second time
    error: str | None = None  # the memory could not be imported, mapped or read (the candidate's doing)
    steps_ms: dict[str, float] | None = None  # where the reference's time went (benchmarks' region cost)


@dataclass(frozen=True)
class DrawReply(_Reply):
    spans: list[list[list[int]]]  # per call, per tensor: [offset, bytes] of its memory's span in the shared memory
    bytes: int = 0  # the shared memory's size; a new one's descriptor was sent before this reply (``grown``)
    grown: bool = False
    error: str | None = None  # the candidate described other inputs than the task draws (its doing)


@dataclass(frozen=True)
class WriteGpuReply(_Reply):
    error: str | None = None  # the memory could not be imported, mapped or written, or other inputs were described
    busy_us: float | None = None  # the quiet probe's wait after the writes (``evaluate.protocol.quiet``)
    steps_ms: dict[str, float] | None = None  # where the reference's time went (benchmarks' region cost)


@dataclass(frozen=True)
class KeepGpuReply(_Reply):
    error: str | None = None  # the memory could not be imported, mapped or read (the candidate's doing)


@dataclass(frozen=True)
class QuietReply(_Reply):
    after_ms: float | None  # how long the GPU took to be quiet; None: it was not within the request's time


@dataclass(frozen=True)
class AfterDoneReply(_Reply):
    wait_us: float  # the probe's wait: GPU work left queued by the region (up to a time slice), plus a switch
    launched_ns: int  # when it was launched (``time.time_ns``); 0: the region was called off, nothing probed


@dataclass(frozen=True)
class ReleaseReply(_Reply):
    reserved: int = 0


@dataclass(frozen=True)
class CompareReply(_Reply):
    reports: list[dict[str, Any]]


@dataclass(frozen=True)
class DegenerateReply(_Reply):
    passing: list[str]
    details: dict[str, str]


@dataclass(frozen=True)
class CompileReply(_Reply):
    compile_seconds: float | None = None
    compile_error: str | None = None
