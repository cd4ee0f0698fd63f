"""No new thread or process in a candidate's process once its code starts to load: the kernel ends it.

Threads the candidate's code starts are otherwise found from outside, by comparing the thread lists
of its process tree before and after (``evaluate.watchers.NewThreads``). A thread that has exited by the
time the lists are read is never seen, and one started through ``PyThread_start_new_thread``,
``pthread_create`` or ``std::thread`` can finish a timed call's work just after its region ended and
exit at once. So a third seccomp filter (after the sandbox's own and ``sandbox.nocode``'s), installed
by the candidate worker once the harness's own threads are all running and before the candidate's
code is imported (its static constructors included), makes the kernel end the process
(``SECCOMP_RET_KILL_PROCESS``, the process dies by ``SIGSYS``) on:

* ``clone``, whatever its flags: with ``CLONE_THREAD`` it makes a thread, without it a process;
* ``fork`` and ``vfork`` (x86-64 only: AArch64 has neither);

and answers ``clone3`` with ``ENOSYS``: its flags lie in memory a filter cannot read, and glibc, told
the call does not exist, falls back to ``clone``, which is ended as above. No handler can catch the
kill, no thread of the process escapes it (``TSYNC`` puts the filter on every thread, torch's pool
and the CUDA runtime's included) and no process can ever remove a filter. ``evaluate.protocol.channel`` turns
such a death into a ``thread`` failure.

libseccomp (through ``pyseccomp``, as the other two filters) writes the program: it checks the
architecture of every call (a call of another ABI, i386 or x32 on x86-64, where ``clone`` has another
number, also ends the process) and knows each architecture's syscall numbers. It is installed on
x86-64 and AArch64, the two the harness runs on; elsewhere it is not, and the result's notes say why.

What this leaves: threads and processes the harness started before the candidate's code, which its code
can hand work to (``evaluate.watchers.BorrowedThreads`` measures their CPU time); work a kernel does
for the process without a new task of it (``io_uring``'s workers: the sandbox's filter refuses
``io_uring_setup``).
"""

from __future__ import annotations

import errno
import resource

from cuda_agent.sandbox.nocode import seccomp_bindings

BAN_THREADS_ENV = "CUDA_AGENT_BAN_THREADS"  # set by the evaluator for candidate workers

# Where the filter is installed: the architectures it was written and tested for.
ARCHES = ("X86_64", "AARCH64")


def forbid_new_tasks() -> str | None:
    """Install the filter in this process (every thread). None once it is in force, else why not."""
    seccomp, missing = seccomp_bindings()
    if missing:
        return missing
    try:
        native = seccomp.system_arch()
        known = {int(getattr(seccomp.Arch, name)): name for name in ARCHES}
        if native not in known:
            return (f"the system's architecture (audit arch {native:#x}) is not one the filter was written for "
                    f"({', '.join(ARCHES)})")
        program = seccomp.SyscallFilter(seccomp.ALLOW)
        program.set_attr(seccomp.Attr.CTL_TSYNC, 1)
        # A call of another ABI (i386's int 0x80, x32) could make a thread under a number this filter
        # does not know: the process ends on any of them.
        program.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
        for name in ("clone", "fork", "vfork"):
            try:
                program.add_rule(seccomp.KILL_PROCESS, name)
            except OSError:  # not a syscall on this architecture (fork and vfork on AArch64)
                pass
        program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        # The kernel dumps core on SIGSYS: no core file (on a GPU host, of a process of many GiB) is written
        # for a process it ends. The hard limit too, so the candidate's code cannot raise it again.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        program.load()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"the filter could not be installed: {exc}"
    return None
