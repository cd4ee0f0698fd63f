"""What counts as correct and how things are timed: recorded in every result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda_agent.guard import CodePolicy


TF32_MODES = ("off", "torch", "on")


@dataclass(frozen=True)
class Policy:
    """Correctness, precision and reward rules, named by a preset (``Policy.preset``).

    ``tf32`` is what every process gets, the baselines included, so a candidate
    never has a precision freedom its baselines lack: ``off`` (strict fp32),
    ``torch`` (torch's defaults: TF32 for cuDNN convolutions only, as in the
    paper's harness) or ``on`` (TF32 for matmul and cuDNN). With
    ``strict_expected`` the expected outputs are computed with TF32 off
    whatever ``tf32`` says. With ``scale_tolerance``, ``atol`` is relative to the
    RMS of each expected output, so outputs far below 1 (where zeros would pass
    a fixed atol) are held to the same standard as outputs near 1. With
    ``precision_slack``, a candidate may be as far from the strict truth as
    ``precision_slack`` times the baseline's own arithmetic is (TF32 convolutions
    err by more than 1e-3): the precision freedom the baselines have is never
    refused, while arithmetic much coarser than theirs still fails.
    """

    name: str = "fair"
    atol: float = 1e-3
    rtol: float = 1e-3
    scale_tolerance: bool = True
    checks: int = 5
    tf32: str = "on"
    strict_expected: bool = True
    # With strict_expected and TF32 allowed: the tolerance widens to this many times the error
    # of the task's own Model under the baselines' flags, where that is larger (0: never).
    precision_slack: float = 2.0
    max_speedup: float | None = 100.0  # a result faster than this (vs eager) fails as implausible
    # Memory system for the speed-of-light floor: (GB/s, L2 MiB); None: looked up from the GPU's name.
    memory_system: tuple[float, float] | None = None
    speed_of_light: bool = True
    reward: str = "milestone"  # "milestone" | "speedup"
    beat_factor: float = 0.95  # "faster" means t < beat_factor * t_baseline
    allowed_aten: tuple[str, ...] = ()  # ATen operators forward may run beyond allocation and views
    libraries: tuple[str, ...] = ("cublas", "cudnn")  # vendor libraries kernels may call (paper: GEMM, convolutions)
    allow_streams: bool = False
    static_checks: bool = True  # source checks and symbol audit; off only to test the runtime guards alone
    # GPU: profile one checked call and attribute its kernels to the candidate's extension or not.
    attribute_kernels: bool = True
    min_coverage: float = 0.0  # share of forward's GPU time the candidate's own kernels must carry (0: report only)
    # After the rounds, one recorded timed call runs again under check and its record must match bit for
    # bit (where it does not, a second run compared with the first in every element decides whether the
    # candidate's results vary at all): rule ``unwatched-compute``, against code that computes otherwise
    # when nothing watches (docs/SECURITY.md).
    rerun_check: bool = True
    # Where timed inputs' values are drawn from the evaluator's own seeds and written from outside the candidate's
    # process once it said READY (``outside.InputWriter``, ``GpuInputWriter``; a draw it can predict lets it compute
    # outputs before the region): "all" (both backends), "cpu" (the CPU backend only) or "off". On a GPU each region
    # then waits for the reference's draw, write and L2 flush: a few percent of a warm evaluation
    # (benchmarks/RESULTS.md, "Warm evaluation speed").
    outside_inputs: str = "all"

    def __post_init__(self) -> None:
        if self.checks < 1:
            raise ValueError("Policy.checks must be at least 1.")
        if self.reward not in ("milestone", "speedup"):
            raise ValueError(f"unknown reward {self.reward!r}; use 'milestone' or 'speedup'.")
        if self.tf32 not in TF32_MODES:
            raise ValueError(f"unknown tf32 mode {self.tf32!r}; use one of {', '.join(TF32_MODES)}.")
        if self.max_speedup is not None and self.max_speedup <= 1:
            raise ValueError("Policy.max_speedup must be above 1 (or None for no ceiling).")
        if self.precision_slack < 0:
            raise ValueError("Policy.precision_slack must be 0 (off) or positive.")
        if self.outside_inputs not in ("cpu", "all", "off"):
            raise ValueError(f"unknown outside_inputs {self.outside_inputs!r}; use 'cpu', 'all' or 'off'.")
        if not 0.0 <= self.min_coverage <= 1.0:
            raise ValueError("Policy.min_coverage is a share of GPU time: between 0 and 1.")

    def writes_inputs(self, device: str) -> bool:
        """Whether timed inputs' values come from outside the candidate's process on ``device``."""
        return self.outside_inputs == "all" or (self.outside_inputs == "cpu" and device == "cpu")

    @classmethod
    def preset(cls, name: str, **changes: Any) -> "Policy":
        """``paper``, ``strict`` or ``fair`` (the default), with optional overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown policy preset {name!r}; use one of {', '.join(PRESETS)}.")
        return replace(PRESETS[name], **changes)

    def tolerance(self) -> dict[str, Any]:
        """What a comparison takes: ``{"atol", "rtol", "scale"}`` (``scale``: ``scale_tolerance``)."""
        return {"atol": self.atol, "rtol": self.rtol, "scale": self.scale_tolerance}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> "Policy":
        return replace(self, **changes)

    def code_policy(self) -> "CodePolicy":
        from cuda_agent.guard import CodePolicy

        return CodePolicy(libraries=tuple(self.libraries), allow_streams=self.allow_streams,
                          allowed_aten=tuple(self.allowed_aten))


PRESETS = {
    # The paper's released protocol: 1e-2 absolute and relative, torch's default
    # precision flags, no ceiling on speedups. For reproducing its numbers.
    "paper": Policy(name="paper", atol=1e-2, rtol=1e-2, scale_tolerance=False, tf32="torch",
                    strict_expected=False, max_speedup=None),
    # fp32 to 1e-4: only fp32 arithmetic passes; TF32 off everywhere.
    "strict": Policy(name="strict", atol=1e-4, rtol=1e-4, scale_tolerance=True, tf32="off", strict_expected=True),
    # The default: baselines get TF32 like the candidate; the truth is strict
    # fp32; 1e-3 (atol relative to each output's RMS) rejects bf16 arithmetic on GEMMs, which 5e-3
    # still let through; TF32 convolutions err by up to 1.5x that, so the tolerance widens to
    # twice the baseline's own error where that is larger (benchmarks/precision_calibration.py).
    "fair": Policy(),
}


BASELINE_HOLDS = ("first-call", "adaptive", "fixed")
# Settings kept in older records and configs that mean nothing now, dropped when read: the outside clock's limits on
# the candidate's own report (the evaluator's clock times the candidate itself), and the host's CPU pressure over the
# baselines (the timing threads' own waits, ``wait_max``, are judged instead).
RETIRED_TIMING = ("region_slack", "region_us", "outside_wins", "region_spread_max", "pressure_max")
# torch's intra-op threads in an evaluation process on the CPU backend (``worker.loop.main``), as a candidate's own
# code has one (``sandbox.nothreads``): the baselines are timed like for like and alike on any host, and work on
# another core slows no side. With a thread per core, one busy process beside an evaluation on two cores timed an
# honest 0.3x kernel at 3.6-4.5x (docs/CONSTANTS.md).
CPU_THREADS = 1


@dataclass(frozen=True)
class TimingConfig:
    """One timing method for candidate and baselines alike.

    ``events``: device events around each trial (``end_fence``, ``hold_us``), L2
    flushed before each trial. ``profiler``: the paper's
    measure (CUDA kernel device time in torch.profiler). ``host``: the same
    protocol as ``events`` with a host clock (CPU backend).

    An evaluation times the candidate and both baselines in interleaved rounds
    (``baselines="interleaved"``): each round times every side for about
    ``round_ms`` in a rotating order, so a slow spell of the machine falls on
    all of them, and each round gives one speedup. After ``rounds_min`` rounds,
    while a speedup's ``confidence`` interval straddles a reward line, more
    rounds run, up to ``rounds_max`` and ``budget_s``. A call shorter than
    ``region_ms`` is timed as several calls (fresh inputs each) per timed
    region, so launch jitter averages out. ``baselines="cached"`` takes the
    baselines from the cache when they are there (the benchmark tables) and
    times the candidate alone. A baseline whose per-round medians vary by more
    than ``baseline_spread`` (CV) is measured again, and never cached.
    """

    method: str = "auto"  # auto -> events on cuda, host on cpu
    warmup: int = 5
    warmup_ms: float = 25.0
    min_trials: int = 20
    max_trials: int = 200
    target_ms: float = 1000.0  # measure()'s one-shot run (the synth screen)
    flush_l2: bool = True
    flush_bytes: int = 256 * 1024 * 1024
    profiler_warmup: int = 5
    profiler_iters: int = 10
    baselines: str = "interleaved"  # "interleaved" | "cached"
    rounds_min: int = 5
    rounds_max: int = 40
    round_ms: float = 10.0
    round_trials: tuple[int, int] = (4, 100)
    # The shortest region a side's calls are grouped into. Regions are made longer where the evaluator's clock needs
    # it (``allowance_target`` and the two below, from the brackets' calibration), up to ``region_max_ms``: what
    # the outside clock cannot see or resolve is a fixed time a region, so a longer region leaves a smaller share.
    region_ms: float = 2.0
    max_calls: int = 400  # a 0.05 ms call (the release's axpby) reaches a 20 ms region
    region_bytes: int = 2 << 30  # the most a region's calls keep alive together (inputs and outputs)
    # On a GPU, or this share of its memory where that is more (5-9 GB on an 80-141 GB card): sub-millisecond calls of
    # gigabytes (cuda_gelu: 2 GiB, 0.52 ms) get the region_ms the outside clock needs (docs/SECURITY.md).
    region_memory_share: float = 1 / 16
    confidence: float = 0.95
    budget_s: float = 15.0
    baseline_spread: float = 0.05
    # Where a timed region ends (events): "device" records the end event after a device-wide
    # synchronise on the host, so it carries the host's wake-up latency (tens of us, and it moves
    # with the process); "stream" records it in stream order right after the calls and checks,
    # against a fence taken after the synchronise, that no work ran past it (a region whose fence
    # is later than an empty region's ever was is timed to the fence instead).
    end_fence: str = "stream"
    # Microseconds the GPU is kept busy before the start event, so the host has enqueued the
    # region's launches when it starts: the host's time to reach the GPU (a compiled module's
    # guards, Python dispatch) moves by tens of us from one process to the next, and left in the
    # region it moved whole evaluations by 2-5% (experiments/timing_stability.py). 0: off.
    hold_us: float = 200.0
    # torch.compile's guards and launcher can take longer a call than hold_us (docs/CONSTANTS.md):
    # the GPU then waits for the host inside the region, which moves compile's time by up to a fifth
    # between evaluations while eager's stays within 0.1%.
    # "first-call" (the default) grows eager's and compile's holds to cover their first call's
    # enqueue (timing.HostLaunch): the first call of a region is the only one a stream of calls waits
    # for when the host enqueues faster than the GPU runs; a launch-bound side (host over twice its GPU
    # time) keeps hold_us, since a stream of its calls waits for the host. The candidate keeps hold_us:
    # a hold is time its process could compute in unseen by the outside clock, so it never grows on
    # its word.
    # "adaptive" covers a baseline's whole region and the candidate's with twice eager's host time
    # per call; on the launch-bound axpby that made rewards flip (docs/ARCHITECTURE.md, "Holds").
    # "fixed" holds hold_us everywhere (what older baselines tables were timed with).
    baseline_hold: str = "first-call"
    hold_max_us: float = 20000.0
    # The outside clock (evaluate.decide.clock_check): the time of a candidate's round that neither its
    # reported regions nor the same round without the calls explain may be at most clock_slack of the
    # reported regions, plus clock_trial_us per timed region, plus clock_noise times the rounds' own
    # scatter, plus clock_harness_share of the harness's own time (the empty round). The last is wide
    # because the empty round runs in the reference process, whose harness time differs from a legitimate
    # candidate process's by several ms a round for reasons not found (docs/CONSTANTS.md).
    clock_slack: float = 0.1
    clock_trial_us: float = 50.0
    clock_noise: float = 3.0
    clock_harness_share: float = 0.5
    # Each of the candidate's timed regions is opened and closed by the evaluator (evaluate.protocol.regions), and its time
    # is the evaluator's (evaluate.region_clock): the candidate's own report is a diagnostic. What that clock leaves
    # unseen (on a GPU, the window from DONE to the probe's launch: its ``allowance``) and how far its calibrated
    # cost may be off (``uncertainty``) are stated in every result as shares of the median region. Regions are
    # sized so that each is at most ``allowance_target`` and ``uncertainty_target`` and the calibration's spread at
    # most ``resolution_target`` of a region, up to ``region_max_ms``; an evaluation whose allowance is still over
    # ``allowance_max`` (half the reward's 5% line) is refused as an error (no reward: the host or GPU was too busy
    # to time it; evaluate again), and one whose uncertainty is over ``uncertainty_max`` where that could change its
    # reward (``verdict.clock_settles``).
    brackets: bool = True
    allowance_target: float = 0.0125
    uncertainty_target: float = 0.0125
    resolution_target: float = 0.01
    region_max_ms: float = 20.0
    allowance_max: float = 0.025
    uncertainty_max: float = 0.025
    # CPU backend: the most of a side's timing in which the thread that runs its calls waited runnable for a
    # CPU (evaluate.pressure), other work on the host having its core. Its time grows by as much; above half
    # a reward line the evaluation has no verdict (status error, no reward) and is retried.
    wait_max: float = 0.025
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in ("auto", "events", "host", "profiler"):
            raise ValueError(f"unknown timing method {self.method!r}; use events, host or profiler.")
        if self.baselines not in ("interleaved", "cached"):
            raise ValueError(f"unknown baselines mode {self.baselines!r}; use interleaved or cached.")
        if self.end_fence not in ("device", "stream"):
            raise ValueError(f"unknown end_fence {self.end_fence!r}; use device or stream.")
        if not 0 <= self.hold_us <= 1000:
            raise ValueError("TimingConfig.hold_us is between 0 and 1000 microseconds.")
        if self.baseline_hold not in BASELINE_HOLDS:
            raise ValueError(f"unknown baseline_hold {self.baseline_hold!r}; use one of {', '.join(BASELINE_HOLDS)}.")
        if not self.hold_us <= self.hold_max_us <= 100_000:
            raise ValueError("TimingConfig.hold_max_us is between hold_us and 100000 microseconds.")
        if self.min_trials < 20:
            raise ValueError("TimingConfig.min_trials must be at least 20.")
        if not 3 <= self.rounds_min <= self.rounds_max:
            raise ValueError("TimingConfig needs 3 <= rounds_min <= rounds_max (a speedup's interval needs rounds).")
        if not 2 <= self.round_trials[0] <= self.round_trials[1]:
            raise ValueError("TimingConfig.round_trials is (min, max) trials per round, min at least 2.")
        if not 0 < self.allowance_target <= self.allowance_max < 1 or not 0 < self.uncertainty_target <= self.uncertainty_max < 1:
            raise ValueError("TimingConfig: 0 < allowance_target <= allowance_max < 1, and the same for uncertainty.")
        if not 0 < self.resolution_target < 1 or not self.region_ms <= self.region_max_ms <= 1000:
            raise ValueError("TimingConfig: 0 < resolution_target < 1 and region_ms <= region_max_ms <= 1000.")
        if not 0 < self.wait_max <= 1:
            raise ValueError("TimingConfig.wait_max is a share of a side's timing, above 0 and at most 1.")
        if not 0.5 <= self.confidence < 1:
            raise ValueError("TimingConfig.confidence is a probability between 0.5 and 1.")

    def resolved(self, device: str) -> "TimingConfig":
        if self.method != "auto":
            if device == "cpu" and self.method != "host":
                raise ValueError(f"timing method {self.method!r} needs a CUDA device; use 'host' on the CPU.")
            return self
        return replace(self, method="events" if device == "cuda" else "host")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TimingConfig":
        data = {k: v for k, v in data.items() if k not in RETIRED_TIMING}
        if "round_trials" in data:
            data["round_trials"] = tuple(data["round_trials"])
        return cls(**data)
