"""Helpers every command family shares: exit statuses, progress lines, the options several commands take and
how their values are read."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cuda_agent.agent.llm import BackendError
from cuda_agent.candidates import CandidateError
from cuda_agent.evaluate import Timeouts
from cuda_agent.evaluate.evaluator import default_memory_limit
from cuda_agent.evaluate.protocol.policy import PRESETS
from cuda_agent.evaluate.retry import RetryPolicy
from cuda_agent.sandbox import SANDBOX_CHOICES, SandboxUnavailable
from cuda_agent.service.messages import ServiceError
from cuda_agent.tasks import TaskError

# Exit statuses: a verdict of correct, a candidate's failure (incorrect, failed), an error in what the user gave
# (files, settings, the machine: one line, no traceback), no verdict (the evaluator could not decide; not the
# candidate's doing), and Ctrl-C (``INTERRUPTED``).
EXIT_CORRECT, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_VERDICT = 0, 1, 2, 3


EXIT_CODES = (f"exit status: {EXIT_CORRECT} correct, {EXIT_FAILURE} the candidate failed (incorrect, failed), "
              f"{EXIT_USAGE} a usage error, {EXIT_NO_VERDICT} no verdict (the evaluator could not decide: a busy host, "
              "or the task or harness failed; no reward, and not the candidate's failure), 130 interrupted")


USER_ERRORS = (TaskError, CandidateError, SandboxUnavailable, BackendError, ServiceError, ValueError, OSError)


GIB = 1024**3


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


# What each stage of an evaluation does, in the words the default (not --verbose) progress uses.
STAGE_WORDS = {
    "build": "building the candidate's extension(s)",
    "reference": "starting the task's reference process",
    "load": "loading the candidate",
    "verify": "checking its outputs against the task's",
    "profile": "timing the candidate",
    "baseline": "timing the baselines (eager, torch.compile)",
    "counters": "profiling one call with Nsight Compute",
}


class StageProgress:
    """The evaluator's stages (its ``on_stage``) as a person follows them, on stderr.

    ``verbose``: every stage's line as the evaluator words it (each timing round, each check). Otherwise one
    line as each stage is first reached, in plain words, and on a terminal that one line rewritten in place; a
    retry and a toolchain probe that really builds are always said. ``silent``: nothing (``--json``)."""

    def __init__(self, *, verbose: bool = False, silent: bool = False, stream=None) -> None:
        self.verbose, self.silent = verbose, silent
        self._stream = stream
        self.start = time.monotonic()
        self.seen: set[str] = set()
        self.rounds = 0
        self.open_line = False  # a terminal line is held, to be rewritten or ended
        self.last = "starting"  # what runs now, for a heartbeat (``heartbeat``)

    @property
    def stream(self):
        return self._stream or sys.stderr  # looked up when written, as say() does

    @property
    def in_place(self) -> bool:
        return not self.verbose and self.stream.isatty()

    def __call__(self, stage: str, detail: str) -> None:
        self.last = f"{stage}: {STAGE_WORDS.get(stage, detail)}"
        if self.silent:
            return
        if self.verbose:
            self._line(stage, detail)
        elif stage == "retry" or detail.startswith("toolchain probe built"):
            self._line(stage, detail)
        elif stage == "profile" and detail.startswith("round "):
            self.rounds += 1
            if self.in_place:
                self._line(stage, f"{STAGE_WORDS[stage]} (round {self.rounds})")
        elif stage not in self.seen and stage in STAGE_WORDS:
            self._line(stage, STAGE_WORDS[stage])
        self.seen.add(stage)

    def _line(self, stage: str, text: str) -> None:
        line = f"[{time.monotonic() - self.start:6.1f}s] {stage:<9} {text}"
        with _print_lock:
            if self.in_place:
                width = shutil.get_terminal_size().columns - 1
                self.stream.write("\r\x1b[K" + line[:width])
                self.open_line = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End a line held on a terminal, before the summary is printed."""
        with _print_lock:
            if self.open_line:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self.open_line = False


def clip(text: str, width: int) -> str:
    """``text`` on one line, cut at a word's end to at most ``width`` characters (`` ...`` marks the cut)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 4].rsplit(" ", 1)[0] if " " in text[: width - 4] else text[: width - 4]
    return cut.rstrip(",;:") + " ..."


@contextlib.contextmanager
def heartbeat(line: Callable[[], str], every_s: float, quiet_since: Callable[[], float]):
    """While the block runs, ``line()`` every ``every_s`` seconds in which nothing else was said
    (``quiet_since()``: when the last line was): a long first evaluation is not a silent minute."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            if time.monotonic() - quiet_since() >= every_s:
                say(line())

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def out_dir(path: Path, flag: str = "--out", what: str = "a run directory is") -> Path:
    """``path`` as a directory a command writes, refused at once where it is a file (mkdir would say
    only ``[Errno 17] File exists``)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, and {what} written there: give a new directory, or one "
                         "an earlier run of the command wrote, to continue it")
    return path


def add_verbose_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every stage's detail (each check, each timing round) instead of one line a stage")


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


def _kernelbench_default() -> Path | None:
    import os

    for path in (os.environ.get("KERNELBENCH_DATA"), "../shared/data/kernelbench"):
        if path and (Path(path) / "kernelbench.jsonl").exists():
            return Path(path) / "kernelbench.jsonl"
    return None


def add_language_option(p: argparse.ArgumentParser) -> None:
    from cuda_agent.candidates.triton import LANGUAGES

    p.add_argument("--language", choices=LANGUAGES, default=None,
                   help="the candidate's language: cuda (a C++/CUDA extension) or triton (model_new.py launching "
                        "@triton.jit kernels); default: read from its sources")
