"""The top-level parser (each command family adds its own commands) and ``main``: interrupts, errors, exit."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cuda_agent.cli import agent, bench, evaluation, serve, tasks, train
from cuda_agent.cli.common import EXIT_USAGE, USER_ERRORS

# The families in the order `cuda-agent --help` lists them: evaluating one candidate, serving, task sets,
# benchmarks, the agent, training.
FAMILIES = (evaluation, serve, tasks, bench, agent, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cuda-agent", description="Verified, timed, rewarded CUDA kernels for "
                                     "PyTorch programs. `cuda-agent COMMAND --help` describes each command.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for family in FAMILIES:
        family.register(sub)
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
        from cuda_agent import jsonl

        # Before the kills: removing the scratch folders below releases the GIL, and a thread that then sees its
        # worker killed would record it as a failure.
        jsonl.freeze()
        from cuda_agent.sandbox.proctree import descendants

        children = descendants(os.getpid())[1:]
        name = signal.Signals(signum).name
        # On a terminal a progress bar may hold the line: start a new one.
        print(f"{chr(10) if sys.stderr.isatty() else ''}cuda-agent: stopped by {name}; {kept}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        # Few other threads run between the kills and the exit: os.kill keeps the GIL, and a long switch interval
        # keeps it from being handed over (the file system calls below release it; the freeze above covers those).
        sys.setswitchinterval(60)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # already gone
        # A killed process runs on until the kernel has taken it down: one still writing into a scratch folder
        # while it is removed leaves the folder behind. Waited for briefly (dead or a zombie is gone).
        from cuda_agent.sandbox.proctree import process_state

        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(process_state(pid) not in (None, "Z") for pid in children):
            time.sleep(0.02)
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


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed for: ``train ppo``'s, not the top level's."""
    found = parser
    while True:
        action = next((a for a in found._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, action.dest, None) if action is not None else None
        if name not in (action.choices if action is not None else {}):
            return found
        found = action.choices[name]


def path_error(exc: OSError, args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """An error on a path the user gave, said with the option that gave it and what it needs: the system's
    words (``[Errno 17] File exists: 'run'``) name neither."""
    if not exc.filename:
        return str(exc)
    failed = Path(exc.filename)
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not isinstance(value, Path) or not (failed == value or value in failed.parents):
            continue
        name = action.option_strings[0] if action.option_strings else action.metavar or action.dest
        flag = f"{name} {value}"
        if exc.errno in (errno.EEXIST, errno.ENOTDIR):
            return f"{flag}: {failed} is a file where a directory is needed; give a directory (a new one, or one the " \
                   "command wrote before)"
        if exc.errno == errno.EISDIR:
            return f"{flag} is a directory where a file is needed; give a file's path"
        return f"{flag}: {exc.strerror or exc}"
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's usage, not the top level's: it lists the options that exist where the user typed.
        command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    previous = _interruptible(args)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        if isinstance(exc, BrokenPipeError):
            # The reader went away (`cuda-agent tasks ... | head -1`): what it wanted was printed.
            # Python would complain again flushing stdout at exit; point it at /dev/null.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        message = path_error(exc, args, command_parser(parser, args)) if isinstance(exc, OSError) else str(exc)
        print(f"cuda-agent: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        # main() is called in-process by tests and scripts: leave their handlers as they were.
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)
