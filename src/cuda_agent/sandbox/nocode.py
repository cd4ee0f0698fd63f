"""Nothing becomes executable once a candidate process's harness has started.

Native code in the candidate's process could otherwise rewrite the code the harness's timing runs
(``clock_gettime`` in libc or the vDSO, ``cudaEventElapsedTime`` in the CUDA runtime) in place:
make the page writable, patch it, make it executable again. A second seccomp filter, installed by the
worker itself after its start-up and before the first request (so before any candidate code, its
static constructors included), refuses with ``EACCES``:

* ``mprotect`` and ``pkey_mprotect`` asking for ``PROT_EXEC``: a page made writable can never be made
  executable again, so patched code cannot run; code that stays executable cannot be made writable
  without losing ``PROT_EXEC`` in the same call;
* ``mmap`` asking for ``PROT_WRITE`` and ``PROT_EXEC`` together (writable code);
* ``shmat`` with ``SHM_EXEC`` (System V memory mapped executable over existing code).

Loading libraries later still works: the dynamic loader maps their segments with ``mmap`` and only
ever takes rights away with ``mprotect``. Filters apply to every thread (``TSYNC``), including the
threads torch and the CUDA runtime started before, and a process can never remove one.

What this leaves (docs/SECURITY.md): a file-backed executable mapping of a patched copy of a library
placed over its code (the integrity watch sees the foreign file while it is there), and writes through
``/proc/self/mem`` (the sandbox mounts ``/proc`` read-only for CPU jobs; on a GPU, where the CUDA
driver needs it writable, the watch sees the copy-on-write pages).
"""

from __future__ import annotations

import errno
from typing import Any

LOCK_CODE_ENV = "CUDA_AGENT_LOCK_CODE"  # set by the evaluator for candidate workers

PROT_WRITE, PROT_EXEC = 0x2, 0x4
SHM_EXEC = 0o100000


def seccomp_bindings() -> tuple[Any, str | None]:
    """``pyseccomp`` and None, or None and why it cannot be had here (the filters of this package need it)."""
    try:
        import pyseccomp
    except ImportError as exc:
        return None, f"no seccomp bindings (pip install pyseccomp): {exc}"
    except (OSError, RuntimeError) as exc:
        return None, f"no libseccomp (apt-get install libseccomp2): {exc}"
    return pyseccomp, None


def forbid_new_code() -> str | None:
    """Install the filter in this process (every thread). None once it is in force, else why not."""
    seccomp, missing = seccomp_bindings()
    if missing:
        return missing
    refuse = seccomp.ERRNO(errno.EACCES)
    try:
        program = seccomp.SyscallFilter(seccomp.ALLOW)
        program.set_attr(seccomp.Attr.CTL_TSYNC, 1)
        for name in ("mprotect", "pkey_mprotect"):
            program.add_rule(refuse, name, seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, PROT_EXEC))
        both = PROT_WRITE | PROT_EXEC
        program.add_rule(refuse, "mmap", seccomp.Arg(2, seccomp.MASKED_EQ, both, both))
        program.add_rule(refuse, "shmat", seccomp.Arg(2, seccomp.MASKED_EQ, SHM_EXEC, SHM_EXEC))
        program.load()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"the filter could not be installed: {exc}"
    return None
