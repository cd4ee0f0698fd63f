"""The one record an evaluation produces (JSON-serialisable)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# status: "correct" (verified; timed), "incorrect" (ran, wrong outputs),
# "failed" (build, load, crash, timeout, rule broken) or "error": no verdict (the
# evaluator could not decide, through nothing the candidate did: no reward is given).
STATUSES = ("correct", "incorrect", "failed", "error")
NO_VERDICT = "error"  # the status of an evaluation without a verdict

# Why an evaluation has no verdict (``EvalResult.no_verdict_kind``):
BUSY = "busy"  # the host or GPU had other work while it was timed: the same evaluation again may decide
HARNESS = "harness"  # the task, the toolchain or the harness itself failed: evaluating again does not help
# Every refusal for other work on the host or GPU says what to do with these words (evaluate.rounds,
# evaluate.watchers, evaluate.protocol.quiet); the retry and every consumer tell the kinds apart by them.
BUSY_PHRASE = "evaluate again"
BUSY_ADVICE = ("the host was busy while timing; nothing is wrong with the kernel: evaluate again, "
               "or raise --retries, or quiet the host")


def no_verdict_kind(status: str | None, reason: str | None) -> str | None:
    """``BUSY`` or ``HARNESS`` for an evaluation without a verdict (status ``error``); None for a verdict."""
    if status != NO_VERDICT:
        return None
    return BUSY if BUSY_PHRASE in (reason or "") else HARNESS


def no_reward_reason(record: dict[str, Any]) -> str:
    """One line saying why an evaluation record carries no reward: its kind and reason, and the attempts made."""
    kind = no_verdict_kind(record.get("status"), record.get("reason")) or HARNESS
    attempts = record.get("attempts") or 1
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return f"no verdict ({kind}{tries}): {record.get('reason') or 'the evaluation did not finish'}"


@dataclass
class EvalResult:
    task: dict[str, Any]
    candidate: dict[str, Any]
    device: str
    policy: dict[str, Any]
    timing: dict[str, Any]
    status: str = "error"
    stage: str | None = None
    reason: str | None = None
    rule: str | None = None  # the named rule or defence that stopped the candidate, if one did
    violations: list[dict[str, Any]] = field(default_factory=list)  # static and symbol-audit findings
    compiled: bool = False
    correct: bool = False
    checks: list[dict[str, Any]] = field(default_factory=list)
    # GPU: the kernels of one profiled checked call, split into the candidate's own and the rest.
    attribution: dict[str, Any] | None = None
    build: dict[str, Any] | None = None
    times: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Geometric means of the timing rounds' speedups; ``decision`` has their intervals and whether
    # each reward decision was confident (the interval clear of the reward line).
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    decision: dict[str, Any] | None = None
    reward: float | None = None
    baseline_cached: bool = False
    environment: dict[str, Any] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    output: str = ""
    traceback: str | None = None
    notes: list[str] = field(default_factory=list)
    # GPU, when asked for (``eval --counters``, the agent's profile): ``CounterReport.to_dict()`` of one
    # profiled call. Advice for the agent; the reward never reads it.
    counters: dict[str, Any] | None = None
    # How many times it was evaluated: more than 1 where earlier attempts had no verdict for a busy host
    # (``evaluate.retry``); what was built and verified is reused by each attempt (the build cache).
    attempts: int = 1

    @property
    def no_verdict(self) -> bool:
        """The evaluator could not decide: no reward, and not the candidate's failure."""
        return self.status == NO_VERDICT

    @property
    def no_verdict_kind(self) -> str | None:
        """``BUSY`` (evaluate again, on a quieter host) or ``HARNESS`` (the task or harness failed); None with a
        verdict."""
        return no_verdict_kind(self.status, self.reason)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def unloadable(cls, task: dict[str, Any], origin: str, device: str, policy: dict[str, Any],
                   timing: dict[str, Any], reason: str) -> "EvalResult":
        """The record of a candidate that could not even be loaded (no ModelNew, say): the
        solution's failure, reward -1, like any other."""
        return cls(task=task, candidate={"origin": origin}, device=device, policy=policy, timing=timing,
                   status="failed", stage="candidate", reason=reason, reward=-1.0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalResult":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def median_ms(self, which: str) -> float | None:
        stats = self.times.get(which)
        return stats["median_ms"] if stats else None

    def summary(self) -> str:
        """A few readable lines for terminals and agent observations."""
        lines = [f"task {self.task.get('name')}  [{self.device}, policy {self.policy.get('name')}]"]
        lines.append(f"status: {self.status}" + (f" at {self.stage}: {self.reason}" if self.reason else "")
                     + (f" [rule: {self.rule}]" if self.rule else ""))
        if self.build:
            b = self.build
            took = "cached" if b["cached"] else f"{b['seconds']:.1f} s"
            lines.append(f"build: {'ok' if b['ok'] else 'FAILED'} ({took})")
            for d in b.get("diagnostics", [])[:10]:
                if d["severity"] == "error":
                    loc = f"{d['file']}:{d['line']}" if d.get("file") else "<build>"
                    lines.append(f"  {loc}: error: {d['message']}")
        for check in self.checks:
            worst = [r for r in check.get("reports", []) if r.get("max_abs_error") is not None]
            err = max((r["max_abs_error"] for r in worst), default=None)
            state = "pass" if check["ok"] else f"FAIL ({check['reason']})"
            kind = (" (record)" if check.get("record") else f" (run again {check['rerun']}, bit for bit)"
                    if check.get("rerun") else " (whole output)")
            label = f"timed call {check['call']}{kind}" if check.get("timed") else f"check {check['index'] + 1}"
            if check["ok"] and check.get("reason"):
                state = f"pass ({check['reason']})"
            lines.append(f"{label}: {state}" + (f", max abs error {err:.3g}" if err is not None else ""))
        for which in ("candidate", "eager", "compile"):
            stats = self.times.get(which)
            if stats:
                lines.append(
                    f"{which:>9}: {stats['median_ms']:.4f} ms median (p20-p80 {stats['p20_ms']:.4f}-{stats['p80_ms']:.4f}, "
                    f"n={stats['trials']}, {stats['method']})"
                )
        regions = (self.timing or {}).get("regions")
        if regions and regions.get("outside_ms"):
            # Said as a user can read it: the candidate's time is the evaluator's, and what that clock cannot see.
            lines.append(f"timed by the evaluator's own clock over {regions['regions']} regions of "
                         f"{regions['outside_ms']:.3f} ms (median; the candidate's process reported "
                         f"{regions['reported_ms']:.3f} ms): allowance {regions['allowance']:.1%} of a region, "
                         f"uncertainty {regions['uncertainty']:.1%}, resolution {regions['resolution']:.1%}")
        if self.speedup_eager is not None:
            lines.append(f"speedup: {self.speedup_eager:.2f}x vs eager, " + (
                f"{self.speedup_compile:.2f}x vs torch.compile" if self.speedup_compile is not None else "torch.compile n/a"
            ))
        if self.decision:
            parts = [f"{side} [{s['low']:.3f}, {s['high']:.3f}]" + ("" if s["confident"] else " (not confident)")
                     for side, s in self.decision["speedups"].items()]
            lines.append(f"decision: {self.decision['rounds']} rounds; {int(100 * self.timing.get('confidence', 0.95))}% "
                         "intervals " + ", ".join(parts))
        if self.attribution and self.attribution.get("coverage") is not None:
            a = self.attribution
            lines.append(f"coverage: {a['coverage']:.1%} of forward's GPU time in the candidate's own kernels "
                         f"({a['own_launches']} launch(es) of {a['defined']} defined)")
        lines.extend(f"note: {note}" for note in self.notes)
        if self.no_verdict:
            tries = f" after {self.attempts} attempts" if self.attempts > 1 else ""
            lines.append(f"no verdict{tries}: " + (BUSY_ADVICE if self.no_verdict_kind == BUSY else
                                                    "the task or the evaluator failed, not the candidate"))
            lines.append("reward: none (no verdict)")
        else:
            lines.append(f"reward: {self.reward}" + (f" (attempt {self.attempts})" if self.attempts > 1 else ""))
        return "\n".join(lines)
