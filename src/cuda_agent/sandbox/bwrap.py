"""A bubblewrap sandbox for untrusted candidate code (compiles, workers, benchmarks).

``BwrapSandbox.spawn`` starts ``bwrap`` (Debian package ``bubblewrap``) in a new
process group; bwrap then runs the job with

* a read-only view of the host root (``--ro-bind / /``), a fresh ``/dev`` and
  ``/proc`` (own pid namespace: no host process is visible), private tmpfs on
  ``/tmp``, ``/dev/shm`` and ``/run`` (the latter hides host unix sockets such as
  the D-Bus system bus), and read-write binds of ``cwd`` and of each
  ``writable`` directory only, with the ``read_only`` paths inside them bound
  read-only again on top;
* every namespace unshared (``--unshare-all``: no network at all), no further
  user namespaces (``--disable-userns``), ``--cap-drop ALL``, ``--new-session``
  (no TIOCSTI into a terminal) and ``--die-with-parent``;
* uid/gid 65534 (nobody) inside. When the evaluator runs as root (CI and the GPU
  machines), bwrap runs privileged and maps uid 65534 inside to the *caller's*
  uid outside, i.e. to root. That is safe only because the process has no
  capabilities in any namespace and every host file system it can reach is
  mounted read-only. Kernel interfaces that check the uid instead of a
  capability are therefore remounted read-only explicitly: ``/proc/sys`` (bwrap
  leaves it writable, and a job could otherwise set ``kernel.core_pattern``),
  ``/proc/sysrq-trigger`` and the other global ``/proc`` directories
  (``_PROC_READ_ONLY``), and for CPU jobs ``/proc`` itself (``/proc/self/mem`` writes through page
  protections; the CUDA driver does not start without a writable ``/proc``). Files the job creates in ``cwd`` are owned by the
  caller's uid outside, which keeps clean-up simple.
* a seccomp filter (``DENIED_SYSCALLS`` and the socket/clone rules below),
  built with PyPI ``pyseccomp`` over ``libseccomp.so.2``;
* with ``gpu=True`` only, the ``/dev/nvidia*`` nodes (and ``/dev/nvidia-caps``)
  bound with ``--dev-bind``; ``/proc/driver/nvidia`` is part of the read-only
  ``/proc/driver`` bind;
* when cgroup v2 has the ``memory`` and ``pids`` controllers delegated to the
  evaluator's cgroup, a child cgroup per job with ``memory.max``
  (``limits.memory_bytes``, GPU jobs included), ``memory.swap.max = 0``,
  ``memory.oom.group = 1`` and ``pids.max``. The bwrap process moves itself in
  before ``exec``, so everything in the sandbox is accounted there. Otherwise
  ``cgroups_available`` is False (``cgroup_note`` says why) and CPU jobs get
  ``RLIMIT_AS`` as with ``LocalSandbox``. RLIMIT_AS is never used for GPU jobs:
  it breaks CUDA start-up.

``--die-with-parent`` uses ``PR_SET_PDEATHSIG``, which fires when the *thread*
that forked bwrap exits, not the process. All bwrap processes are therefore
forked by one long-lived spawner thread, so a worker started from a short-lived
thread survives that thread and still dies with the evaluator process.

Killing the process group (``kill_group``) kills the outer bwrap; its child, pid
1 of the sandbox's pid namespace, then gets SIGKILL and the kernel kills every
process in the namespace, so no grandchild survives a time limit.
"""

from __future__ import annotations

import errno
import functools
import glob
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cuda_agent.sandbox.process import Limits

logger = logging.getLogger(__name__)

SANDBOX_UID = 65534
SANDBOX_GID = 65534

# Syscalls that fail with EPERM inside the sandbox. None of them is needed to
# compile (gcc, nvcc) or to run Python, torch or CUDA; each one either reaches
# other processes (ptrace, process_vm_*, pidfd_getfd, kcmp, process_madvise),
# changes the mount/namespace setup the sandbox relies on (mount and the new
# mount API, pivot_root, chroot, unshare, setns), bypasses the socket filter
# (io_uring can create and connect sockets without the socket syscall), is a
# large kernel attack surface for no use here (bpf, perf_event_open, keyrings,
# userfaultfd, file handles), or changes machine-wide state (modules, kexec,
# swap, reboot, clocks, quotas, accounting, port I/O, kernel log).
DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "process_madvise",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "keyctl",
    "add_key",
    "request_key",
    "swapon",
    "swapoff",
    "reboot",
    "iopl",
    "ioperm",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "quotactl",
    "acct",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "clock_adjtime",
    "syslog",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)
# Besides the list: socket() fails with EPERM for every address family except
# AF_UNIX (no network even if a namespace leaked; socketpair is untouched),
# clone() fails with EPERM when asked for a new namespace, and clone3() fails
# with ENOSYS because seccomp cannot read its flags (glibc, and so threads and
# fork, fall back to clone(); Docker and Flatpak do the same).
_CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

# Global (not per-process) /proc entries, bound read-only over the fresh /proc.
# Writes to /proc/sys are checked against uid 0, which the sandbox's uid maps
# to when the evaluator runs as root; the rest is belt and braces.
_PROC_READ_ONLY = (
    "sys",
    "sysrq-trigger",
    "acpi",
    "bus",
    "driver",
    "fs",
    "irq",
    "scsi",
    "sysvipc",
    "tty",
    "mtrr",
    "pressure",
)

DEFAULT_MAX_PIDS = 2048  # threads count too: torch starts one per core
DEFAULT_TMPFS_BYTES = 4 * 1024**3  # /tmp and /dev/shm each; charged to the job's memory cgroup


_PRIVATE_MOUNTS = ("/tmp", "/dev/shm", "/run", "/var/run")
READ_VIEWS = ("job", "host")
READ_VIEW_ENV = "CUDA_AGENT_SANDBOX_VIEW"


def _private_interpreter_paths() -> list[str]:
    """This interpreter's prefixes that a private mount would hide inside the sandbox."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return sorted(p for p in paths if any(p == m or p.startswith(m + "/") for m in _PRIVATE_MOUNTS))


# The job's read view (``read_view="job"``): what a compiler, a Python worker with torch, the CUDA
# toolchain and the agent's shell need, and nothing else of the host. The host's other directories (the
# evaluator's home and its credentials, other jobs, the cache, the repository, /var, /opt, /srv, /mnt)
# are not mounted at all. The caller adds each job's own paths (cwd, ``writable``, ``readable``).
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 "/sys")  # /sys: CUDA's device topology, torch's CPU detection (read-only, as before)
# Files and directories of /etc a job reads: users and groups (uid lookups), the loader's cache, locale
# and time zone data, compiler alternatives, the shell's start-up files, GPU vendor files. Not /etc as a
# whole: shadow files, keys and service configurations live there too.
_ETC_ENTRIES = ("passwd", "group", "nsswitch.conf", "hosts", "host.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                "localtime", "timezone", "alternatives", "os-release", "lsb-release", "debian_version", "mime.types",
                "locale.alias", "locale.conf", "default/locale", "bash.bashrc", "profile", "profile.d", "inputrc",
                "terminfo", "magic", "magic.mime", "nvidia", "OpenCL", "vulkan", "glvnd", "gprofng.rc")


def job_view_paths() -> list[str]:
    """The host paths every job of ``read_view="job"`` may read, besides its own: ``_SYSTEM_PATHS``,
    ``_ETC_ENTRIES``, the running interpreter (its prefixes, the directories of its site-packages, so
    torch and the CUDA wheels), this package, and the toolchain (the CUDA toolkit, the C++ compiler,
    Nsight Compute) wherever it is installed."""
    from cuda_agent.paths import PACKAGE_ROOT

    paths = [*_SYSTEM_PATHS, *(f"/etc/{e}" for e in _ETC_ENTRIES), *glob.glob("/etc/python3*")]
    paths += [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)]
    paths += [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)]
    paths.append(str(PACKAGE_ROOT))
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for tool in ("nvcc", "g++", "c++", "ncu", os.environ.get("CXX"), os.environ.get("CUDA_AGENT_NCU")):
        found = shutil.which(tool) if tool else None
        if found:
            real = os.path.realpath(found)
            homes.append(os.path.dirname(real))
            if os.path.basename(os.path.dirname(real)) == "bin":
                homes.append(os.path.dirname(os.path.dirname(real)))  # the toolkit's prefix (include/, lib64/)
    paths += [h for h in homes if h]
    return _existing_tops(paths)


def _existing_tops(paths: Sequence[str]) -> list[str]:
    """Each existing path once, as itself and (where a link) as its target; a path inside another
    listed one is left out (the outer bind shows it), so binds never hide each other."""
    found: list[str] = []
    for path in paths:
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.lexists(candidate) and candidate not in found:
                found.append(candidate)
    def inside(p: str, q: str) -> bool:
        return p != q and p.startswith(q.rstrip("/") + "/") and not os.path.islink(q)
    return sorted(p for p in found if not any(inside(p, q) for q in found))


class SandboxUnavailable(RuntimeError):
    """The requested sandbox cannot run on this machine; the message names the fix."""


class _BwrapPopen(subprocess.Popen):
    """bwrap reports a child killed by signal N as exit status 128 + N; report it as -N
    like a plain child, so ``describe_returncode`` still says e.g. "killed by SIGKILL"."""

    cgroup: Path | None = None  # the job's own cgroup, if any (run_command reads its CPU time there)

    def _handle_exitstatus(self, *args, **kwargs):  # type: ignore[override]
        super()._handle_exitstatus(*args, **kwargs)  # type: ignore[misc]
        code = self.returncode
        if code is not None and 128 < code <= 128 + signal.SIGRTMAX:
            self.returncode = -(code - 128)


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes:
    """The BPF program for ``--seccomp``, built once per process."""
    try:
        import pyseccomp as seccomp
    except ImportError as exc:
        raise SandboxUnavailable(
            f"the bwrap sandbox needs the seccomp bindings: pip install pyseccomp ({exc})"
        ) from exc
    except (OSError, RuntimeError) as exc:  # pyseccomp raises RuntimeError without libseccomp
        raise SandboxUnavailable(
            f"the bwrap sandbox needs libseccomp: apt-get install libseccomp2 ({exc})"
        ) from exc
    deny = seccomp.ERRNO(errno.EPERM)
    program = seccomp.SyscallFilter(seccomp.ALLOW)
    program.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)  # no 32-bit syscall ABI
    for name in DENIED_SYSCALLS:
        try:
            program.add_rule(deny, name)
        except OSError:  # not a syscall on this architecture
            logger.debug("seccomp: %s is not a syscall here", name)
    program.add_rule(deny, "socket", seccomp.Arg(0, seccomp.NE, socket.AF_UNIX))
    for flag in _CLONE_NAMESPACE_FLAGS:
        program.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


def _bwrap_executable() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap is not installed: apt-get install bubblewrap (or run with sandbox 'none', unsafe)"
        )
    return path


_COMMON_FLAGS = (
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--uid",
    str(SANDBOX_UID),
    "--gid",
    str(SANDBOX_GID),
    "--die-with-parent",
    "--new-session",
    "--cap-drop",
    "ALL",
)


@functools.lru_cache(maxsize=4)
def _check_bwrap(bwrap: str) -> None:
    """Run an empty sandbox once, so a host that forbids user namespaces fails here, clearly."""
    probe = subprocess.run(
        [bwrap, *_COMMON_FLAGS, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if probe.returncode != 0:
        raise SandboxUnavailable(
            f"bwrap is installed but cannot create a sandbox here ({probe.stderr.strip() or probe.returncode}); "
            "it needs user namespaces (sysctl user.max_user_namespaces > 0, and on Ubuntu 24.04 "
            "kernel.apparmor_restrict_unprivileged_userns=0 or running as root)"
        )


def _own_cgroup_v2() -> Path | None:
    """The directory of this process's cgroup in the cgroup v2 hierarchy, if mounted."""
    try:
        own = next(
            line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")
        )
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except (OSError, StopIteration):
        return None
    for line in mounts:
        left, _, right = line.partition(" - ")
        if not right.startswith("cgroup2 "):
            continue
        fields = left.split()
        root, mount_point = fields[3], fields[4].replace("\\040", " ")
        if own == root or own.startswith(root.rstrip("/") + "/"):
            return Path(mount_point) / own[len(root.rstrip("/")) :].lstrip("/")
    return None


CGROUP_ENV = "CUDA_AGENT_CGROUP"


def _probe_cgroups() -> tuple[Path | None, str]:
    """Where to create per-job cgroups, or None and the reason there is none.

    ``$CUDA_AGENT_CGROUP`` names a cgroup an operator delegated to the evaluator;
    otherwise the evaluator's own cgroup is used, which works only where no other
    process shares it (cgroup v2 lets a cgroup that holds processes enable no controllers).
    """
    named = os.environ.get(CGROUP_ENV)
    base = Path(named) if named else _own_cgroup_v2()
    if base is None:
        return None, "no cgroup v2 hierarchy is mounted"
    if named and not (base / "cgroup.controllers").is_file():
        return None, f"${CGROUP_ENV}={named} is not a cgroup v2 directory (create it under /sys/fs/cgroup first)"
    try:
        controllers = set((base / "cgroup.controllers").read_text().split())
        if not {"memory", "pids"} <= controllers:
            return None, (
                f"the cgroup v2 hierarchy at {base} offers {sorted(controllers)}, not memory and pids "
                "(hybrid cgroup v1 host?)"
            )
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= enabled:
            (base / "cgroup.subtree_control").write_text("+memory +pids")
        probe = base / f"cuda-agent-probe-{os.getpid()}"
        probe.mkdir()
        try:
            if not (probe / "memory.max").exists() or not (probe / "pids.max").exists():
                return None, f"child cgroups of {base} get no memory.max / pids.max"
        finally:
            probe.rmdir()
    except OSError as exc:
        return None, (f"cannot create cgroups with memory and pids limits under {base}: {exc}; "
                      f"name a delegated cgroup in ${CGROUP_ENV} (docs/SANDBOX.md)")
    return base, f"per-job cgroups under {base}"


_JOB_NUMBERS = itertools.count()  # one sequence per process: sandboxes share the cgroup parent


@functools.lru_cache(maxsize=1)
def _spawner() -> ThreadPoolExecutor:
    """The one thread that forks every bwrap process (see the module docstring)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="bwrap-spawner")


def _remove_cgroups(paths: list[Path], lock: threading.Lock) -> None:
    with lock:
        for path in list(paths):
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # still has processes: try again next time
                continue
            paths.remove(path)


class BwrapSandbox:
    """Runs each job in a bubblewrap sandbox; see the module docstring for what that means.

    ``max_pids`` and ``tmpfs_bytes`` bound the number of tasks (threads included;
    cgroups only) and the size of each private tmpfs. ``read_view``: ``"job"`` (the default) mounts
    only ``job_view_paths()`` and the job's own paths; ``"host"`` the whole host read-only (the
    view before; for a host where the job view lacks something, with ``$CUDA_AGENT_SANDBOX_VIEW``). ``cgroup_parent`` overrides
    the detection of the cgroup under which per-job cgroups are created (for a
    delegated cgroup); ``use_cgroups=False`` turns cgroups off.
    """

    name = "bwrap"

    def __init__(
        self,
        *,
        max_pids: int = DEFAULT_MAX_PIDS,
        tmpfs_bytes: int = DEFAULT_TMPFS_BYTES,
        use_cgroups: bool = True,
        cgroup_parent: Path | None = None,
        read_view: str | None = None,
    ) -> None:
        self.read_view = read_view or os.environ.get(READ_VIEW_ENV) or "job"
        if self.read_view not in READ_VIEWS:
            raise ValueError(f"unknown read_view {self.read_view!r} (from {READ_VIEW_ENV} or the argument); use "
                             f"{' or '.join(READ_VIEWS)}")
        self.bwrap = _bwrap_executable()
        _check_bwrap(self.bwrap)
        self._seccomp = _seccomp_program()
        self.max_pids = max_pids
        self.tmpfs_bytes = tmpfs_bytes
        if not use_cgroups:
            self._cgroup_parent, self.cgroup_note = None, "cgroups turned off"
        elif cgroup_parent is not None:
            self._cgroup_parent, self.cgroup_note = Path(cgroup_parent), f"per-job cgroups under {cgroup_parent}"
        else:
            self._cgroup_parent, self.cgroup_note = _probe_cgroups()
        self.cgroups_available = self._cgroup_parent is not None
        self._view = job_view_paths() if self.read_view == "job" else []
        self._cgroups: list[Path] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_cgroups, self._cgroups, self._lock)

    def cleanup(self) -> None:
        """Remove the per-job cgroups whose processes are all gone (also done on every spawn)."""
        _remove_cgroups(self._cgroups, self._lock)

    def bwrap_argv(
        self, argv: Sequence[str], *, cwd: Path, gpu: bool, writable: Sequence[Path] = (), seccomp_fd: int | None = None,
        readable: Sequence[Path] = (), read_only: Sequence[Path] = (),
    ) -> list[str]:
        """The full command line for one job."""
        if self.read_view == "host":
            args = [self.bwrap, *_COMMON_FLAGS, "--ro-bind", "/", "/", "--dev", "/dev"]
        else:
            args = [self.bwrap, *_COMMON_FLAGS]
            for path in self._view:
                if os.path.islink(path):
                    args += ["--symlink", os.readlink(path), path]
                else:
                    args += ["--ro-bind", path, path]
            args += ["--dev", "/dev"]
        if gpu:
            for node in sorted(glob.glob("/dev/nvidia*")):
                args += ["--dev-bind", node, node]
        args += ["--proc", "/proc"]
        for entry in _PROC_READ_ONLY:
            args += ["--ro-bind-try", f"/proc/{entry}", f"/proc/{entry}"]
        if not gpu:
            # The process's own entries too: /proc/self/mem opened for writing writes through any page
            # protection (code included). Not for GPU jobs: the CUDA driver does not start with a
            # read-only /proc (cudaGetDeviceCount: error 304); there such a write leaves
            # copy-on-write pages the integrity watch sees (guard.integrity).
            args += ["--remount-ro", "/proc"]
        size = str(self.tmpfs_bytes)
        args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm", "--tmpfs", "/run"]
        if self.read_view == "host" and os.path.isdir("/var/run") and not os.path.islink("/var/run"):
            args += ["--tmpfs", "/var/run"]
        # Read-only binds first: /tmp and /dev/shm are private, so inputs that live
        # there must be bound back; writable binds may sit inside them. The running
        # Python (a virtual environment under /tmp, say) stays visible too.
        for path in dict.fromkeys([*_private_interpreter_paths(), *map(str, readable)]):
            args += ["--ro-bind", path, path]
        for path in (cwd, *writable):
            args += ["--bind", str(path), str(path)]
        # After the writable binds, so these read-only binds cover the paths inside them.
        for path in read_only:
            args += ["--ro-bind", str(path), str(path)]
        if self.read_view == "job":
            args += ["--remount-ro", "/"]  # the root bwrap made holds only mount points: nothing to write there
        args += ["--chdir", str(cwd)]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return [*args, "--", *argv]

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
        cwd = Path(os.path.realpath(cwd))
        dirs = [Path(os.path.realpath(p)) for p in writable]
        shown = [Path(os.path.realpath(p)) for p in readable]
        fixed = [Path(os.path.realpath(p)) for p in read_only]
        for path in (cwd, *dirs):
            if not path.is_dir():
                raise FileNotFoundError(f"sandbox: {path} must be an existing directory")
        for path in fixed:
            if not path.exists():
                raise FileNotFoundError(f"sandbox: read-only path {path} does not exist")
        self.cleanup()

        procs_file, job = None, None
        if self._cgroup_parent is not None:
            job = self._cgroup_parent / f"cuda-agent-{os.getpid()}-{next(_JOB_NUMBERS)}"
            job.mkdir()
            settings = {"pids.max": str(self.max_pids), "memory.oom.group": "1", "memory.swap.max": "0"}
            if limits.memory_bytes:
                settings["memory.max"] = str(limits.memory_bytes)
            try:
                for key, value in settings.items():
                    if key == "memory.swap.max" and not (job / key).exists():
                        continue  # kernel without swap accounting
                    (job / key).write_text(value)
            except OSError:
                _remove_cgroups([job], self._lock)
                raise
            procs_file = str(job / "cgroup.procs")
        # Without a memory cgroup, CPU jobs get an address-space limit instead (never GPU jobs).
        rlimit_as = limits.memory_bytes if (procs_file is None and not gpu) else None
        import resource  # before fork: nothing is imported in the child

        def preexec() -> None:
            if procs_file is not None:
                fd = os.open(procs_file, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            if rlimit_as:
                resource.setrlimit(resource.RLIMIT_AS, (rlimit_as, rlimit_as))

        def start() -> subprocess.Popen:
            seccomp_fd = os.memfd_create("cuda-agent-seccomp", os.MFD_CLOEXEC)
            try:
                os.write(seccomp_fd, self._seccomp)
                os.lseek(seccomp_fd, 0, os.SEEK_SET)
                return _BwrapPopen(
                    self.bwrap_argv(argv, cwd=cwd, gpu=gpu, writable=dirs, seccomp_fd=seccomp_fd, readable=shown,
                                    read_only=fixed),
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(*pass_fds, seccomp_fd),
                    preexec_fn=preexec if (procs_file or rlimit_as) else None,
                )
            finally:
                os.close(seccomp_fd)

        try:
            proc = _spawner().submit(start).result()
        except BaseException:
            if job is not None:
                _remove_cgroups([job], self._lock)
            raise
        if job is not None:
            # Only now: until its process is in it, another spawn's cleanup would remove the empty cgroup.
            with self._lock:
                self._cgroups.append(job)
            proc.cgroup = job
        return proc
