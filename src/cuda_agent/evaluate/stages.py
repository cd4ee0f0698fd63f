"""The stages of one evaluation after the build, read top to bottom in ``_run``: load, verify, time, check the timed
outputs, decide. ``Evaluator`` inherits them; they use its processes, locks and caches (``_pausable``, ``_spare``,
``baselines``) and report through its ``on_stage``."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from typing import Any

from cuda_agent.build import BuildResult
from cuda_agent.evaluate import reference_process as ref
from cuda_agent.evaluate.brackets import CandidateBrackets, bracket_hold
from cuda_agent.evaluate.checks import check_timed_outputs, own_kernels, run_checks
from cuda_agent.evaluate.context import Evaluation
from cuda_agent.evaluate.decide import Plan
from cuda_agent.evaluate.processes import spares_stopped
from cuda_agent.evaluate.protocol.messages import LoadReply, LoadRequest, ReadyReply, ReadyRequest, ReleaseRequest, WeightsRequest
from cuda_agent.evaluate.protocol.quiet import GpuQuiet, quiet_after_stops
from cuda_agent.evaluate.protocol.timing import flush_bytes
from cuda_agent.evaluate.rounds import CandidateRounds, time_rounds
from cuda_agent.evaluate.triton_build import triton_own_kernels
from cuda_agent.evaluate.verdict import decide
from cuda_agent.evaluate.watchers import Attributed, Clock, Integrity, NewThreads, Regions, Signals, stop_on


class Stages:
    """The pipeline after the build, as methods of ``Evaluator`` (which sets the attributes they read)."""

    def _run(self, run: Evaluation, built: BuildResult, modules: dict[str, str], timed: bool) -> None:
        """The pipeline after the build: load, verify, time, check the timed outputs, decide. The watchers
        are asked between stages, about what the candidate did since they last looked."""
        setup, result = run.setup, run.result
        own = (own_kernels(setup, built, result) if run.language == "cuda"
               else triton_own_kernels(setup, run.kernel_names))
        signals, threads, integrity = self._load(run, modules)
        # One spare is started now, once this evaluation's own processes are up, not only as it ends: the next
        # evaluation takes the oldest spare at once, and one started at the end is the one it would wait for
        # (tens of seconds where a stream's second wave starts many processes together).
        self._top_up(setup, min(1, self.prestart))
        stop_on("load", "while model_new.py was imported", signals, threads, integrity)

        stop_on("verify", "", Attributed(run_checks(run, own), setup.policy))
        stop_on("verify", "during the checks", signals, threads, integrity)
        if not timed:
            result.correct = True
            result.status = "correct"
            result.notes.append("verified only (no timing, no reward)")
            return
        run.reference.channel.ask("verify", ReleaseRequest(), 60)  # hold little memory while timing

        clock = time.monotonic()
        with self._pausable(run.reference, run.candidate.worker):
            baseline, key = ref.baselines_for(setup, self.baselines, run.task, run.reference, result)
        result.durations["baseline"] = round(time.monotonic() - clock, 3)

        clock = time.monotonic()
        base = secrets.randbits(62)
        rounds, log = time_rounds(setup, run.reference.channel, baseline, result, spares_stopped(*self._spare_groups()),
                                  CandidateRounds(run.candidate, base, signals, integrity, run.brackets,
                                                  run.gpu_quiet, run.call_bytes,
                                                  run.reference.loaded.device_bytes if run.reference.loaded else 0))
        result.durations["profile"] = round(time.monotonic() - clock, 3)
        if run.gpu_quiet is not None and run.gpu_quiet.most_us is not None:
            result.timing["quiet_us"] = run.gpu_quiet.most_us  # the longest quiet probe: its margin to QUIET_US

        clock = time.monotonic()
        plan = Plan(**result.timing["plans"]["candidate"])
        last = rounds.count("candidate") * plan.trials * plan.calls - 1
        # The seeds the timed inputs' values came from: the evaluator's own where it wrote them from outside.
        writer = run.brackets is not None and run.brackets.writer is not None
        output_bytes = check_timed_outputs(run, run.brackets.inputs_base if writer else base, log, last)
        stop_on("verify", "while its timed outputs were read", signals)
        # Before the clock: a timer patched below Python fails here by what was patched.
        stop_on("profile", "during the timing rounds", integrity)
        # After the records: work finished past the end fails there, by name, before it shows as lost time.
        # The brackets first: where they and the round's clock disagree, they are the tighter.
        regions = Regions(run.brackets, log.hold_us, setup, result)
        stop_on("profile", "", regions,
                Clock(log.walls_ms, log.claimed_ms, log.empty_ms, log.plan.trials, setup.timing, result, regions))
        result.durations["verify"] += round(time.monotonic() - clock, 3)
        result.correct = True
        decide(setup, self.baselines, rounds, baseline, key, output_bytes, result)

    def _load(self, run: Evaluation, modules: dict[str, str]) -> tuple[Signals, NewThreads, Integrity]:
        """The candidate imports its code while the reference loads (or is kept); then the weights and
        the output memory. Returns the watchers of the candidate's process, started before its code."""
        setup, result, candidate, reference = run.setup, run.result, run.candidate, run.reference
        clock = time.monotonic()
        self.on_stage("reference", "starting the task's reference process" if run.fresh else "kept from earlier")
        # Baselines are timed later, in rounds interleaved with the candidate's. Before its code loads,
        # the signals its process catches and its threads are read from outside, once its own start-up
        # is over.
        brackets = run.brackets
        asked = time.monotonic()
        # A candidate process still starting (no spare ready) is waited for in a pausable stretch: held as a plain
        # share, that wait would hold every slot's timing off, the apart turn's among them. Nothing of the
        # candidate's has run in it yet; spares still starting are stopped the same way while anything is timed.
        with self._pausable(reference, candidate.worker):
            ready = candidate.ask_typed("load", ReadyRequest(bell=brackets is not None), ReadyReply,
                                        setup.timeouts.load_s)
        # Part of the "reference" stage: a candidate process still starting (no spare ready) costs this much.
        result.durations["wait_ready"] = round(time.monotonic() - asked, 3)
        signals = Signals(candidate)
        threads = NewThreads(candidate)  # the harness's own, started before the first request
        integrity = Integrity(candidate, ready.slots or {}, run.job, result)
        if ready.code_lock != "on":
            result.notes.append(f"code pages not locked in the candidate's process: {ready.code_lock}")
        calibrating: dict[str, Any] = {}
        if setup.device == "cuda":
            run.gpu_quiet = GpuQuiet(reference.channel, setup.timeouts.check_s)
        if brackets is not None:
            brackets.read_from(integrity.pid if integrity.pid is not None else candidate.worker.harness_pid(),
                               ready.gpu_export,
                               ref.ReferenceGpu(setup, reference, flush_bytes("cuda", setup.timing), run.gpu_quiet)
                               if setup.device == "cuda" else None)
            if setup.device == "cuda" and not brackets.outside:
                result.notes.append(f"timed outputs recorded in the candidate's process, not read from outside it: "
                                    f"{ready.gpu_export}")
            calibrating = brackets.calibration_fields(bracket_hold(setup), setup.timing.to_dict())
        candidate.send("load", LoadRequest(**setup.task_message(run.task, run.job, reference.init_seed),
                                           model_new_file=str(run.job / "model_new.py"), modules=modules,
                                           language=run.language,
                                           triton_kernels=str(run.triton_kernels) if run.triton_kernels else None,
                                           **calibrating))
        # The no-op regions run once the task is loaded in the candidate's process, before its code is, and
        # once the reference has loaded: a reference importing, compiling and warming up beside them (on the host's
        # cores and on the GPU) spreads their brackets by up to milliseconds, which would loosen every later region's
        # error by three times that. The candidate waits for the first GO meanwhile.
        if reference.loaded is None:
            with self._pausable(reference, candidate.worker):
                ref.await_loaded(setup, reference)
        calibration = None
        if brackets is not None:
            self._write_inputs(run, brackets, integrity.pid)
            # Measured like the timing: nothing else on the device meanwhile, the spares still starting
            # (started as the previous evaluation ended) stopped, since their start-up spreads the no-op
            # regions by most of a region.
            with setup.timing_lock, spares_stopped(*self._spare_groups()):
                quiet_after_stops(setup, reference.channel)
                calibration = brackets.serve_calibration(setup.timeouts.load_s)
        result.durations["reference"] = round(result.durations.get("reference", 0.0) + time.monotonic() - clock, 3)
        result.notes.append(f"reference process {'started' if run.fresh else 'kept'} "
                            f"({reference.evaluations} earlier evaluation(s))")

        clock = time.monotonic()
        self.on_stage("load", "importing the candidate")
        weights = run.job / "state_dict.pt"  # readable by the candidate, in its job, not the reference's home
        try:
            os.link(reference.state_dict, weights)
        except OSError:
            shutil.copy2(reference.state_dict, weights)
        loaded = candidate.receive_typed("load", LoadReply, setup.timeouts.load_s)
        if loaded.triton:
            result.notes.append(f"Triton: {loaded.triton}")
        if loaded.thread_ban == "on":
            result.notes.append("new threads and processes of the candidate's code refused by the kernel from its load on "
                                "(seccomp: the process ends)")
        else:
            result.notes.append(f"new threads and processes not refused by the kernel in the candidate's process "
                                f"({loaded.thread_ban}): only those alive when its threads are read from outside are seen")
        if run.gpu_quiet is not None:
            run.gpu_quiet.candidate = candidate.worker  # its code has run: work found on the GPU may be its
        if brackets is not None:
            brackets.calibrate(calibration, loaded.bell_ms, bracket_hold(setup), loaded.bell_tail_ms)
        candidate.ask("load", WeightsRequest(state_dict_path=str(weights)), setup.timeouts.load_s)
        ref.share_output_memory(setup, reference, candidate, result)
        result.durations["load"] = round(time.monotonic() - clock, 3)
        return signals, threads, integrity

    @staticmethod
    def _write_inputs(run: Evaluation, brackets: CandidateBrackets, pid: int | None) -> None:
        """Timed inputs' values come from outside the candidate's process (``outside.InputWriter``, on a GPU
        ``GpuInputWriter``), where the task's draws differ in their values alone (the reference says so as it
        loads) and, on a GPU, where its memory is read from outside."""
        setup, reference = run.setup, run.reference
        if setup.device == "cuda" and not brackets.outside:
            return  # a note already says its memory is not read from outside: nor is it written
        kept = None  # why the candidate's own draws are timed, if they are
        if not brackets.may_write:
            kept = f"policy outside_inputs={setup.policy.outside_inputs!r}"
        elif reference.loaded is None or not reference.loaded.fixed_inputs:
            kept = "the task's draws differ in more than their values"
        if kept is not None:
            run.result.notes.append(f"timed inputs drawn in the candidate's process from seeds it is told ({kept}): "
                                    "work moved before a region is bounded by the round's clock only")
            return
        if setup.device == "cuda":
            brackets.write_inputs(None)
            return
        pid = pid if pid is not None else run.candidate.worker.harness_pid()
        brackets.write_inputs(pid, ref.input_drawer(setup, reference), flush_bytes=flush_bytes("cpu", setup.timing))
