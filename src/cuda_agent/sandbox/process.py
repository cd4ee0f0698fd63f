"""Child processes with a time limit on the whole process group, an output cap
and a JSON request/response channel on private pipes."""

from __future__ import annotations

import collections
import json
import secrets
import os
import selectors
import socket
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from cuda_agent.paths import compiler_env
from cuda_agent.sandbox.proctree import caught_signals, descendants, process_state, tree_thread_cpu, tree_threads

DEFAULT_OUTPUT_LIMIT = 2 * 1024 * 1024
TAIL_BYTES = 16 * 1024
# Between looks at a tree being stopped: a stop lands in 0.1-1 ms (a torch process's 20 threads each take it);
# the evaluator stops the candidate twice around every timed region, so a 1 ms poll would cost ~1 ms a stop.
PAUSE_POLL_S = 0.0001


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 600.0
    output_bytes: int = DEFAULT_OUTPUT_LIMIT
    # Address-space limits break CUDA start-up, so they apply to CPU-only jobs.
    memory_bytes: int | None = None


@dataclass
class ProcessResult:
    returncode: int | None
    output: str
    output_bytes: int
    seconds: float
    timed_out: bool = False
    output_flooded: bool = False
    # User+system CPU-seconds of the process and every descendant it reaped (the sandbox's init reaps
    # them all): what a build costs the host, which wall time on a shared host does not tell.
    cpu_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_flooded

    def describe_failure(self) -> str:
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        if self.output_flooded:
            return f"printed more than {self.output_bytes} bytes of output"
        return describe_returncode(self.returncode)


def describe_returncode(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (killed: possibly out of memory)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


class Sandbox(Protocol):
    """Starts a process for untrusted work; ``gpu`` says whether it may see GPUs.

    The job may write to ``cwd`` and to the directories in ``writable``; a
    sandbox that confines the file system makes everything else read-only and
    may hide private places such as /tmp, so directories the job must read
    from there are named in ``readable``. ``read_only`` names existing files or
    directories inside ``cwd`` or ``writable`` that the job may read but not
    change (the agent's protected workspace files); only a confining sandbox
    can enforce it.
    """

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: dict[str, str],
        limits: Limits,
        gpu: bool,
        pass_fds: Sequence[int] = (),
        writable: Sequence[Path] = (),
        readable: Sequence[Path] = (),
        read_only: Sequence[Path] = (),
    ) -> subprocess.Popen: ...


class LocalSandbox:
    """Process isolation only: a fresh process group per job, limits, no shared state."""

    name = "process"

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: dict[str, str],
        limits: Limits,
        gpu: bool,
        pass_fds: Sequence[int] = (),
        writable: Sequence[Path] = (),
        readable: Sequence[Path] = (),
        read_only: Sequence[Path] = (),
    ) -> subprocess.Popen:
        # No file-system confinement: the job may write wherever this user may, read_only included.
        del writable, readable, read_only
        memory = None if gpu else limits.memory_bytes

        def preexec() -> None:
            if memory:
                import resource

                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        return subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            preexec_fn=preexec if memory else None,
        )


class _OutputCapture(threading.Thread):
    """Drains a child's output, keeps the tail, and kills the group past the cap."""

    def __init__(self, proc: subprocess.Popen, limit: int):
        super().__init__(daemon=True)
        self.proc = proc
        self.limit = limit
        self.total = 0
        self.flooded = False
        self._head = bytearray()
        self._tail = bytearray()

    def run(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            self.total += len(chunk)
            if len(self._head) < TAIL_BYTES:
                self._head += chunk[: TAIL_BYTES - len(self._head)]
            self._tail += chunk
            if len(self._tail) > TAIL_BYTES:
                del self._tail[: len(self._tail) - TAIL_BYTES]
            if self.total > self.limit and not self.flooded:
                self.flooded = True
                kill_group(self.proc)

    def text(self) -> str:
        if self.total <= TAIL_BYTES:
            return bytes(self._tail).decode(errors="replace")
        skipped = self.total - len(self._head) - len(self._tail)
        return (
            bytes(self._head[:4096]).decode(errors="replace")
            + f"\n[... {max(skipped, 0)} bytes of output omitted ...]\n"
            + bytes(self._tail).decode(errors="replace")
        )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_command(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    limits: Limits = Limits(),
    sandbox: Sandbox | None = None,
    gpu: bool = False,
    writable: Sequence[Path] = (),
    readable: Sequence[Path] = (),
) -> ProcessResult:
    """Run one command to completion under the limits; ``writable`` as in ``Sandbox.spawn``. Without
    ``env`` the command gets ``paths.compiler_env()``: the allowlisted variables only, never the
    evaluator's whole environment."""
    sandbox = sandbox or LocalSandbox()
    start = time.monotonic()
    proc = sandbox.spawn(
        argv, cwd=cwd, env=env or compiler_env(), limits=limits, gpu=gpu, writable=tuple(writable),
        readable=tuple(readable),
    )
    capture = _OutputCapture(proc, limits.output_bytes)
    capture.start()
    reaped = _reap(proc, start + limits.timeout_s)
    timed_out = reaped is _TIMED_OUT
    if timed_out:
        kill_group(proc)
        reaped = _reap(proc, None)
    kill_group(proc)  # stray children of a finished job must not outlive it
    cpu_s = _job_cpu_s(proc, sandbox, reaped)
    capture.join(timeout=5)
    return ProcessResult(
        returncode=proc.returncode,
        output=capture.text(),
        output_bytes=capture.total,
        seconds=time.monotonic() - start,
        timed_out=timed_out,
        output_flooded=capture.flooded,
        cpu_s=cpu_s,
    )


def _job_cpu_s(proc: subprocess.Popen, sandbox: Sandbox, reaped: Any) -> float | None:
    """The job's CPU-seconds: its cgroup's ``cpu.stat`` where the sandbox gave it one (every process of
    the job, reaped or not); else ``wait4``'s usage where the command is our own child and reaps its
    children itself (``LocalSandbox``). bwrap's outer process exits on its init's word without reaping
    that init, so ``wait4`` sees nothing of a bwrap job: None there."""
    cgroup = getattr(proc, "cgroup", None)
    if cgroup is not None:
        try:
            for line in (Path(cgroup) / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None  # removed already (another spawn's clean-up of empty job cgroups)
    return reaped if isinstance(reaped, float) and isinstance(sandbox, LocalSandbox) else None


_TIMED_OUT = object()


def _reap(proc: subprocess.Popen, deadline: float | None) -> Any:
    """Wait for ``proc`` (until ``deadline``, monotonic, or for ever) and return its CPU-seconds with its
    reaped descendants', or ``_TIMED_OUT``. ``Popen.wait`` discards the child's rusage, so this reaps
    with ``wait4`` in the same polling loop ``Popen.wait(timeout)`` uses, and hands the status to the
    Popen's own handler (``_BwrapPopen`` translates bwrap's exit codes there)."""
    delay = 0.0005
    while True:
        try:
            pid, status, usage = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: the exit status is still Popen's to find
            proc.wait()
            return None
        if pid == proc.pid:
            proc._handle_exitstatus(status)  # type: ignore[attr-defined]
            return usage.ru_utime + usage.ru_stime
        remaining = deadline - time.monotonic()  # type: ignore[operator]
        if remaining <= 0:
            return _TIMED_OUT
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


FDS_PER_MESSAGE = 250  # the kernel carries at most 253 descriptors a message


def send_fd(sock: socket.socket, fd: int) -> None:
    """Send a copy of ``fd`` over a Unix socket (SCM_RIGHTS)."""
    send_fds(sock, [fd])


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    """Send copies of ``fds``, ``FDS_PER_MESSAGE`` to a message (``receive_fds`` takes them in order)."""
    for at in range(0, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"F"], fds[at:at + FDS_PER_MESSAGE])


def receive_fd(sock: socket.socket, timeout_s: float) -> int:
    """The one descriptor sent over ``sock``; OSError (TimeoutError) if none arrives in time."""
    return receive_fds(sock, 1, timeout_s)[0]


def receive_fds(sock: socket.socket, count: int, timeout_s: float) -> list[int]:
    """``count`` descriptors sent over ``sock`` by ``send_fds``; OSError (TimeoutError) if they do not
    arrive in time (the ones that did are closed)."""
    received: list[int] = []
    sock.settimeout(timeout_s)
    try:
        while len(received) < count:
            want = min(FDS_PER_MESSAGE, count - len(received))
            data, fds, _flags, _addr = socket.recv_fds(sock, 1, want)
            received.extend(fds)
            if len(fds) != want:
                raise OSError(f"expected {want} descriptor(s), got {len(fds)}"
                              + ("" if data else " (the channel is closed)"))
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    finally:
        sock.settimeout(None)
    return received


class WorkerTimeout(RuntimeError):
    pass


class WorkerCrashed(RuntimeError):
    pass


class WorkerForgedReply(WorkerCrashed):
    """A reply that does not carry its request's nonce: written by something other
    than the worker's request loop (code under test writing to the reply pipe)."""


@dataclass
class WorkerProcess:
    """A long-lived child answering JSON requests on private pipes (fds 3 and 4 in the child).

    The child's stdout/stderr are captured separately, so whatever the code
    under test prints can never be mistaken for a reply.
    """

    argv: Sequence[str]
    cwd: Path
    env: dict[str, str]
    limits: Limits = field(default_factory=Limits)
    gpu: bool = False
    sandbox: Sandbox = field(default_factory=LocalSandbox)
    # Directories the worker may write besides cwd (see Sandbox.spawn).
    writable: Sequence[Path] = ()
    readable: Sequence[Path] = ()
    # A Unix socket for handing file descriptors to and from the worker (CUDA_AGENT_FD_SOCKET).
    fd_channel: bool = False

    def __post_init__(self) -> None:
        req_r, self._req_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        child_env = dict(self.env)
        child_env["CUDA_AGENT_REQUEST_FD"] = str(req_r)
        child_env["CUDA_AGENT_RESPONSE_FD"] = str(resp_w)
        self.fds: socket.socket | None = None
        child_fds = None
        if self.fd_channel:
            self.fds, child_fds = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            child_env["CUDA_AGENT_FD_SOCKET"] = str(child_fds.fileno())
        self.proc = self.sandbox.spawn(
            self.argv,
            cwd=self.cwd,
            env=child_env,
            limits=self.limits,
            gpu=self.gpu,
            pass_fds=(req_r, resp_w) + ((child_fds.fileno(),) if child_fds else ()),
            writable=tuple(self.writable),
            readable=tuple(self.readable),
        )
        os.close(req_r)
        os.close(resp_w)
        if child_fds:
            child_fds.close()
        self._capture = _OutputCapture(self.proc, self.limits.output_bytes)
        self._capture.start()
        self._buffer = b""
        self._nonces: collections.deque[str] = collections.deque()
        self._started = time.monotonic()
        self._pidfds: dict[int, int] = {}  # the tree's processes as the last ``pause`` found them (``stop_known``)
        self._early: set[int] = set()  # those ``stop_known`` stopped, for the ``pause`` after it
        self._paused: set[int] = set()  # those the last ``pause`` stopped, for ``resume``

    @property
    def output(self) -> str:
        """What the worker printed so far; complete only once the worker is closed."""
        return self._capture.text()

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._nonces)

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(message)
        return self.receive(timeout_s)

    def send(self, message: dict[str, Any]) -> None:
        """Send a request without waiting, so two workers can work at once.

        Each request carries a fresh random nonce that its reply must echo, so
        code running inside the worker cannot answer in the worker's place by
        writing a line to the reply pipe without first reading the nonce out of
        the request loop's memory.
        """
        nonce = secrets.token_hex(16)
        try:
            os.write(self._req_w, (json.dumps(message | {"nonce": nonce}) + "\n").encode())
        except BrokenPipeError:
            raise WorkerCrashed(self._death_reason()) from None
        self._nonces.append(nonce)

    def receive(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        selector = selectors.DefaultSelector()
        selector.register(self._resp_r, selectors.EVENT_READ)
        try:
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.kill()
                    raise WorkerTimeout(f"no answer within {timeout_s:.0f} s")
                if not selector.select(timeout=min(remaining, 0.5)):
                    if self._capture.flooded:
                        self.kill()
                        raise WorkerCrashed(self._death_reason())
                    continue
                chunk = os.read(self._resp_r, 1 << 20)
                if not chunk:
                    self.proc.wait(timeout=10)
                    raise WorkerCrashed(self._death_reason())
                self._buffer += chunk
        finally:
            selector.close()
        line, _, self._buffer = self._buffer.partition(b"\n")
        expected = self._nonces.popleft() if self._nonces else None
        try:
            reply = json.loads(line)
        except ValueError:
            self.kill()
            raise WorkerForgedReply("sent a reply that is not JSON") from None
        if not isinstance(reply, dict) or expected is None or reply.pop("nonce", None) != expected:
            self.kill()
            raise WorkerForgedReply("sent a reply that does not answer its request (written by code under test?)")
        return reply

    def send_fd(self, fd: int) -> None:
        """Hand ``fd`` to the worker over its descriptor channel (``fd_channel``)."""
        if self.fds is None:
            raise OSError("this worker has no descriptor channel")
        send_fd(self.fds, fd)

    def send_fds(self, fds: list[int]) -> None:
        if self.fds is None:
            raise OSError("this worker has no descriptor channel")
        send_fds(self.fds, fds)

    def receive_fd(self, timeout_s: float) -> int:
        """A descriptor the worker sent over its descriptor channel."""
        if self.fds is None:
            raise OSError("this worker has no descriptor channel")
        return receive_fd(self.fds, timeout_s)

    def pause(self, timeout_s: float = 2.0) -> bool:
        """Stop the worker and everything it started (SIGSTOP), and wait until each is stopped: it can
        then neither run nor launch work while another process is timed. Whether all stopped (a
        process started meanwhile is stopped too)."""
        deadline = time.monotonic() + timeout_s
        self._paused, self._early = self._early, set()
        first = True
        while True:
            tree = self.tree()
            if first:
                self._remember(tree)
                first = False
            running = [pid for pid in tree if process_state(pid) not in ("T", "t", "Z", "X", None)]
            if not running:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in running:
                if pid not in self._paused:
                    try:
                        os.kill(pid, signal.SIGSTOP)
                    except (ProcessLookupError, PermissionError):
                        continue
                    self._paused.add(pid)
            time.sleep(PAUSE_POLL_S)

    def stop_known(self) -> None:
        """SIGSTOP at once to the processes the last ``pause`` found, through descriptors of them (a pid may have
        been reused since, a pidfd not): no walk of the tree, which takes 0.5-1 ms on a GPU worker's (its threads'
        ``children`` lists read one by one). A ``pause`` must follow, to stop any process started since and wait
        for all; ``resume`` lets them go."""
        for pid, fd in list(self._pidfds.items()):
            try:
                signal.pidfd_send_signal(fd, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError, OSError):
                continue
            self._early.add(pid)

    def _remember(self, tree: list[int]) -> None:
        for pid in [p for p in self._pidfds if p not in tree]:
            os.close(self._pidfds.pop(pid))
        for pid in tree:
            if pid not in self._pidfds:
                try:
                    self._pidfds[pid] = os.pidfd_open(pid)
                except OSError:
                    continue

    @property
    def _cgroup(self) -> Path | None:
        return getattr(self.proc, "cgroup", None)  # the sandbox's job cgroup, where it made one

    def tree(self) -> list[int]:
        """The worker's process and every process below it, seen from outside (``descendants``)."""
        return descendants(self.proc.pid, self._cgroup)

    def threads(self) -> dict[int, str]:
        """Every thread of the worker and what it started, seen from outside."""
        return tree_threads(self.proc.pid, self._cgroup)

    def thread_cpu(self) -> dict[int, tuple[str, int]]:
        """Every thread of the worker's tree with the CPU time it has used (``tree_thread_cpu``)."""
        return tree_thread_cpu(self.proc.pid, self._cgroup)

    def harness_pid(self) -> int | None:
        """The host pid of the process running ``argv`` (under a sandbox, bwrap's descendant whose command
        line it is), found from outside; None if there is none. Ask before candidate code runs: later a
        fork could run the same command line."""
        wanted = "\0".join(map(str, self.argv)).encode()
        for pid in self.tree():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0") == wanted:
                    return pid
            except OSError:
                continue
        return None

    def signal_handlers(self) -> dict[int, int]:
        """The signals each process of the worker's tree catches (``caught_signals``), seen from outside."""
        return caught_signals(self.proc.pid, self._cgroup)

    def resume(self) -> None:
        for pid in self._paused | self._early:
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
        self._paused, self._early = set(), set()

    def _death_reason(self) -> str:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._capture.join(timeout=5)
        if self._capture.flooded:
            return f"printed more than {self.limits.output_bytes} bytes of output"
        return describe_returncode(self.proc.returncode)

    def kill(self) -> None:
        kill_group(self.proc)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        for fd in [self._req_w, self._resp_r, *self._pidfds.values()]:
            try:
                os.close(fd)
            except OSError:
                pass
        self._pidfds.clear()
        if self.fds is not None:
            self.fds.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._capture.join(timeout=5)

    def __enter__(self) -> "WorkerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
