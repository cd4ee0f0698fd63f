"""The agent's persistent bash shell and its background jobs, both inside the sandbox.

``Sandbox.spawn`` gives every process ``stdin=/dev/null``, so the shell reads its
commands from a private pipe passed as an extra file descriptor. Each command
is sent as ``eval $'...'`` (quoted, so an unbalanced quote in it cannot swallow
what follows) with stdin from /dev/null (so ``cat`` cannot eat the next
command), followed by a line that prints a fresh random sentinel and ``$?``:
the output up to the sentinel is the command's, the number after it its exit
code. ``cd`` and ``export`` persist because ``eval`` runs in the shell itself.

A background job is a separate sandboxed ``bash -c`` started in the shell's
current directory with the shell's exported variables. Its output goes to a
pipe read by this process, so the agent can neither see nor forge it except
through ``bash_output``, and it survives a restart of the shell.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cuda_agent.sandbox.process import Limits, Sandbox, describe_returncode, kill_group

# Output kept in memory per shell or job before the middle is dropped (a command
# printing without end must not exhaust the host's memory).
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024


class ShellError(RuntimeError):
    """The shell could not be started or fed; the message says why."""


class OutputReader(threading.Thread):
    """Drains a pipe into memory, keeping at most ``cap`` bytes: the oldest half and the newest.

    Dropped bytes are counted at ``gap``, the position in ``data`` where they were, so a
    reader can say how much is missing and where.
    """

    def __init__(self, stream, cap: int = DEFAULT_BUFFER_BYTES):
        super().__init__(daemon=True)
        self.stream = stream
        self.cap = max(cap, 1024)
        self.changed = threading.Condition()
        self.data = bytearray()
        self.gap = 0
        self.dropped = 0
        self.eof = False

    def run(self) -> None:
        try:
            while True:
                chunk = self.stream.read1(65536)
                if not chunk:
                    break
                with self.changed:
                    self.data += chunk
                    excess = len(self.data) - self.cap
                    if excess > 0:
                        if not self.dropped:
                            self.gap = self.cap // 2
                        del self.data[self.gap:self.gap + excess]
                        self.dropped += excess
                    self.changed.notify_all()
        except (OSError, ValueError):  # the stream was closed under us by close()
            pass
        with self.changed:
            self.eof = True
            self.changed.notify_all()

    def take(self, end: int | None = None, skip: int = 0) -> tuple[str, str, int]:
        """Remove ``data[:end]`` (all of it by default) plus ``skip`` more bytes, returning it as
        (text before the gap, text after it, bytes dropped at the gap). Call with ``changed`` held."""
        end = len(self.data) if end is None else end
        taken = bytes(self.data[:end])
        if self.dropped and self.gap <= end:
            head, tail, dropped = taken[:self.gap], taken[self.gap:], self.dropped
            self.dropped = 0
        else:
            head, tail, dropped = taken, b"", 0
            self.gap = max(self.gap - end - skip, 0)
        del self.data[:end + skip]
        return head.decode(errors="replace"), tail.decode(errors="replace"), dropped


@dataclass
class CommandResult:
    head: str  # the output; if bytes were dropped, they were between head and tail
    tail: str
    dropped: int
    exit_code: int | None
    timed_out: bool = False
    shell_exited: bool = False  # the command ended the shell (exit, set -e, exec ...)

    @property
    def output(self) -> str:
        return self.head + self.tail


def ansi_c_quote(text: str) -> str:
    """``text`` as a bash ``$'...'`` word: one line, every byte spelled safely."""
    out = []
    for byte in text.encode("utf-8", errors="surrogateescape"):
        char = chr(byte)
        if char in "\\'":
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\x{byte:02x}")
    return "$'" + "".join(out) + "'"


def _untrace(text: str, token: str) -> str:
    """Drop the trace of the sentinel line that ``set -x`` prints: it is not the agent's."""
    return re.sub(f"[^\n]*{token}[^\n]*\n?", "", text) if token in text else text


def _bash() -> str:
    path = shutil.which("bash")
    if path is None:
        raise ShellError("bash is not installed")
    return os.path.realpath(path)


class Shell:
    """One long-lived bash in the sandbox; ``run`` executes a command in it and waits.

    A command that runs past its time limit gets the whole sandbox killed (its own
    background processes with it) and a fresh shell is started.
    """

    def __init__(self, sandbox: Sandbox, cwd: Path, env: dict[str, str], *, gpu: bool = False,
                 writable: Sequence[Path] = (), readable: Sequence[Path] = (), read_only: Sequence[Path] = (),
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        self.sandbox = sandbox
        self.cwd = Path(cwd)
        self.env = dict(env)
        self.gpu = gpu
        self.writable, self.readable, self.read_only = tuple(writable), tuple(readable), tuple(read_only)
        self.buffer_bytes = buffer_bytes
        self.proc: subprocess.Popen | None = None
        self._stdin: int | None = None
        self._reader: OutputReader | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.close()
        read_end, write_end = os.pipe()
        bash = _bash()
        # The inner bash reads commands from the pipe; the fd is closed again so that
        # nothing the agent runs inherits it.
        inner = f"exec {shlex.quote(bash)} --noprofile --norc -s <&{read_end} {read_end}<&-"
        try:
            self.proc = self.sandbox.spawn(
                [bash, "--noprofile", "--norc", "-c", inner], cwd=self.cwd, env=self.env, limits=Limits(),
                gpu=self.gpu, pass_fds=(read_end,), writable=self.writable, readable=self.readable,
                read_only=self.read_only)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(write_end, False)
        self._stdin = write_end
        self._reader = OutputReader(self.proc.stdout, self.buffer_bytes)
        self._reader.start()

    def run(self, command: str, timeout_s: float) -> CommandResult:
        if not self.alive:
            self.start()
        assert self.proc is not None and self._reader is not None
        deadline = time.monotonic() + timeout_s
        token = secrets.token_hex(12)
        # The marker is printed from two halves, so an echo of this line (set -x, set -v) never contains it.
        marker = f"__CUDA_AGENT_DONE_{token}".encode()
        line = (f"builtin eval {ansi_c_quote(command)} < /dev/null\n"
                f"builtin printf '\\n%s%s %d\\n' __CUDA_AGENT_DONE_ {token} \"$?\"\n")
        pattern = re.compile(rb"(?:^|\n)" + re.escape(marker) + rb" (-?\d+)\n")
        reader = self._reader
        if not self._send(line.encode(), deadline):
            return self._stop(timed_out=self.alive)
        with reader.changed:
            while True:
                found = pattern.search(reader.data)
                if found:
                    code = int(found.group(1))  # before take(): the match reads the buffer it mutates
                    head, tail, dropped = reader.take(found.start(), skip=found.end() - found.start())
                    return CommandResult(_untrace(head, token), _untrace(tail, token), dropped, code)
                if reader.eof:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                reader.changed.wait(timeout=min(remaining, 1.0))
        return self._stop(timed_out=not reader.eof)

    def _send(self, data: bytes, deadline: float) -> bool:
        """Write ``data`` to the shell's stdin; False if the shell is gone or stuck past the deadline."""
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            select.select([], [self._stdin], [], min(remaining, 1.0))
            try:
                written = os.write(self._stdin, view)
            except BlockingIOError:
                continue
            except BrokenPipeError:
                return False
            view = view[written:]
        return True

    def _stop(self, timed_out: bool) -> CommandResult:
        """End this shell after a timeout or its own exit and return what it printed."""
        assert self.proc is not None and self._reader is not None
        if timed_out:
            kill_group(self.proc)
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            code = self.proc.wait()
        self._reader.join(timeout=5)
        with self._reader.changed:
            head, tail, dropped = self._reader.take()
        self.close()
        return CommandResult(head, tail, dropped, None if timed_out else code, timed_out=timed_out,
                             shell_exited=not timed_out)

    def snapshot(self, timeout_s: float = 10.0) -> tuple[str, str] | None:
        """The shell's current directory and its ``declare -px`` (exported variables), or None."""
        if not self.alive:
            return None
        result = self.run("builtin declare -px; builtin printf '\\n%s' \"$PWD\"", timeout_s)
        if result.exit_code != 0 or result.dropped:
            return None
        exports, _, cwd = result.output.rpartition("\n")
        return cwd, exports

    def close(self) -> None:
        if self._stdin is not None:
            os.close(self._stdin)
            self._stdin = None
        if self.proc is not None:
            kill_group(self.proc)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self._reader is not None:
                self._reader.join(timeout=5)
            # A process that left the group (setsid, unsandboxed only) may still hold the pipe; then
            # the reader thread is blocked on it and closing would wait for that thread.
            if self.proc.stdout is not None and (self._reader is None or not self._reader.is_alive()):
                self.proc.stdout.close()
            self.proc = None
            self._reader = None


class BackgroundJob:
    """A command running in its own sandbox; ``poll`` returns its output since the last poll."""

    def __init__(self, job_id: str, command: str, proc: subprocess.Popen, buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        self.job_id = job_id
        self.command = command
        self.proc = proc
        self.reader = OutputReader(proc.stdout, buffer_bytes)
        self.reader.start()
        self.killed = False
        self._reaped = False

    @classmethod
    def start(cls, job_id: str, command: str, sandbox: Sandbox, *, cwd: Path, shell_cwd: str | None,
              exports: str | None, env: dict[str, str], gpu: bool = False, writable: Sequence[Path] = (),
              readable: Sequence[Path] = (), read_only: Sequence[Path] = (),
              buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> "BackgroundJob":
        script = command
        if shell_cwd is not None:
            script = f"cd -- {shlex.quote(shell_cwd)} || exit 1\n{script}"
        if exports is not None:
            # 2>/dev/null: read-only variables the shell exported cannot be declared again; harmless.
            script = f"{{ {exports}\n}} 2>/dev/null\n{script}"
        bash = _bash()
        proc = sandbox.spawn([bash, "--noprofile", "--norc", "-c", script], cwd=cwd, env=env, limits=Limits(),
                             gpu=gpu, writable=writable, readable=readable, read_only=read_only)
        return cls(job_id, command, proc, buffer_bytes)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def poll(self) -> tuple[str, str, int, int | None]:
        """(head, tail, bytes dropped between them, exit code or None while running). The exit
        code is read before the output, so output printed just before the exit is not missed."""
        code = self.proc.poll()
        if code is not None and not self._reaped:
            self._reaped = True
            kill_group(self.proc)  # stray children of a finished job must not outlive it
            self.reader.join(timeout=5)
        with self.reader.changed:
            head, tail, dropped = self.reader.take()
        return head, tail, dropped, code

    def kill(self) -> None:
        self.killed = self.running
        kill_group(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if not self._reaped:
            self._reaped = True
            self.reader.join(timeout=5)

    def describe_exit(self) -> str:
        if self.killed:
            return "stopped by kill_job"
        code = self.proc.returncode
        return f"exit code {code}" if code is not None and code >= 0 else describe_returncode(code)
