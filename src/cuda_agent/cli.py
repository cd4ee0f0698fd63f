"""The ``cuda-agent`` command line (thin: every command calls the library)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cuda_agent.agent.llm import BackendError
from cuda_agent.build import build, compile_only
from cuda_agent.candidates import Candidate, CandidateError, load_candidate
from cuda_agent.candidates.triton import LANGUAGES, TRITON_COMPILE_NOTE
from cuda_agent.evaluate import Evaluator, Policy, TimingConfig, Timeouts, long_lived, resolve_device
from cuda_agent.evaluate.policy import PRESETS
from cuda_agent.evaluate.result import BUSY, BUSY_ADVICE, EvalResult
from cuda_agent.evaluate.retry import RetryPolicy
from cuda_agent.guard import check_candidate
from cuda_agent.evaluate.counters import times_of, unavailable
from cuda_agent.evaluate.evaluator import default_memory_limit
from cuda_agent.evaluate.device_lock import DeviceLock
from cuda_agent.paths import EXAMPLES
from cuda_agent.sandbox import SANDBOX_CHOICES, SandboxUnavailable
from cuda_agent.service.messages import ServiceError
from cuda_agent.tasks import TaskError, load_task, load_tasks

# Exit statuses: a verdict of correct, a candidate's failure (incorrect, failed), an error in what the user gave
# (files, settings, the machine: one line, no traceback), no verdict (the evaluator could not decide; not the
# candidate's doing), and Ctrl-C (``INTERRUPTED``).
EXIT_CORRECT, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_VERDICT = 0, 1, 2, 3
EXIT_CODES = (f"exit status: {EXIT_CORRECT} correct, {EXIT_FAILURE} the candidate failed (incorrect, failed), "
              f"{EXIT_USAGE} a usage error, {EXIT_NO_VERDICT} no verdict (the evaluator could not decide: a busy host, "
              "or the task or harness failed; no reward, and not the candidate's failure), 130 interrupted")
USER_ERRORS = (TaskError, CandidateError, SandboxUnavailable, BackendError, ServiceError, ValueError, OSError)
GIB = 1024**3
REMOTE_PROGRESS_S = 5.0  # how often `eval --remote` says what the service is doing
_print_lock = threading.Lock()


def say(line: str) -> None:
    """One progress line on stderr, written whole: episodes and evaluations report from several
    threads, and print() writes the text and its newline apart, so two lines could run together."""
    with _print_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _plural(count: int, noun: str, plural: str | None = None) -> str:
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def _status_line(quiet: bool):
    start = time.monotonic()

    def show(stage: str, detail: str) -> None:
        if not quiet:
            say(f"[{time.monotonic() - start:6.1f}s] {stage:<9} {detail}")

    return show


def add_language_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--language", choices=LANGUAGES, default=None,
                   help="the candidate's language: cuda (a C++/CUDA extension) or triton (model_new.py launching "
                        "@triton.jit kernels); default: read from its sources")


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        task = load_task(args.task)
        candidate = load_candidate(args.candidate, language=args.language)
        overrides = {k: getattr(args, k) for k in ("checks", "atol", "rtol", "reward") if getattr(args, k) is not None}
        policy = Policy.preset(args.policy, **overrides)
        timing = TimingConfig(method=args.timing)
        evaluator = _remote_evaluator(args, policy) if args.remote else Evaluator(
            args.device,
            policy=policy,
            timing=timing,
            cache_dir=args.cache_dir,
            sandbox=args.sandbox,
            time_compile=not args.no_compile,
            timeouts=_timeouts(args),
            memory_limit=_memory_limit(args),
            on_stage=_status_line(args.json),
            retry=_retry(args),
        )
    except USER_ERRORS as exc:
        if args.json:
            # Scripts reading --json get a record for every run, one that never started included.
            print(EvalResult(task={"source": str(args.task)}, candidate={"origin": str(args.candidate)},
                             device=args.device, policy={"name": args.policy}, timing={"method": args.timing},
                             status="error", stage="input", reason=str(exc)).to_json())
        raise
    if args.remote and not args.json:
        with _waiting_on(evaluator, _status_line(False)):
            result = evaluator.evaluate(task, candidate)
    else:
        result = evaluator.evaluate(task, candidate)
    report = None
    if args.counters:
        report = (evaluator.counters(task, candidate, times_of(result)) if result.status == "correct"
                  else unavailable(f"only a correct candidate is profiled (this one is {result.status})"))
        result.counters = report.to_dict()
    print(result.to_json() if args.json else result.summary() + (f"\n{report.text()}" if report else ""))
    if result.status != "correct" and "out of memory" in (result.reason or "") and not args.remote:
        limit = _memory_limit(args)
        say(f"cuda-agent: note: each evaluation process may use {limit / GIB:.1f} GiB (--memory-limit GIB raises it; "
            f"the default is half this machine's RAM, {default_memory_limit() / GIB:.1f} GiB); a task that needs more "
            "than the machine has does not fit it" if limit else
            "cuda-agent: note: no memory limit was set (--memory-limit 0): the machine itself ran out")
    if result.no_verdict:
        tries = f" after {_plural(result.attempts, 'attempt')}" if result.attempts > 1 else ""
        say(f"cuda-agent: no verdict{tries}: " + (BUSY_ADVICE if result.no_verdict_kind == BUSY else
                                                  f"the task or the evaluator failed, not the candidate ({result.reason})"))
    return exit_status(result.status)


def exit_status(status: str | None) -> int:
    """The exit status of an evaluation's status (``EXIT_CODES``)."""
    if status == "correct":
        return EXIT_CORRECT
    return EXIT_NO_VERDICT if status == "error" else EXIT_FAILURE


def _retry(args: argparse.Namespace) -> RetryPolicy:
    """``--retries``: evaluations again after one without a verdict for a busy host."""
    retries = getattr(args, "retries", None)
    if retries is None:
        return RetryPolicy()
    if retries < 0:
        raise ValueError(f"--retries is how many times to evaluate again, 0 or more, not {retries}.")
    return RetryPolicy(attempts=retries + 1)


def add_retries_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retries", type=int, default=None, metavar="N",
                   help="evaluate again up to N times when the host or GPU was too busy to decide, waiting for a "
                        f"quieter moment between tries (default {RetryPolicy().attempts - 1}; 0: never)")


def _memory_limit(args: argparse.Namespace) -> int:
    """``--memory-limit`` in bytes for the Evaluator (0: none), the evaluator's default when not given."""
    limit = getattr(args, "memory_limit", None)
    if limit is None:
        return default_memory_limit()
    if limit < 0:
        raise ValueError(f"--memory-limit is GiB, 0 or more (0: no limit), not {limit:g}.")
    return int(limit * GIB)


@contextlib.contextmanager
def _waiting_on(service, show):
    """Progress while a service evaluates: it reports no stages, so what it is doing (its queue and
    jobs in flight) is shown every few seconds, or the user sees nothing for the job's whole run."""
    done = threading.Event()

    def beat() -> None:
        show("sent", f"to {service.url} ({service.info.get('slots_total', '?')} {service.device} slot(s))")
        while not done.wait(REMOTE_PROGRESS_S):
            try:
                stats = service.stats()
                detail = f"queue {stats.get('queue', '?')}, building {stats.get('building', '?')}, " \
                         f"in flight {stats.get('in_flight', '?')}"
            except Exception as exc:  # noqa: BLE001 - a progress line must not end the evaluation
                detail = f"no stats ({exc})"
            show("waiting", f"on the service: {detail}")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _remote_evaluator(args: argparse.Namespace, policy: Policy):
    """The service at ``--remote``, refused when the options ask for what it does not do: the service's
    slots evaluate under the policy it was started with (``cuda-agent serve --policy``)."""
    from cuda_agent.service import RemoteEvaluator

    local_only = [flag for flag, value in (("--device", args.device != "auto"), ("--timing", args.timing != "auto"),
                                           ("--no-compile", args.no_compile), ("--cache-dir", args.cache_dir),
                                           ("--timeout", args.timeout is not None),
                                           ("--memory-limit", getattr(args, "memory_limit", None) is not None))
                  if value]
    if local_only:
        raise ValueError(f"{', '.join(local_only)} set how a local evaluation runs; with --remote the service decides "
                         "(start it with those options instead).")
    evaluator = RemoteEvaluator(args.remote)
    evaluator.require_policy(policy, "--policy (and --checks, --atol, --rtol, --reward)")
    return evaluator


def cmd_serve(args: argparse.Namespace) -> int:
    """An evaluation service: local slots (or Ray actors with --ray) behind an HTTP front."""
    from cuda_agent.service import local_service, make_server, ray_service
    from cuda_agent.service.http import is_loopback
    from cuda_agent.service.messages import TOKEN_ENV

    if not (args.token or os.environ.get(TOKEN_ENV)) and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} reaches beyond this machine, so the service needs a token: pass --token "
                         f"TOKEN or set {TOKEN_ENV} (clients set {TOKEN_ENV} to the same value), or serve on 127.0.0.1")

    if args.per_gpu < 1:
        raise ValueError(f"--per-gpu must be at least 1 (local slots sharing each GPU), not {args.per_gpu}")
    policy = Policy.preset(args.policy)
    options = {"policy": policy, "cache_dir": args.cache_dir, "sandbox": args.sandbox, "timeouts": _timeouts(args),
               "memory_limit": _memory_limit(args)}

    def on_reply(job, reply) -> None:
        result = reply.result if reply.ok and isinstance(reply.result, dict) else {}
        outcome = ("no verdict (reward none)" if result.get("status") == "error" else
                   f"{result.get('status')} reward {result.get('reward')}") if "status" in result \
            else "ok" if reply.ok else f"{reply.kind}: {reply.error}"
        evaluations = f", {result['attempts']} evaluations" if result.get("attempts", 1) > 1 else ""
        say(f"[{time.strftime('%H:%M:%S')}] {job.describe()} -> {outcome} ({reply.slot}, {reply.seconds:.1f} s, "
            f"attempt {reply.attempts}{evaluations})")

    common = {"queue_size": args.queue_size, "job_timeout_s": args.job_timeout, "on_reply": on_reply}
    if args.ray:
        service = ray_service(args.ray, "cuda" if args.device == "auto" else args.device, slots=args.slots,
                              **common, **options)
    else:
        service = local_service(args.device, slots=args.slots, gpus=args.gpus, per_gpu=args.per_gpu, **common,
                                **options)
    try:
        server = make_server(service, args.host, args.port, token=args.token or os.environ.get(TOKEN_ENV))
    except OSError:
        service.close()  # its slots are running already
        raise
    host, port = server.server_address[:2]

    def stop(signum, frame) -> None:
        # SIGTERM (a supervisor's stop) closes the slots as Ctrl-C does; a second one must not cut that short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    info = service.info
    print(f"serving {info['slots_total']} {info['device']} slot(s) ({info['backend']}, policy {policy.name}) on "
          f"http://{host}:{port}  (cuda-agent eval TASK CANDIDATE --remote http://{host}:{port})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    candidate = load_candidate(args.candidate, language=args.language)
    if candidate.language == "triton":
        problems = check_candidate(candidate, Policy().code_policy())
        print("\n".join(v.describe() for v in problems) or f"ok: {TRITON_COMPILE_NOTE}")
        return 1 if problems else 0
    backend, why = _compile_backend(args.backend, candidate)
    # Where `eval` on this machine would build for the same backend, build as it does (compile and link):
    # the same cache key, so the eval that follows starts from the cached build. Elsewhere (CUDA sources on
    # a machine without a GPU) compiling alone is the check; linking would build what nothing here loads.
    linked = backend == resolve_device("auto")
    result = (build(candidate, backend, cache_dir=args.cache_dir) if linked
              else compile_only(candidate, backend, cache_dir=args.cache_dir))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        for diag in result.diagnostics:
            print(diag)
        print(("ok" if result.ok else f"FAILED: {result.error}") + (" (cached)" if result.cached else "")
              + f" [backend {backend}{': ' + why if why else ''}]"
              + ("; built and linked, so `eval` here reuses it" if linked and result.ok else ""))
    note = _cuda_torch_note(result) if backend == "cuda" else None
    if note:
        say(note)
    return 0 if result.ok else 1


def _cuda_torch_note(result) -> str | None:
    """Why a cuda-backend build failed where torch is a CPU build: the candidate's C++ files (its
    bindings) include torch's CUDA headers, which only a CUDA build of torch ships, and the compiler's
    "c10/cuda/...: No such file" says nothing of why. The .cu files' own diagnostics still stand, which
    is what compiling without a GPU is for, so the build runs and this note comes after."""
    import torch

    if result.ok or torch.version.cuda is not None:
        return None
    return (f"cuda-agent: note: this torch ({torch.__version__}) is a CPU build without the CUDA headers a "
            "candidate's C++ files include for --backend cuda, so those files cannot compile here (the .cu files' "
            "diagnostics above stand); install a CUDA build of torch (e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128), or use --backend cpu for C++ (kernels/*.cpp) candidates")


def _compile_backend(backend: str, candidate: Candidate) -> tuple[str, str]:
    """The backend ``--backend auto`` means for this candidate, and why (empty when it was given).
    CUDA sources need nvcc but no GPU, so they pick cuda anywhere; C++ sources pick it only on a GPU."""
    if backend != "auto":
        return backend, ""
    if any(unit.endswith(".cu") for ext in candidate.extensions for unit in ext.compile_units):
        return "cuda", "auto, the candidate has .cu sources"
    if resolve_device("auto") == "cuda":
        return "cuda", "auto, a CUDA GPU is visible"
    return "cpu", "auto, no CUDA GPU (--backend cuda compiles with nvcc anyway)"


def cmd_tasks(args: argparse.Namespace) -> int:
    tasks = load_tasks(args.source, levels=args.level)
    for task in tasks:
        print(f"{task.name}\t{task.digest[:12]}\t{task.source}")
    print(_plural(len(tasks), "task"), file=sys.stderr)
    return 0


def cmd_degenerate(args: argparse.Namespace) -> int:
    """Flag tasks that trivial candidates pass under the chosen policy."""
    tasks = load_tasks(args.source, levels=args.level)
    evaluator = Evaluator(args.device, policy=Policy.preset(args.policy), cache_dir=args.cache_dir, sandbox=args.sandbox,
                          timeouts=_timeouts(args), memory_limit=_memory_limit(args))
    flagged = 0
    for index, task in enumerate(tasks, 1):
        if not args.json:
            say(f"[{index}/{len(tasks)}] {task.name}")
        report = evaluator.check_degenerate(task)
        flagged += report.degenerate
        print(json.dumps(report.to_dict()) if args.json else report.summary(), flush=True)
    print(f"{flagged} of {_plural(len(tasks), 'task')} degenerate under policy {args.policy}", file=sys.stderr)
    return 1 if flagged else 0


def _example_names() -> list[str]:
    """The bundled examples: folders of examples/ with a task and a solution (examples/train holds configs)."""
    if not EXAMPLES.is_dir():
        return []
    return sorted(p.name for p in EXAMPLES.iterdir() if (p / "model.py").is_file() and (p / "solution").is_dir())


def cmd_example(args: argparse.Namespace) -> int:
    """Evaluate a bundled example: the CUDA one when a GPU is visible, else the CPU one."""

    device = resolve_device(args.device)
    name = args.name or ("cuda_gelu" if device == "cuda" else "cpu_swish")
    if name not in _example_names():
        raise ValueError(f"no example {name!r}; the examples are {', '.join(_example_names()) or 'missing'}.")
    root = EXAMPLES / name
    ns = argparse.Namespace(
        task=str(root / "model.py"), candidate=str(root / "solution"), device=device, policy="fair",
        checks=None, atol=None, rtol=None, reward=None, timing="auto", cache_dir=args.cache_dir,
        no_compile=False, json=args.json, sandbox=args.sandbox, timeout=args.timeout, remote=None, counters=False,
        memory_limit=args.memory_limit, retries=args.retries, language=None,
    )
    return cmd_eval(ns)


def add_timeout_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="bound each stage of a candidate's evaluation (build, load, each check, profile) to this "
                        f"many seconds (default: {Timeouts().build_s:g} s each)")


def _timeouts(args: argparse.Namespace) -> Timeouts:
    """The evaluator's timeouts with ``--timeout`` as the ceiling of every stage the candidate's code
    runs in; the baselines keep theirs (the reference's time, and cached per task)."""
    defaults = Timeouts()
    limit = getattr(args, "timeout", None)
    if limit is None:
        return defaults
    if limit <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, not {limit:g}.")
    return dataclasses.replace(defaults, **{name: min(getattr(defaults, name), limit)
                                            for name in ("build_s", "load_s", "check_s", "profile_s")})


def add_sandbox_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sandbox", default="auto", choices=SANDBOX_CHOICES,
                   help="auto/bwrap: bubblewrap + seccomp (default); none: no isolation, for trusted code only")


def _kernelbench_default() -> Path | None:
    import os

    for path in (os.environ.get("KERNELBENCH_DATA"), "../shared/data/kernelbench"):
        if path and (Path(path) / "kernelbench.jsonl").exists():
            return Path(path) / "kernelbench.jsonl"
    return None


def cmd_synth(args: argparse.Namespace) -> int:
    from cuda_agent.synth.catalog import default_catalog
    from cuda_agent.synth.pipeline import SynthConfig, synthesize

    device = resolve_device(args.device)
    kernelbench = None if args.no_decontaminate else (args.kernelbench or _kernelbench_default())
    if kernelbench is None and not args.no_decontaminate:
        # A note, not an error: a first CPU run should work as the README shows; the similarity filter
        # within the set still runs.
        print("synth: note: no KernelBench programs given (--kernelbench PATH) or found ($KERNELBENCH_DATA, "
              "../shared/data/kernelbench/kernelbench.jsonl): the tasks are NOT decontaminated against KernelBench; "
              "give --kernelbench before training on them for a KernelBench evaluation.", file=sys.stderr)
    llm = {}
    if args.composer == "llm":
        if not args.model or not args.base_url:
            raise ValueError("--composer llm needs --model NAME and --base-url URL (an OpenAI-compatible endpoint).")
        _chat_backend(args)  # a server that is down fails now, not as every candidate's verdict
        llm = {"model": args.model, "base_url": args.base_url, "api_key_env": args.api_key_env}
    config = SynthConfig(n=args.n, out=args.out, device=device, composer=args.composer,
                         seed=args.seed, workers=args.workers, window_ms=tuple(args.window_ms) if args.window_ms else None,
                         max_candidates=args.max_candidates, kernelbench=kernelbench, sandbox=args.sandbox,
                         ray=args.ray, cache_dir=args.cache_dir, language=args.language,
                         **({"timeout_s": args.timeout} if args.timeout is not None else {}))
    catalog = default_catalog(transformers=not args.no_transformers)
    summary = synthesize(config, catalog, progress=not args.quiet, **llm)
    print(f"{_plural(summary['accepted'], 'task')} accepted of {_plural(summary['candidates'], 'candidate')} -> {args.out}/tasks.jsonl "
          f"(report: {args.out}/report.md)")
    return 0 if summary["accepted"] >= args.n else 1


def cmd_catalog(args: argparse.Namespace) -> int:
    from cuda_agent.synth.catalog import build_catalog, default_catalog

    catalog = build_catalog(transformers=not args.no_transformers) if args.out else \
        default_catalog(transformers=not args.no_transformers, refresh=args.refresh)
    if args.out:
        catalog.save(args.out)
    print(catalog.summary())
    if args.verbose:
        for op in catalog.operators:
            state = f"ranks {op.ranks}" + (" stochastic" if op.stochastic else "") if op.usable else f"unusable: {op.reason}"
            print(f"{op.name:<48} {op.family:<12} {state}")
    return 0


def cmd_baselines(args: argparse.Namespace) -> int:
    from cuda_agent.bench.baselines import measure_baselines, read_table, render_table_report

    tasks = load_tasks(args.source, levels=args.level)
    start = time.monotonic()

    def show(done: int, total: int, row: dict) -> None:
        if args.quiet:
            return
        if "error" in row:
            state = f"ERROR {row['error'][:120]}"
        else:
            compiled = f"{row['compile_ms']:.4g} ms" if row.get("compile_ms") else "failed"
            state = (f"eager {row['eager_ms']:.4g} ms, compile {compiled}"
                     + (", DEGENERATE" if row.get("degenerate") else "") + (" (cached)" if row.get("cached") else ""))
        say(f"[{time.monotonic() - start:7.0f}s {done}/{total}] {row['name']}: {state}")

    options = {"policy": Policy.preset(args.policy), "sandbox": args.sandbox, "cache_dir": args.cache_dir,
               "timeouts": _timeouts(args), "memory_limit": _memory_limit(args)}
    measure_baselines(tasks, args.out, device=resolve_device(args.device), gpus=args.gpus, per_gpu=args.per_gpu,
                      degenerate=not args.no_degenerate, evaluator_options=options, progress=show,
                      deadline_s=args.deadline_s)
    rows = read_table(args.out)
    report = render_table_report(rows, args.published)
    args.out.with_suffix(".md").write_text(report)
    print(report)
    missing = len({t.digest for t in tasks} - {r["digest"] for r in rows})
    if missing:
        print(f"{_plural(missing, 'task')} not timed yet: run the same command again to continue", file=sys.stderr)
    return 0 if not missing else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from cuda_agent.bench.baselines import read_table
    from cuda_agent.bench.report import write_report
    from cuda_agent.bench.run import (
        language_settings, read_results, run_agent_bench, run_bench, seed_baselines, without_verdict,
    )
    from cuda_agent.bench.solutions import find_solutions
    from cuda_agent.paths import cache_root

    if (args.solutions is None) == (args.model is None):
        raise ValueError("give --solutions DIR (evaluate a solution set) or --model NAME (run the agent live).")
    tasks = load_tasks(args.source, levels=args.level)
    remote = None
    if args.remote:
        from cuda_agent.service import RemoteEvaluator

        if args.baselines:
            raise ValueError("--baselines seeds this machine's cache; with --remote the service times and caches its "
                             "own (seed its --cache-dir instead, or drop --baselines).")
        remote = RemoteEvaluator(args.remote)
        remote.require_policy(Policy.preset(args.policy), "--policy")
    device = remote.device if remote is not None else resolve_device(args.device)
    backend = _chat_backend(args) if args.model is not None else None  # before any baseline or evaluation
    policy = remote.policy if remote is not None else Policy.preset(args.policy)
    # Enough jobs in flight to keep every slot of the service busy while replies travel back.
    concurrency = args.concurrency or (2 * remote.info.get("slots_total", 1) if remote is not None else 1)
    if args.solutions is not None:
        solutions = find_solutions(tasks, args.solutions)
        unmatched = ", ".join(str(p.relative_to(solutions.root)) for p in solutions.unmatched[:10])
        say(f"{_plural(len(tasks), 'task')}; {len(solutions.by_task)} with solutions "
            f"({_plural(len(solutions.entries()), 'entry', 'entries')}); "
            f"{_plural(len(solutions.unmatched), 'entry', 'entries')} name no task" + (f": {unmatched}" if unmatched else ""))
    cache_dir = args.cache_dir or cache_root()
    degenerate: list[str] = []
    if args.baselines:
        seeded = seed_baselines(args.baselines, cache_dir, policy, device)
        degenerate = sorted(r["name"] for r in read_table(args.baselines) if r.get("degenerate"))
        say(f"{_plural(seeded, 'baseline')} from {args.baselines} in the cache; {_plural(len(degenerate), 'task')} "
            "flagged degenerate")
    start = time.monotonic()

    def show(done: int, total: int, row: dict) -> None:
        if not args.quiet:
            speed = f", {row['speedup_compile']:.2f}x vs compile" if row.get("speedup_compile") else ""
            reason = f" ({row['reason'][:100]})" if row.get("reason") else ""
            say(f"[{time.monotonic() - start:6.0f}s {done}/{total}] {row['task']['name']} {row['entry']}: "
                f"{row['status']}{speed}{reason}")

    options = {"policy": policy, "sandbox": args.sandbox, "cache_dir": cache_dir, "timeouts": _timeouts(args),
               "memory_limit": _memory_limit(args), "retry": _retry(args)}
    if args.baselines:
        # The table's baselines stand (a run over all of KernelBench compiles and times none again); the
        # candidate alone is timed in rounds. Without a table, baselines are timed beside each candidate.
        options["timing"] = TimingConfig(baselines="cached")
    settings = {"device": device, "policy": policy.name, "degenerate": degenerate} | language_settings(args.language)
    if args.model is None:
        run_bench(args.out, tasks, solutions, device, gpus=args.gpus, evaluator_options=options, settings=settings,
                  progress=show, evaluator=remote, concurrency=concurrency, language=args.language)
    else:
        from cuda_agent.agent.loop import AgentConfig

        config = AgentConfig(max_turns=args.max_turns, language=args.language or "cuda")
        run_agent_bench(args.out, tasks, backend, device, model=args.model, gpus=args.gpus, evaluator_options=options,
                        config=config, sandbox=args.sandbox, settings=settings | {"max_turns": args.max_turns},
                        progress=show, evaluator=remote, concurrency=concurrency)
    write_report(args.out, exclude_degenerate=args.exclude_degenerate)
    print((args.out / "report.md").read_text().split("\n## ")[0])
    print(f"reports in {args.out}: report.md, metrics.json, levels.csv, per_task.csv, *.png", file=sys.stderr)
    undecided = without_verdict(read_results(args.out))
    if undecided:
        # Not failures: a rerun of the same command evaluates exactly these again.
        say(f"cuda-agent: {_plural(len(undecided), 'entry', 'entries')} ended without a verdict (not failures; "
            f"{BUSY_ADVICE}); run the same command again to evaluate them again")
        return EXIT_NO_VERDICT
    return EXIT_CORRECT


def cmd_report(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import write_report

    write_report(args.run, exclude_degenerate=args.exclude_degenerate, levels=args.level)
    print((args.run / "report.md").read_text())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from cuda_agent.bench.report import compare_runs

    text = compare_runs(args.a, args.b, exclude_degenerate=args.exclude_degenerate, levels=args.level,
                        force=args.force)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


def _chat_backend(args: argparse.Namespace):
    """A factory of the model backend the arguments describe, tried once now: a missing API key, a
    bad setting or an endpoint that cannot be reached fails before any episode starts, not in every one
    (an unreachable server cost a minute of retries and then an episode that just ended)."""
    from cuda_agent.agent.llm import OpenAIChat

    def backend() -> OpenAIChat:
        return OpenAIChat(args.model, base_url=args.base_url, api_key_env=args.api_key_env,
                          tool_format=getattr(args, "tool_format", "native"),
                          temperature=getattr(args, "temperature", None))

    backend().check_reachable()
    return backend


def cmd_optimize(args: argparse.Namespace) -> int:
    from cuda_agent.agent.loop import AgentConfig
    from cuda_agent.agent.optimize import best_episode, optimize

    task = load_task(args.task)
    device = resolve_device(args.device)
    backend = _chat_backend(args)
    # On a GPU machine, the processes of the agent's next evaluation start while it thinks.
    evaluator = Evaluator(device, policy=Policy.preset(args.policy), sandbox=args.sandbox, timeouts=_timeouts(args),
                          memory_limit=_memory_limit(args), timing_lock=DeviceLock(), **long_lived(device))
    config = AgentConfig(max_turns=args.max_turns, context_tokens=args.context_tokens,
                         wall_clock_s=args.wall_clock_s, counters=not args.no_counters, language=args.language)
    start = time.monotonic()

    def show(episode: int, entry: dict) -> None:
        if not args.quiet:
            calls = ", ".join(c["name"] + ("!" if c["error"] else "") for c in entry["tool_calls"]) or "(no tool call)"
            say(f"[{time.monotonic() - start:6.0f}s] episode {episode} turn {entry['turn']}: {calls}")

    with evaluator:  # its kept reference and started processes end with the command
        episodes = optimize(task, backend, args.out, evaluator, episodes=args.episodes, config=config,
                            model=args.model, sandbox=args.sandbox, on_turn=show)
    print((args.out / "report.md").read_text())
    failed = [e.end_reason for e in episodes if e.end_reason.startswith("backend_error")]
    if len(failed) == len(episodes):
        print(f"cuda-agent: error: every episode ended on a model backend error; the first: "
              f"{failed[0].removeprefix('backend_error: ')}", file=sys.stderr)
        return 1
    if best_episode(episodes) is None:
        # Scripts chaining `optimize && deploy` must not take the task's own code for a solution.
        say(f"cuda-agent: no episode reached a correct solution; what each agent did: cuda-agent show {args.out}")
        return 1
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from cuda_agent.agent.trajectory import read_trajectories, render_html, render_text

    records = read_trajectories(args.trajectory)
    if not 0 <= args.episode < len(records):
        raise ValueError(f"{args.trajectory} holds {len(records)} episode(s); --episode is 0..{len(records) - 1}.")
    record = records[args.episode]
    if args.html:
        args.html.write_text(render_html(record))
        print(f"wrote {args.html}", file=sys.stderr)
    else:
        print(render_text(record, width=args.width))
    return 0


def cmd_train_demo(args: argparse.Namespace) -> int:
    from cuda_agent.train.demo import DemoConfig, NoVerdictStep, run_demo

    device = resolve_device(args.device)
    config = DemoConfig(device=device, batch=args.batch, seed=args.seed)
    try:
        rows = run_demo(args.out, steps=args.steps, config=config, quiet=args.quiet)
    except NoVerdictStep as exc:
        say(f"cuda-agent: {exc}")
        return EXIT_NO_VERDICT
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    menu = json.loads((args.out / "menu.json").read_text()) if (args.out / "menu.json").exists() else {}
    rewards = ", ".join(f"{name} {entry['reward']:+.2f}" if entry.get("reward") is not None else f"{name} none"
                        for name, entry in menu.items()) or "none evaluated"
    print(f"{len(rows)} steps: mean reward {first:+.2f} at step 1, {last:+.2f} at step {len(rows)} "
          f"(fast answered {rows[-1]['answers'].get('fast', 0):.0%}); the candidates' rewards: {rewards}; "
          f"{args.out / 'metrics.jsonl'}, {args.out / 'curves.png'}, {args.out / 'rewards.png'}")
    return 0


def cmd_train_verl(args: argparse.Namespace) -> int:
    """The stage on verl: the command from the packaged override files (``train.verl.launch``), run here."""
    import shlex
    import subprocess

    from cuda_agent.train.verl.launch import verl_command

    if args.stage in ("collect", "value"):
        raise ValueError(f"`train {args.stage}` has no verl stage (verl has no offline value pretraining, and "
                         "collection is our agent loop): run it without --engine verl; its output feeds the verl "
                         "stages by path (data.train_files for rft, critic.model.path for agentic ppo).")
    stage = "rft" if args.stage == "rft" else ("ppo-single-turn" if args.single_turn else "ppo-agentic")
    command = verl_command(stage, args.config, args.out, args.overrides)
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(command).returncode


def cmd_train_stage(args: argparse.Namespace) -> int:
    from cuda_agent.train import stages
    from cuda_agent.train.config import check_models, load_config
    from cuda_agent.train.distributed import leave_group

    if args.engine == "verl":
        return cmd_train_verl(args)
    if args.overrides or args.dry_run:
        raise ValueError("--set and --dry-run are for --engine verl; our stages read everything from --config.")
    if args.config is None:
        raise ValueError(f"`train {args.stage}` needs --config FILE (examples/train/ has one per stage).")
    config = load_config(args.config, args.stage)
    check_models(config, args.config)
    report = print if os.environ.get("RANK", "0") == "0" else (lambda *a, **k: None)  # torchrun: rank 0 reports
    if args.stage == "ppo":
        rows = stages.run_ppo(config, args.out, single_turn=args.single_turn)
        if rows:
            report(f"{len(rows)} steps: mean reward {rows[0]['reward_mean']:+.2f} at step 1, "
                   f"{rows[-1]['reward_mean']:+.2f} at step {len(rows)}; checkpoint {args.out / 'checkpoint'}")
    elif args.stage == "collect":
        report(stages.run_collect(config, args.out))
    elif args.stage == "rft":
        stages.run_rft(config, args.out)
        report(f"actor for agentic PPO: {args.out / 'checkpoint' / 'actor'}")
    else:
        rows = stages.run_value(config, args.out)
        report(f"critic for agentic PPO: {args.out / 'checkpoint' / 'critic'} (held-out explained variance "
               f"{rows[-1]['heldout_explained_variance']:.3f})")
    leave_group()
    return 0


def cmd_train_plot(args: argparse.Namespace) -> int:
    from cuda_agent.train.run import plot_metrics

    for path in plot_metrics(args.run):
        print(path)
    return 0


TASKS_HELP = (".py file, KernelBench directory, .jsonl/.parquet table or Hugging Face dataset name; "
              "TABLE#LEVEL/ID or TABLE#NAME picks one task of a table")


def add_device_option(p: argparse.ArgumentParser, what: str = "evaluate") -> None:
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help=f"where to {what}: auto (default) is cuda where a CUDA GPU is visible, else cpu")


def add_cache_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="build and baseline cache (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda-agent)")


def add_policy_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="fair", choices=sorted(PRESETS),
                   help="correctness preset: fair (default: 1e-3, TF32 for the baselines too), strict (fp32 to "
                        "1e-4), paper (1e-2, the paper's protocol)")


def add_level_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--level", type=int, action="append", metavar="N",
                   help="only tasks of this KernelBench level (repeatable; default: every level)")


def add_memory_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB",
                   help="memory each evaluation process may use, in GiB (default: half this machine's RAM, "
                        f"{default_memory_limit() / GIB:.1f} GiB here; 0: no limit)")


def add_quiet_option(p: argparse.ArgumentParser, what: str = "no progress lines") -> None:
    p.add_argument("--quiet", action="store_true", help=what)


def _continue(what: str):
    """The interrupt line of a command whose output ``what`` (of its --out) is kept as it goes."""
    return lambda args: f"{what(args) if callable(what) else what}; run the same command again to continue"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuda-agent", description="Verified, timed, rewarded CUDA kernels for "
                                     "PyTorch programs. `cuda-agent COMMAND --help` describes each command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("eval", help="evaluate a candidate against a task", description="Evaluate a candidate against a task: "
                       "build, verify, time against eager and torch.compile, reward.", epilog=EXIT_CODES)
    p.add_argument("task", help="the task: a .py file (KernelBench format), or TABLE#LEVEL/ID / TABLE#NAME")
    p.add_argument("candidate", help="candidate directory (model_new.py + kernels/) or KernelBench-style .py")
    add_language_option(p)
    add_device_option(p)
    add_policy_option(p)
    p.add_argument("--checks", type=int, default=None, help="verification checks on fresh inputs (default: the "
                                                             "preset's, 5)")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: the preset's)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: the preset's)")
    p.add_argument("--reward", default=None, choices=("milestone", "speedup"),
                   help="milestone (default: -1 wrong, 1 correct, 2 faster than eager, 3 faster than both) or "
                        "speedup (the speedup vs torch.compile)")
    p.add_argument("--timing", default="auto", choices=("auto", "events", "host", "profiler"),
                   help="how calls are timed: auto (default: CUDA events on a GPU, the host clock on the CPU), "
                        "events, host, or profiler (the paper's method)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    add_cache_option(p)
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the summary")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="evaluate on an evaluation service (cuda-agent serve) at URL, e.g. http://HOST:8470 "
                        "(default: here)")
    p.add_argument("--counters", action="store_true",
                   help="GPU: then profile one call with Nsight Compute: per-kernel counters, bottlenecks, speed of "
                        "light (advice, not part of the reward; ~10 s more)")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    add_retries_option(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve", help="run an evaluation service: evaluators behind a queue and an HTTP front")
    add_device_option(p, "evaluate (--ray: cuda unless cpu is given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for "
                                                       "other machines)")
    p.add_argument("--port", type=int, default=8470, help="port (default 8470; 0 picks a free one, printed at start)")
    p.add_argument("--token", default=None,
                   help="bearer token every request must carry (default $CUDA_AGENT_SERVICE_TOKEN); required with a "
                        "--host beyond the loopback. Clients set CUDA_AGENT_SERVICE_TOKEN")
    p.add_argument("--slots", type=int, default=None,
                   help="evaluators: default one per GPU (cuda) or 1 (cpu); with --ray, actors (default: the cluster's GPUs)")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices to serve on (default: all visible)")
    p.add_argument("--per-gpu", type=int, default=1, metavar="N",
                   help="local slots sharing each GPU (default 1): each times alone on it while the others load, "
                        "verify and read their outputs, so the GPU works between timings (memory: N reference "
                        "processes per GPU)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the slots as Ray actors on the cluster at ADDRESS ('local' starts one here; needs "
                        "cuda-agent[ray]; default: local processes)")
    add_policy_option(p)
    p.add_argument("--queue-size", type=int, default=64,
                   help="jobs that may wait (default 64); past it clients are told to retry")
    p.add_argument("--job-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="a job a slot holds longer fails as 'timeout' and the slot is replaced (default 3600)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="build and baseline cache (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda-agent; a shared "
                        "filesystem path shares it across nodes)")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_serve, kept=False)

    p = sub.add_parser("compile", help="compile-only check of a candidate's sources (no GPU needed); warms the "
                                       "build cache eval uses")
    p.add_argument("candidate", help="candidate directory (model_new.py + kernels/) or KernelBench-style .py")
    add_language_option(p)
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): cuda where a CUDA GPU is visible or the candidate has .cu sources, else "
                        "cpu; cuda compiles with nvcc without a GPU (C++ binding files need a CUDA build "
                        "of torch)")
    add_cache_option(p)
    p.add_argument("--json", action="store_true", help="print the build record as JSON")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("tasks", help="list the tasks of a source (name, digest, origin)")
    p.add_argument("source", help=TASKS_HELP)
    add_level_option(p)
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("example", help="evaluate a bundled example (the CPU one when no GPU is visible)",
                       description="Evaluate a bundled example. Examples: " + ", ".join(_example_names()) + ".",
                       epilog=EXIT_CODES)
    p.add_argument("name", nargs="?", default=None, choices=_example_names() or None, metavar="NAME",
                   help="which example: " + ", ".join(_example_names())
                        + " (default: cuda_gelu on a GPU, cpu_swish elsewhere)")
    add_device_option(p)
    add_cache_option(p)
    p.add_argument("--json", action="store_true", help="print the JSON record instead of the summary")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    add_retries_option(p)
    p.set_defaults(func=cmd_example)

    p = sub.add_parser("degenerate", help="flag tasks that zeros, a constant or an input passes")
    p.add_argument("source", help=TASKS_HELP)
    add_level_option(p)
    add_policy_option(p)
    add_device_option(p)
    add_cache_option(p)
    p.add_argument("--json", action="store_true", help="one JSON record per task")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_degenerate,
                   kept=lambda a: "the tasks reported above are checked; run the command again for the rest")

    p = sub.add_parser("synth", help="synthesise a task set: compose operators, filter by execution, decontaminate")
    p.add_argument("--n", type=int, required=True, help="accepted tasks wanted")
    p.add_argument("--out", type=Path, required=True, help="output directory (a rerun resumes it)")
    p.add_argument("--composer", default="program", choices=("program", "llm"),
                   help="program (default: random compositions from the catalog, no model) or llm (an "
                        "OpenAI-compatible endpoint writes them: --model, --base-url)")
    add_device_option(p, "screen candidates")
    p.add_argument("--workers", type=int, default=2, help="parallel screening processes (default 2)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="screen on a Ray cluster ('auto', ray://HOST:PORT, or 'local'; default: local processes); "
                        "pip install 'cuda-agent[ray]'")
    p.add_argument("--seed", type=int, default=0, help="composition seed (default 0; a rerun resumes only with the same)")
    p.add_argument("--window-ms", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   help="eager runtime window (default: 1 100 on cuda, as the paper; 0.2 200 on cpu)")
    p.add_argument("--max-candidates", type=int, default=None, help="stop after this many (default 50 x --n)")
    p.add_argument("--kernelbench", type=Path, default=None,
                   help="KernelBench programs to decontaminate against (default: $KERNELBENCH_DATA or "
                        "../shared/data/kernelbench/, where there)")
    p.add_argument("--no-decontaminate", action="store_true", help="skip the comparison with KernelBench")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers layers out of the catalog")
    p.add_argument("--model", default=None, help="LLM composer: model name (no default; needed with --composer llm)")
    p.add_argument("--base-url", default=None, help="LLM composer: OpenAI-compatible endpoint (no default; needed "
                                                   "with --composer llm)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="LLM composer: variable holding the API key "
                                                                  "(default OPENAI_API_KEY)")
    add_quiet_option(p, "no progress bar")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="bound each screening step of a candidate (runs, timing, torch.compile) to this many "
                        "seconds (default: 300)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="where the screeners keep torch.compile's cache, DIR/inductor, shared with evaluations "
                        "and later runs (default: $CUDA_AGENT_CACHE, else ~/.cache/cuda-agent)")
    add_sandbox_option(p)
    p.add_argument("--language", default="cuda", choices=LANGUAGES,
                   help="the kernels the tasks are for (default cuda; a column of tasks.jsonl, which prompts made "
                        "from it follow)")
    p.set_defaults(func=cmd_synth, kept=_continue(lambda a: f"verdicts and accepted tasks so far are in {a.out}"))

    p = sub.add_parser("baselines", help="time eager and torch.compile for every task here (resumable table)")
    p.add_argument("source", help=TASKS_HELP)
    p.add_argument("--out", type=Path, required=True, help="the table (JSONL; a rerun continues it; report beside it as .md)")
    add_level_option(p)
    add_device_option(p, "time")
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices to spread over (default: all)")
    p.add_argument("--per-gpu", type=int, default=1,
                   help="tasks in flight per GPU: they load and compile at once, time one at a time (default 1)")
    add_policy_option(p)
    p.add_argument("--no-degenerate", action="store_true", help="skip the degenerate-task check")
    p.add_argument("--deadline-s", type=float, default=None, help="take no new task after this many seconds "
                                                                  "(default: no deadline)")
    p.add_argument("--published", type=Path, default=None,
                   help="KernelBench data dir with the published H100 times to compare with (default: none)")
    add_cache_option(p)
    add_quiet_option(p)
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_baselines, kept=_continue(lambda a: f"the tasks timed so far are in {a.out}"))

    p = sub.add_parser("bench", help="evaluate a solution set over KernelBench tasks; the paper's metrics, reports, plots",
                       epilog=f"exit status: {EXIT_CORRECT} every entry has a verdict (correct or not), {EXIT_USAGE} a "
                              f"usage error, {EXIT_NO_VERDICT} some entries ended without a verdict (a busy host, or "
                              "the harness failed: not failures; the same command evaluates them again), 130 "
                              "interrupted")
    p.add_argument("source", help="the tasks: KernelBench dir or .jsonl/.parquet table (or HF dataset name); "
                                  "TABLE#LEVEL/ID picks one")
    p.add_argument("--solutions", type=Path, default=None,
                   help="one entry per task: level1_19/ (model_new.py + kernels/), level_1_problem_19_sample_0_kernel.py, "
                        "level1/19_ReLU.py; several entries of a task count with the best (no default: this or "
                        "--model)")
    p.add_argument("--model", default=None, help="run the agent live on each task with this model instead "
                                                 "(best evaluation of each trajectory; default: --solutions)")
    p.add_argument("--base-url", default=None, help="live: the OpenAI-compatible endpoint (default: the OpenAI API)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="live: variable holding the API key "
                                                                  "(default OPENAI_API_KEY)")
    p.add_argument("--tool-format", default="native", choices=("native", "hermes"),
                   help="live: native tool calls (default), or <tool_call> text for servers without a tool parser")
    p.add_argument("--max-turns", type=int, default=200, help="live: turns per episode (default 200, as the paper "
                                                              "evaluates)")
    p.add_argument("--language", default=None, choices=LANGUAGES,
                   help="the kernels' language: solutions are read as cuda or triton candidates, and the live agent "
                        "writes that language (default: each solution's own, read from its sources; the agent: cuda)")
    p.add_argument("--out", type=Path, required=True, help="run directory (a rerun continues it, retrying error rows)")
    add_level_option(p)
    add_device_option(p)
    p.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU indices, one evaluator each (default: all)")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="evaluate on an evaluation service (cuda-agent serve) at URL instead of local evaluators "
                        "(default: local)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="with --remote: evaluations (or agent episodes) in flight (default: twice the service's slots)")
    add_policy_option(p)
    p.add_argument("--baselines", type=Path, default=None,
                   help="a table from `cuda-agent baselines` on this machine: its times are reused, its degenerate "
                        "tasks flagged (default: baselines timed beside each candidate)")
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    add_cache_option(p)
    add_quiet_option(p)
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    add_retries_option(p)
    p.set_defaults(func=cmd_bench, kept=_continue(lambda a: f"finished entries are in {a.out}/results.jsonl"))

    p = sub.add_parser("report", help="remake a benchmark run's reports and plots")
    p.add_argument("run", type=Path, help="a run directory of `cuda-agent bench` (its --out)")
    add_level_option(p)
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="two benchmark runs side by side: metrics and the tasks that changed")
    p.add_argument("a", type=Path, help="the first run directory (`cuda-agent bench --out`): the before")
    p.add_argument("b", type=Path, help="the second run directory: the after")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown here (default: print only)")
    add_level_option(p)
    p.add_argument("--exclude-degenerate", action="store_true", help="leave degenerate tasks out of the metrics")
    p.add_argument("--force", action="store_true", help="compare even where a task's code differs between the runs")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("optimize", help="run the agent on a PyTorch model: a verified, faster CUDA extension")
    p.add_argument("task", help="model.py in KernelBench format (Model, get_inputs, get_init_inputs), or "
                                "TABLE#LEVEL/ID / TABLE#NAME")
    p.add_argument("--model", required=True, help="the served model's name")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                                                   "(vLLM, SGLang); default: the OpenAI API")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="variable holding the API key (default "
                                                                  "OPENAI_API_KEY)")
    p.add_argument("--tool-format", default="native", choices=("native", "hermes"),
                   help="native tool calls (default), or <tool_call> text for servers without a tool parser")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--out", type=Path, default=Path("optimized"), help="output directory (default: optimized/)")
    p.add_argument("--episodes", type=int, default=1, help="episodes run at once; the best solution is kept "
                                                           "(default 1)")
    p.add_argument("--max-turns", type=int, default=150, help="model turns per episode (default 150)")
    p.add_argument("--language", default="cuda", choices=LANGUAGES,
                   help="the kernels the agent writes: cuda (a C++/CUDA extension, default) or triton")
    p.add_argument("--context-tokens", type=int, default=128_000,
                   help="context budget; past it the oldest turns go, the system prompt and task stay (default 128000)")
    p.add_argument("--wall-clock-s", type=float, default=None, help="end an episode after this many seconds "
                                                                    "(default: no limit)")
    add_device_option(p)
    add_policy_option(p)
    p.add_argument("--no-counters", action="store_true",
                   help="utils/profile.py without the Nsight Compute counters (GPU: saves 10-14 s per profile)")
    add_quiet_option(p, "no progress lines (one per turn)")
    add_timeout_option(p)
    add_memory_option(p)
    add_sandbox_option(p)
    p.set_defaults(func=cmd_optimize, kept=lambda a: f"finished episodes are in {a.out}/trajectories.jsonl; "
                                                     "run again with a new --out")

    p = sub.add_parser("show", help="render an agent trajectory (terminal, or --html)")
    p.add_argument("trajectory", type=Path, help="trajectories.jsonl or an optimize output directory")
    p.add_argument("--episode", type=int, default=0, help="which episode of the file, from 0 (default 0)")
    p.add_argument("--html", type=Path, default=None, help="write a self-contained HTML page here (default: the "
                                                           "terminal)")
    p.add_argument("--width", type=int, default=2000, help="cut messages longer than this (default 2000)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("train", help="RL training of kernel agents: the paper's four stages, a demo, plots",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="RL training of kernel agents (one node), the paper's recipe in order:\n"
                                   "  1. ppo --single-turn  PPO on the base model: kernels in one reply, no tools\n"
                                   "  2. collect            agent trajectories from the stage-1 checkpoint\n"
                                   "  3. rft                rejection fine-tuning of the actor on the good ones\n"
                                   "  4. value              critic pretraining on the same trajectories\n"
                                   "  5. ppo                agentic PPO from the RFT actor and pretrained critic\n"
                                   "Each reads a config file (examples/train/*.yaml), writes RUN/metrics.jsonl,\n"
                                   "checkpoints and plots, and resumes RUN after an interruption.\n"
                                   "demo: PPO on a tiny model with real rewards; plot: a run's curves.")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    stage_help = {
        "ppo": "PPO: stage 1 with --single-turn (one reply, no tools), stage 3 without (the agent loop)",
        "collect": "agent trajectories (with token traces) from model.actor, for rft and value",
        "rft": "rejection fine-tuning: keep reward > 0, drop redundant loops and invalid tool calls, SFT",
        "value": "critic pretraining on trajectories, GAE targets from the critic itself; held-out explained variance",
    }
    kept_steps = _continue(lambda a: f"finished steps are checkpointed in {a.out}")
    for name, text in stage_help.items():
        q = stages.add_parser(name, help=text, description=text)
        q.add_argument("--config", type=Path, default=None,
                       help="the stage's YAML or JSON config (examples/train/); with --engine verl, an override file "
                            "for verl's trainer (default: the packaged one, cuda_agent/train/verl/configs/)")
        q.add_argument("--out", type=Path, required=True, help="run directory (resumed if it holds the same run)")
        if name == "ppo":
            q.add_argument("--single-turn", action="store_true",
                           help="stage 1: the model writes the whole solution in one reply, no tools")
        q.add_argument("--engine", choices=("ours", "verl"), default="ours",
                       help="ours (default: one node, torchrun + FSDP2) or verl (clusters: pip install "
                            "'cuda-agent[verl]'; ppo and rft)")
        q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="--engine verl: a hydra override for verl's trainer (repeatable, default none), e.g. "
                            "trainer.nnodes=4")
        q.add_argument("--dry-run", action="store_true", help="--engine verl: print the command, run nothing")
        q.set_defaults(func=cmd_train_stage, single_turn=False, kept=kept_steps)
    text = "PPO on a tiny model learns to pick the fastest correct kernel (real rewards, a few minutes on a CPU)"
    q = stages.add_parser("demo", help=text, description=text + ".")
    q.add_argument("--out", type=Path, required=True, help="run directory (resumed if it holds the same run)")
    add_device_option(q, "train and evaluate")
    q.add_argument("--steps", type=int, default=40, help="steps in total (default 40; a resumed run continues to "
                                                         "this many)")
    q.add_argument("--batch", type=int, default=16, help="episodes per step, one PPO update each (default 16)")
    q.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and sampling (default 0)")
    add_quiet_option(q, "no line per step")
    q.set_defaults(func=cmd_train_demo, kept=kept_steps)
    text = "draw curves.png and rewards.png of a run directory"
    q = stages.add_parser("plot", help=text, description=text[0].upper() + text[1:] + ".")
    q.add_argument("run", type=Path, help="a run directory (a train stage's or the demo's --out)")
    q.set_defaults(func=cmd_train_plot)

    p = sub.add_parser("catalog", help="the operator catalog the composers read (crawled from torch/transformers)")
    p.add_argument("--out", type=Path, default=None, help="build it afresh and write it here as JSON (default: "
                                                          "read the cached one)")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers layers out")
    p.add_argument("--refresh", action="store_true", help="rebuild the cached catalog")
    p.add_argument("--verbose", action="store_true", help="one line per operator")
    p.set_defaults(func=cmd_catalog)
    return parser


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program Ctrl-C stopped


def _on_interrupt(kept: str):
    """A SIGINT/SIGTERM handler that ends the command at once: one line saying what was kept, every
    process below this one killed, exit 130.

    Exiting from the handler rather than raising KeyboardInterrupt is deliberate: thread pools wait
    for their queued work on the way out (a Ctrl-C'd ``bench`` went on through every task), and a
    worker killed mid-job would be recorded as a failed row, so that a resumed run would skip it.
    Everything a command keeps is written as it finishes (rows, verdicts, checkpoints), so nothing
    is lost by not unwinding."""

    def stop(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        from cuda_agent.sandbox.process import descendants

        children = descendants(os.getpid())[1:]
        name = signal.Signals(signum).name
        # On a terminal a progress bar may hold the line: start a new one.
        print(f"{chr(10) if sys.stderr.isatty() else ''}cuda-agent: stopped by {name}; {kept}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        # No other thread may run between the kills and the exit (one would record its killed worker
        # as a failure): os.kill keeps the GIL, and a long switch interval keeps it from being handed over.
        sys.setswitchinterval(60)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # already gone
        # Its scratch folders (evaluation jobs, reference homes, synth scratch) go with it, as on a normal finish.
        from cuda_agent import scratch

        scratch.remove_all()
        os._exit(INTERRUPTED)

    return stop


def _resume_hint(args: argparse.Namespace) -> str:
    """What an interruption of this command leaves and how to go on: the line ``_on_interrupt`` prints."""
    kept = getattr(args, "kept", None)
    return kept(args) if kept else "nothing was kept (it saves nothing part-way); run the command again"


def _interruptible(args: argparse.Namespace) -> dict[int, object] | None:
    """Install the interrupt handlers for this command; the ones they replace (None where signals
    cannot be set here: not the main thread, or a command that handles them itself)."""
    if getattr(args, "kept", None) is False or threading.current_thread() is not threading.main_thread():
        return None
    handler = _on_interrupt(_resume_hint(args))
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = _interruptible(args)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        if isinstance(exc, BrokenPipeError):
            # The reader went away (`cuda-agent tasks ... | head -1`): what it wanted was printed.
            # Python would complain again flushing stdout at exit; point it at /dev/null.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"cuda-agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        # main() is called in-process by tests and scripts: leave their handlers as they were.
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
