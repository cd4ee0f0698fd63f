"""``cuda-agent eval``, ``example`` and ``compile``: one candidate against one task, and its build alone."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading

from cuda_agent.build import build, compile_only
from cuda_agent.candidates import Candidate, load_candidate
from cuda_agent.candidates.triton import TRITON_COMPILE_NOTE
from cuda_agent.cli.common import (EXIT_CODES, GIB, USER_ERRORS, StageProgress, _memory_limit, _plural, _retry,
    _status_line, _timeouts, add_cache_option, add_device_option, add_memory_option, add_policy_option,
    add_language_option, add_retries_option, add_sandbox_option, add_timeout_option, add_verbose_option, exit_status,
    say)
from cuda_agent.evaluate import Evaluator, Policy, TimingConfig, resolve_device
from cuda_agent.evaluate.counters import times_of, unavailable
from cuda_agent.evaluate.counters_run import find_ncu
from cuda_agent.evaluate.evaluator import default_memory_limit
from cuda_agent.evaluate.result import BUSY, BUSY_ADVICE, EvalResult
from cuda_agent.guard import check_candidate
from cuda_agent.paths import EXAMPLES
from cuda_agent.tasks import load_task


REMOTE_PROGRESS_S = 5.0  # how often `eval --remote` says what the service is doing


def cmd_eval(args: argparse.Namespace) -> int:
    progress = StageProgress(verbose=args.verbose, silent=args.json)
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
            on_stage=progress,
            retry=_retry(args),
        )
        if args.counters:
            _check_counters(evaluator, remote=bool(args.remote))
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
    progress.close()
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


def _check_counters(evaluator, *, remote: bool) -> None:
    """``--counters`` refused before the evaluation, not after it, where nothing here can profile."""
    if evaluator.device != "cuda":
        raise ValueError("--counters profiles one call with Nsight Compute, which needs an NVIDIA GPU, and this "
                         f"evaluation runs on the {evaluator.device.upper()}: drop --counters, or evaluate on a GPU "
                         "(--device cuda)")
    if not remote and find_ncu() is None:
        raise ValueError("--counters needs Nsight Compute (ncu), which was not found: it ships with the CUDA toolkit "
                         "(CUDA_HOME/bin/ncu); put it on PATH or set CUDA_AGENT_NCU, or drop --counters")


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
        memory_limit=args.memory_limit, retries=args.retries, verbose=args.verbose, language=None,
    )
    return cmd_eval(ns)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this family's commands to the top-level parser's subcommands."""
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
    add_verbose_option(p)
    p.set_defaults(func=cmd_eval)

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
    add_verbose_option(p)
    p.set_defaults(func=cmd_example)
