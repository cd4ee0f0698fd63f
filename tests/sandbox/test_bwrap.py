import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from echo_worker import ECHO

from cuda_agent.sandbox import (
    BwrapSandbox,
    Limits,
    LocalSandbox,
    SandboxUnavailable,
    WorkerProcess,
    make_sandbox,
    run_command,
)
from cuda_agent.sandbox import bwrap as bwrap_module
from cuda_agent.sandbox.process import kill_group

try:
    SANDBOX = BwrapSandbox()
except SandboxUnavailable as exc:
    pytest.skip(f"bwrap sandbox unavailable: {exc}", allow_module_level=True)

PY = sys.executable


def run(tmp_path, code, **kwargs):
    kwargs.setdefault("limits", Limits(timeout_s=60))
    return run_command([PY, "-c", code], cwd=tmp_path, sandbox=SANDBOX, **kwargs)


def test_cpu_time_is_the_job_cgroups_or_unknown(tmp_path):
    # bwrap's outer process never reaps its init, so wait4 sees nothing: only a job cgroup can tell.
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {spin!r}])\n" + spin
    result = run(tmp_path, code)
    assert result.ok
    if SANDBOX.cgroups_available:
        assert result.cpu_s is not None and result.cpu_s >= 0.6
    else:
        assert result.cpu_s is None


def outside_dir():
    """A fresh host directory outside /tmp (the sandbox has its own /tmp)."""
    base = Path.home() if os.access(Path.home(), os.W_OK) else Path(__file__).parent
    return Path(tempfile.mkdtemp(prefix="bwrap-test-", dir=base))


def test_writes_only_to_cwd_and_writable_dirs(tmp_path):
    job, extra = tmp_path / "job", tmp_path / "extra"
    job.mkdir()
    extra.mkdir()
    forbidden = outside_dir()
    try:
        code = f"""
import errno
open('in-cwd.txt', 'w').write('a')
open({str(extra / 'ok.txt')!r}, 'w').write('b')
for path in [{str(forbidden / 'no.txt')!r}, {str(tmp_path / 'sibling.txt')!r}, '/etc/cuda-agent-test']:
    try:
        open(path, 'w').write('c')
    except OSError as e:
        print('denied', path, errno.errorcode[e.errno])
    else:
        print('WROTE', path)
"""
        result = run_command([PY, "-c", code], cwd=job, sandbox=SANDBOX, writable=[extra])
        assert result.ok, result.output
        assert (job / "in-cwd.txt").read_text() == "a"
        assert (extra / "ok.txt").read_text() == "b"
        # Outside the job's read view the directory does not exist at all (ENOENT); in the host view, EROFS.
        assert (f"denied {forbidden / 'no.txt'} ENOENT" in result.output
                or f"denied {forbidden / 'no.txt'} EROFS" in result.output), result.output
        assert "denied /etc/cuda-agent-test EROFS" in result.output
        assert not (forbidden / "no.txt").exists()
        # tmp_path itself is under the host's /tmp, hidden by the sandbox's private /tmp:
        # the write may succeed in there but must not reach the host.
        assert not (tmp_path / "sibling.txt").exists()
    finally:
        shutil.rmtree(forbidden)


def test_the_job_reads_only_its_view_not_the_hosts_files(tmp_path):
    """A file planted in the evaluator's home and in the repository (beside the package, not in it) is not
    there for the job; the job's own readable paths, the interpreter, torch and the compilers are."""
    planted = [outside_dir() / "planted-secret.txt", Path(__file__).resolve().parents[2] / ".planted-secret.txt"]
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "ok.txt").write_text("visible")
    try:
        for path in planted:
            path.write_text("PLANTED-HOST-SECRET")
        code = f"""
for path in {[str(p) for p in planted]!r} + ['/etc/shadow', {str(shown / 'ok.txt')!r}]:
    try:
        print('read', path, open(path).read())
    except OSError as e:
        print('denied', path, type(e).__name__)
import torch, shutil
print('torch', torch.__version__, 'g++', bool(shutil.which('g++')))
"""
        result = run_command([PY, "-c", code], cwd=tmp_path, sandbox=SANDBOX, readable=[shown],
                             limits=Limits(timeout_s=120))
        assert result.ok, result.output
        assert "PLANTED-HOST-SECRET" not in result.output
        for path in planted:
            assert f"denied {path} FileNotFoundError" in result.output, result.output
        assert "denied /etc/shadow FileNotFoundError" in result.output
        assert f"read {shown / 'ok.txt'} visible" in result.output
        assert "g++ True" in result.output
        view = bwrap_module.job_view_paths()
        assert not [p for p in view if p in ("/", "/root", "/home", "/work", "/etc", "/var", "/opt")], view
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        shutil.rmtree(planted[0].parent, ignore_errors=True)


def test_the_host_view_is_the_whole_file_system_read_only(tmp_path):
    sandbox = BwrapSandbox(read_view="host")
    result = run_command(["cat", "/etc/hostname"], cwd=tmp_path, sandbox=sandbox)
    assert result.ok, result.output
    with pytest.raises(ValueError, match="read_view"):
        BwrapSandbox(read_view="everything")


def test_no_network_but_unix_sockets_work(tmp_path):
    code = """
import socket
kinds = [(socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_DGRAM),
         (socket.AF_NETLINK, socket.SOCK_DGRAM), (socket.AF_PACKET, socket.SOCK_RAW)]
for family, kind in kinds:
    try:
        socket.socket(family, kind)
    except PermissionError:
        print('denied', int(family))
    else:
        print('ALLOWED', int(family))
try:
    socket.create_connection(('127.0.0.1', 22), timeout=2)
except OSError as e:
    print('connect failed', e.errno)
a, b = socket.socketpair()
a.sendall(b'ping')
print('pair', b.recv(4).decode())
"""
    result = run(tmp_path, code)
    assert result.ok, result.output
    assert "ALLOWED" not in result.output and result.output.count("denied") == 4
    assert "connect failed 1" in result.output  # EPERM from the seccomp filter
    assert "pair ping" in result.output


def test_host_processes_are_invisible(tmp_path):
    code = """
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print('pids', pids, 'ppid', os.getppid(), 'pid', os.getpid())
"""
    result = run(tmp_path, code)
    assert result.ok, result.output
    # bwrap's init (pid 1) and the job itself: no host process, this test's included.
    assert "pids [1, 2] ppid 1 pid 2" in result.output


def test_unprivileged_and_no_capabilities(tmp_path):
    code = """
import os
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
print('uid', os.getuid(), os.geteuid(), os.getgid())
print('CapEff', int(status['CapEff'], 16), 'CapBnd', int(status['CapBnd'], 16), 'Seccomp', status['Seccomp'].strip())
try:
    open('/proc/sys/kernel/core_pattern', 'w').write('|/bin/false')
except OSError as e:
    print('sysctl denied', e.errno)
"""
    result = run(tmp_path, code)
    assert result.ok, result.output
    assert "uid 65534 65534 65534" in result.output
    assert "CapEff 0 CapBnd 0 Seccomp 2" in result.output
    assert "sysctl denied 30" in result.output  # EROFS: /proc/sys is read-only


def test_own_memory_cannot_be_written_through_proc(tmp_path):
    """/proc/self/mem opened for writing writes through page protections (code pages included): CPU jobs
    get a read-only /proc (the CUDA driver needs it writable: GPU jobs keep it)."""
    code = """
import os
print('reads', len(open('/proc/self/maps').read()) > 0)
try:
    os.open('/proc/self/mem', os.O_RDWR)
    print('opened for writing')
except OSError as e:
    print('refused', e.errno)
"""
    result = run(tmp_path, code)
    assert result.ok, result.output
    assert "reads True" in result.output and "refused 30" in result.output, result.output  # EROFS


def test_nothing_becomes_executable_once_the_code_is_locked(tmp_path):
    """sandbox.nocode inside the sandbox: a page can no longer be made executable, from any thread,
    and writable code cannot be mapped; plain memory, torch and later imports still work."""
    code = """
import ctypes, threading, torch
from cuda_agent.sandbox.nocode import forbid_new_code
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
page = libc.mmap(None, 4096, 3, 0x22, -1, 0)
started = threading.Event(); go = threading.Event(); seen = []
def earlier_thread():  # started before the lock: the filter must reach it too
    started.set(); go.wait()
    seen.append(libc.mprotect(page, 4096, 5)); seen.append(ctypes.get_errno())
t = threading.Thread(target=earlier_thread); t.start(); started.wait()
print('lock', forbid_new_code())
go.set(); t.join()
print('thread', seen)
print('rx', libc.mprotect(page, 4096, 5), ctypes.get_errno())
print('ro', libc.mprotect(page, 4096, 1))
print('rwx', libc.mmap(None, 4096, 7, 0x22, -1, 0) == 2**64 - 1, ctypes.get_errno())
print('torch', float((torch.ones(1000, 1000) @ torch.ones(1000, 1000)).sum()))
import decimal, sqlite3
print('imports ok')
"""
    src = Path(__file__).resolve().parents[2] / "src"
    result = run(tmp_path, code, env=dict(os.environ, PYTHONPATH=str(src)), readable=[src])
    assert result.ok, result.output
    for line in ("lock None", "thread [-1, 13]", "rx -1 13", "ro 0", "rwx True 13", "torch 1000000000.0", "imports ok"):
        assert line in result.output, result.output


def test_denied_syscalls_fail_with_eperm(tmp_path):
    code = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
for name, nr, args in [('unshare', 272, (0x10000000,)), ('ptrace', 101, (0, 0, 0, 0)), ('bpf', 321, (0, 0, 0)),
                       ('clone-newuser', 56, (0x10000000 | 17, 0, 0, 0, 0))]:
    rc = libc.syscall(nr, *args)
    print(name, rc, errno.errorcode.get(ctypes.get_errno()))
pid = os.fork()
if pid == 0:
    os._exit(0)
print('fork ok', os.waitpid(pid, 0)[1])
"""
    result = run(tmp_path, code)
    assert result.ok, result.output
    for name in ("unshare", "ptrace", "bpf", "clone-newuser"):
        assert f"{name} -1 EPERM" in result.output, result.output
    assert "fork ok 0" in result.output


def test_time_limit_kills_the_whole_group(tmp_path):
    marker = tmp_path / "child-alive"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w').close()\n")
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(grandchild)!r}])\ntime.sleep(60)\n"
    result = run(tmp_path, code, limits=Limits(timeout_s=1))
    assert result.timed_out and not result.ok and "timed out" in result.describe_failure()
    time.sleep(2.5)
    assert not marker.exists(), "a grandchild outlived the time limit"


def test_job_survives_the_thread_that_started_it(tmp_path):
    # --die-with-parent fires when the forking *thread* exits; spawns go through one spawner thread.
    started = []
    thread = threading.Thread(
        target=lambda: started.append(
            SANDBOX.spawn([PY, "-c", "import time; time.sleep(30)"], cwd=tmp_path, env={}, limits=Limits(), gpu=False)
        )
    )
    thread.start()
    thread.join()
    time.sleep(0.5)
    (proc,) = started
    try:
        assert proc.poll() is None, "the job died with the thread that spawned it"
    finally:
        kill_group(proc)
        proc.wait()


def test_output_cap(tmp_path):
    code = "import sys, time\nsys.stdout.write('START' + 'x' * 5_000_000 + 'END')\nsys.stdout.flush()\ntime.sleep(30)"
    result = run(tmp_path, code, limits=Limits(output_bytes=100_000, timeout_s=20))
    assert result.output_flooded and not result.timed_out
    assert result.output.startswith("START") and "omitted" in result.output


def test_memory_limit_for_cpu_jobs(tmp_path):
    result = run(tmp_path, "x = bytearray(2 * 1024**3)", limits=Limits(memory_bytes=512 * 1024**2, timeout_s=60))
    assert not result.ok
    if not SANDBOX.cgroups_available:
        assert "MemoryError" in result.output


def test_signal_deaths_are_reported_as_signals(tmp_path):
    result = run(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.returncode == -11 and "SIGSEGV" in result.describe_failure()




def test_worker_round_trip(tmp_path):
    with WorkerProcess(argv=[PY, "-c", ECHO], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, sandbox=SANDBOX) as w:
        assert w.request({"op": "echo", "value": 1}, 20) == {"echo": 1}
        assert w.request({"op": "echo", "value": [2, 3]}, 20) == {"echo": [2, 3]}
    assert w.output.count("noise on stdout") == 2


def test_compiler_and_torch_work(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    build.mkdir()
    (src / "hello.cpp").write_text('#include <cstdio>\nint main() { std::puts("compiled ok"); }\n')
    result = run_command(
        ["sh", "-c", f"g++ -O1 -o {build / 'hello'} hello.cpp && {build / 'hello'}"],
        cwd=src,
        sandbox=SANDBOX,
        writable=[build],
        limits=Limits(timeout_s=60),
    )
    assert result.ok and "compiled ok" in result.output, result.output
    package = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, PYTHONPATH=str(package))
    code = "import torch, cuda_agent\nprint('sum', torch.ones(3).sum().item())"
    # The checkout may itself live under /tmp, which is private in the sandbox.
    result = run(tmp_path, code, env=env, readable=[package])
    assert result.ok and "sum 3.0" in result.output, result.output


def test_gpu_nodes_only_for_gpu_jobs(tmp_path, monkeypatch):
    # No GPU here: stand in /dev/kvm (or /dev/fuse) for /dev/nvidia0 to check the plumbing.
    node = next((n for n in ("/dev/kvm", "/dev/fuse", "/dev/loop-control") if os.path.exists(n)), None)
    if node is None:
        pytest.skip("no spare device node to stand in for a GPU")
    monkeypatch.setattr(bwrap_module.glob, "glob", lambda pattern: [node] if pattern == "/dev/nvidia*" else [])
    assert not any("nvidia" in arg or arg == node for arg in SANDBOX.bwrap_argv(["true"], cwd=tmp_path, gpu=False))
    code = f"import os\nprint('present', os.path.exists({node!r}))"
    assert "present False" in run(tmp_path, code, gpu=False).output
    assert "present True" in run(tmp_path, code, gpu=True).output


def test_cgroup_settings_are_written(tmp_path, monkeypatch):
    fake = tmp_path / "cgroup"
    fake.mkdir()
    sandbox = BwrapSandbox(cgroup_parent=fake, max_pids=77)
    assert sandbox.cgroups_available
    # A plain directory stands in for cgroupfs: the job writes its pid spec into cgroup.procs.
    original = Path.mkdir

    def mkdir_with_files(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.parent == fake:
            for name in ("cgroup.procs", "memory.max", "pids.max", "memory.oom.group", "memory.swap.max"):
                (self / name).touch()

    monkeypatch.setattr(Path, "mkdir", mkdir_with_files)
    result = run_command([PY, "-c", "pass"], cwd=tmp_path, sandbox=sandbox, limits=Limits(memory_bytes=1 << 30))
    monkeypatch.undo()
    assert result.ok, result.output
    (job,) = fake.iterdir()
    assert (job / "memory.max").read_text() == str(1 << 30)
    assert (job / "pids.max").read_text() == "77"
    assert (job / "memory.swap.max").read_text() == "0"
    assert (job / "cgroup.procs").read_text() == "0"


def test_make_sandbox():
    assert isinstance(make_sandbox("bwrap"), BwrapSandbox)
    assert isinstance(make_sandbox("auto"), BwrapSandbox)
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        assert isinstance(make_sandbox("none"), LocalSandbox)
    with pytest.raises(ValueError, match="auto, bwrap, none"):
        make_sandbox("bogus")
