"""The checks of the candidate's outputs against the reference's: the checks before timing (fresh inputs
from secret seeds, one call profiled for attribution), and after the rounds the timed calls' records, the
last timed call whole and one recorded call run again. Expected outputs stay in the reference process;
it answers with verdicts only."""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from cuda_agent.build import BuildResult
from cuda_agent.evaluate.brackets import KEEP_MAX_BYTES
from cuda_agent.evaluate.protocol.channel import Channel, Stop
from cuda_agent.evaluate.context import Evaluation, Setup
from cuda_agent.evaluate.protocol.messages import (
    CallRecord, CompareReply, CompareRequest, ExpectReply, OutputReply, OutputRequest, RecordCheck, RecordsReply,
    RecordsRequest, RunReply, RunRequest, SampleReply, SampleRequest, TimedReply, TimedRequest,
)
from cuda_agent.evaluate.protocol.records import same_samples
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.rounds import CandidateLog
from cuda_agent.evaluate.protocol.timing import trial_seed
from cuda_agent.guard.attribution import Attribution, AttributionError, attribute, extension_kernels, parse_kernel_report

# Recorded timed calls whose records are checked, drawn after all rounds uniformly over all of them (the
# last call is checked whole besides): a candidate wrong on a share p of its calls passes with (1-p)^8.
TIMED_CHECKS = 8


def own_kernels(setup: Setup, built: BuildResult, result: EvalResult) -> frozenset[str] | None:
    """The kernels the built extension defines, or None where attribution is off or impossible."""
    if setup.device != "cuda" or not setup.policy.attribute_kernels:
        return None
    try:
        return extension_kernels([Path(p) for p in built.modules.values()])
    except AttributionError as exc:
        result.notes.append(f"no kernel attribution: {exc}")
        return None


def run_checks(run: Evaluation, own: frozenset[str] | None) -> Attribution | None:
    """The checks: fresh inputs from secret seeds, both sides computing at once; one of them,
    chosen in secret, profiled (its operators; on the GPU its kernels, for attribution). Returns
    the profiled call's attribution, for the pipeline to judge."""
    setup, result, reference, candidate = run.setup, run.result, run.reference.channel, run.candidate
    policy = setup.policy
    clock = time.monotonic()
    profiled = secrets.randbelow(policy.checks) if policy.checks > 0 else -1
    attribution = None
    # On a GPU whose memory is read from outside, every check after the first is copied out of the candidate's
    # memory by the reference (``CandidateBrackets.keep_checked``). The first is handed over whole, structure and
    # plain values and devices with it, which a copy of the output's tensors does not show. Only where the task's
    # draws differ in their values alone: an output whose size changes with the seed could outgrow the copy. The
    # copy takes the reference the memory the handed-over output's would (it replaces it): any size the expected
    # output has, up to twice it for an output laid out with gaps (at least ``KEEP_MAX_BYTES``). A 6 GiB output
    # crosses host memory twice a check (a tenth of a second each way); copied, it does not leave the GPU.
    loaded = run.reference.loaded
    copied = run.brackets is not None and run.brackets.copies_checks and loaded is not None and loaded.fixed_inputs
    for index in range(policy.checks):
        setup.on_stage("verify", f"check {index + 1}/{policy.checks}")
        seed = secrets.randbits(62)
        out_dir = run.job / "candidate" / f"output-{index}"
        outside = copied and index > 0
        # Both sides compute at once; only timing needs the device to itself.
        reference.send("verify", setup.expect(seed))
        candidate.send("verify", RunRequest(seed=seed, dir=str(out_dir), profile=index == profiled, outside=outside))
        expected = reference.receive_typed("verify", ExpectReply, setup.timeouts.check_s)
        ran = candidate.receive_typed("verify", RunReply, setup.timeouts.check_s)
        if index == profiled and own is not None:
            attribution = _attribute(ran, own, result)
        if index == 0:
            keep_max = max(KEEP_MAX_BYTES, 2 * expected.output_bytes)
        run.call_bytes = max(run.call_bytes, expected.input_bytes + expected.output_bytes)
        if outside:
            if ran.described is None:
                raise Stop("failed", "verify", f"check {index + 1}: the candidate's process did not describe its "
                           "output", rule="forged-reply")
            run.brackets.keep_checked(ran.described, setup.timeouts.check_s, keep_max)  # type: ignore[union-attr]
        check = compare(setup, reference, index, ran.fingerprint, expected.fingerprint, out_dir, ran.manifest, outside)
        check["allowance"] = expected.allowance
        if outside:
            check["kept"] = True
        result.checks.append(check)
        if not check["ok"]:
            result.durations["verify"] = round(time.monotonic() - clock, 3)
            raise Stop("incorrect", "verify", f"check {index + 1}: {check['reason']}", rule="wrong-output")
    result.durations["verify"] = round(time.monotonic() - clock, 3)
    widest = max(c["allowance"] for c in result.checks)
    if widest > 1:
        result.notes.append(f"tolerance widened up to {widest:.2f}x: the task's own Model under the baselines' "
                            f"precision flags errs by that much over {policy.precision_slack:g} (policy "
                            "precision_slack)")
    return attribution


def _attribute(ran: RunReply, own: frozenset[str], result: EvalResult) -> Attribution:
    try:
        kernels = parse_kernel_report(ran.kernels)
    except ValueError as exc:
        raise Stop("failed", "verify", f"the profiled call's kernel report is invalid: {exc}",
                   rule="forged-reply") from None
    attribution = attribute(kernels, own)
    result.attribution = attribution.to_dict()
    return attribution


def check_timed_outputs(run: Evaluation, base: int, log: CandidateLog, last: int) -> int:
    """The outputs of timed calls are checked too: records of calls drawn now, after all rounds,
    uniformly over every recorded call, and the last call whole. A candidate that is right only
    when checked (or replays a stored result) fails here. Returns the output's size in bytes."""
    setup, result, reference, candidate = run.setup, run.result, run.reference.channel, run.candidate
    policy = setup.policy
    timed = candidate.ask_typed("profile", TimedRequest(), TimedReply, setup.timeouts.profile_s)
    # Exactly the last timed call, whose index the evaluator knows (any other "last" would let the
    # candidate pick a call it got right).
    if [c.index for c in timed.checked] != [last]:
        raise Stop("failed", "profile", f"the timing reply does not hold the last timed call ({last})",
                   rule="forged-reply")
    setup.on_stage("verify", f"records of {min(TIMED_CHECKS, len(log.records))} timed calls, drawn now")
    chosen = secrets.SystemRandom().sample(log.records, min(TIMED_CHECKS, len(log.records)))
    widest = max((c.get("allowance", 1.0) for c in result.checks), default=1.0)
    tolerance = setup.tolerance()
    request = RecordsRequest(checks=[RecordCheck(seed=trial_seed(base, record.index), probe=probe, record=record)
                                     for probe, record in chosen],
                             atol=tolerance["atol"] * widest, rtol=tolerance["rtol"] * widest,
                             scale=tolerance["scale"], strict=policy.strict_expected)
    verdicts = reference.ask_typed("verify", request, RecordsReply, setup.timeouts.check_s).verdicts
    for number, ((probe, record), verdict) in enumerate(zip(chosen, verdicts)):
        result.checks.append({"index": policy.checks + number, "timed": True, "call": record.index,
                              "record": True, "ok": verdict.ok, "reason": verdict.reason})
        if not verdict.ok:
            raise Stop("incorrect" if verdict.rule is None else "failed", "verify",
                       f"timed call {record.index} (its record): {verdict.reason}",
                       rule=verdict.rule or "timed-output")
    output_bytes = 0
    for number, call in enumerate(timed.checked):
        setup.on_stage("verify", "the last timed output")
        out_dir = run.job / "candidate" / "timed" / f"timed-{call.index}"
        # On a GPU the reference kept a copy of the output, taken while the process was stopped after its region;
        # else (the CPU backend, outputs over ``KEEP_MAX_BYTES``) the candidate's code hands it over now.
        kept = run.brackets is not None and run.brackets.kept_call == call.index
        reference.send("verify", setup.expect(trial_seed(base, call.index)))
        if not kept:
            candidate.send("verify", OutputRequest(index=call.index, dir=str(out_dir)))
        expected = reference.receive_typed("verify", ExpectReply, setup.timeouts.check_s)
        manifest = {} if kept else candidate.receive_typed("verify", OutputReply, setup.timeouts.check_s).manifest
        output_bytes = expected.output_bytes
        check = compare(setup, reference, policy.checks + len(chosen) + number, call.fingerprint,
                        expected.fingerprint, out_dir, manifest, kept)
        check.update(timed=True, call=call.index, allowance=expected.allowance, kept=kept)
        result.checks.append(check)
        if not check["ok"]:
            raise Stop("incorrect", "verify", f"timed call {call.index}: {check['reason']}", rule="timed-output")
    if policy.rerun_check and chosen:
        check_rerun(run, base, secrets.SystemRandom().choice(chosen))
    return output_bytes


def check_rerun(run: Evaluation, base: int, chosen: tuple[int, CallRecord]) -> None:
    """One recorded timed call, run again on its inputs as a check (the dispatch mode on): a candidate
    that computes otherwise when nothing watches (a torch fallback reached from C++, which no observer
    sees on timed calls) passes the records within the tolerance, but seldom bit for bit. Where the
    bits differ, a second run, compared with the first over the whole output in the reference, tells
    a candidate whose results vary from run to run (atomics), which is then not judged."""
    setup, result, reference, candidate = run.setup, run.result, run.reference.channel, run.candidate
    probe, record = chosen
    setup.on_stage("verify", f"timed call {record.index} run again under check")
    entry = {"index": len(result.checks), "timed": True, "call": record.index}
    for attempt in (1, 2):
        out_dir = run.job / "candidate" / "rerun" / f"run-{attempt}"
        ran = candidate.ask_typed("verify", RunRequest(seed=trial_seed(base, record.index), dir=str(out_dir)),
                                  RunReply, setup.timeouts.check_s)
        sampled = reference.ask_typed("verify", SampleRequest(dir=str(out_dir), manifest=ran.manifest, probe=probe,
                                                              keep=attempt == 1),
                                      SampleReply, setup.timeouts.check_s)
        shutil.rmtree(out_dir, ignore_errors=True)
        entry["rerun"] = attempt
        if sampled.reason:
            raise Stop("incorrect", "verify", f"timed call {record.index} run again: {sampled.reason}",
                       rule="wrong-output")
        # The output the reference kept for a second run goes when it idles (reference_process.idle).
        if attempt == 1 and same_samples(sampled.outputs, record.outputs):
            result.checks.append(entry | {"ok": True, "reason": None})
            return
    if sampled.same_as_kept:
        result.checks.append(entry | {"ok": False, "reason": "differs bit for bit from the timed call"})
        raise Stop("failed", "verify", f"timed call {record.index} gave other values than the same call run "
                   "twice again under check, whose outputs agreed in every element: it computes otherwise "
                   "when unwatched", rule="unwatched-compute")
    result.checks.append(entry | {"ok": True, "reason": "not deterministic: not compared bit for bit"})
    result.notes.append(f"timed call {record.index} run again twice under check gave other values each time (a "
                        "candidate whose results vary from run to run): its record was not compared bit for bit")


def compare(setup: Setup, reference: Channel, index: int, seen: Any, expected_fingerprint: Any, out_dir: Path,
            manifest: dict[str, Any], kept: bool = False) -> dict[str, Any]:
    """One output, compared in the reference with its expected output (``kept``: the copy it took itself);
    the check's entry in the result."""
    if seen != expected_fingerprint:
        raise Stop("failed", "verify", "the inputs seen by the candidate differ from the reference's "
                   "(input generation was altered in the candidate process, or forward changed its inputs)",
                   rule="input-generation")
    compared = reference.ask_typed("verify", CompareRequest(dir=str(out_dir), manifest=manifest, kept=kept,
                                                            **setup.tolerance()), CompareReply, setup.timeouts.check_s)
    shutil.rmtree(out_dir, ignore_errors=True)  # the reference may not write there
    check: dict[str, Any] = {"index": index, "ok": True, "reason": None, "reports": compared.reports}
    failed = [r for r in compared.reports if not r["ok"]]
    if failed:
        check.update(ok=False, reason=f"{failed[0]['path']}: {failed[0]['reason']}")
    return check
