"""sandbox.nothreads: once the filter is in, a new thread or process ends the process by SIGSYS (the kernel's
doing, no handler runs), from any thread; everything else still works. Each case runs in a child process."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

PRELUDE = """
import ctypes, os, signal, sys, threading
import torch
torch.ones(1 << 20).sum()  # torch's pool started before the ban, as the worker's warm-up does
from cuda_agent.sandbox.nothreads import forbid_new_tasks
libc = ctypes.CDLL(None, use_errno=True)
signal.signal(signal.SIGSYS, lambda *a: print('handler ran', flush=True))  # must never run
started = threading.Event(); go = threading.Event()
def earlier_thread():  # started before the ban: the filter must reach it too (TSYNC)
    started.set(); go.wait()
    if sys.argv[1] == 'from-earlier-thread':
        threading.Thread(target=lambda: None).start()
earlier = threading.Thread(target=earlier_thread); earlier.start(); started.wait()
print('ban', forbid_new_tasks(), flush=True)
"""

ATTEMPTS = {
    "nothing": "",
    "python-thread": "threading.Thread(target=lambda: None).start()",
    "from-earlier-thread": "",
    "fork": "os.fork()",
    "subprocess": "import subprocess; subprocess.run(['true'])",
    "posix-spawn": "os.posix_spawn('/bin/true', ['true'], {})",
    # pthread_create straight from C, a thread that returns at once (what PyThread_start_new_thread does).
    "pthread": "CB = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p); cb = CB(lambda arg: None); "
               "tid = ctypes.c_ulong(); libc.pthread_create(ctypes.byref(tid), None, cb, None); "
               "libc.pthread_join(tid, None)",
}


def attempt(what: str) -> subprocess.CompletedProcess:
    code = PRELUDE + ATTEMPTS[what] + """
go.set(); earlier.join()
# Ordinary calls still work: files, memory, time, torch's parallel operators on its existing pool.
with open(os.devnull) as f: f.read()
buf = ctypes.create_string_buffer(1 << 20); os.getpid(); os.sched_yield()
# clone3 is answered ENOSYS (no task made), and glibc falls back to clone, which the filter ends.
rc = libc.syscall(435, None, 0); print('clone3', rc, ctypes.get_errno(), flush=True)
torch.ones(1 << 20).sum()
print('survived', flush=True)
"""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-c", code, what], env=env, capture_output=True, text=True, timeout=120)


def test_ordinary_calls_still_work():
    ran = attempt("nothing")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "ban None" in ran.stdout and "survived" in ran.stdout
    assert "clone3 -1 38" in ran.stdout  # ENOSYS
    assert "handler ran" not in ran.stdout


@pytest.mark.parametrize("what", ["python-thread", "from-earlier-thread", "fork", "subprocess", "posix-spawn",
                                  "pthread"])
def test_a_new_thread_or_process_ends_the_process_by_sigsys(what):
    ran = attempt(what)
    assert ran.returncode == -signal.SIGSYS, ran.stdout + ran.stderr
    assert "ban None" in ran.stdout and "survived" not in ran.stdout
    assert "handler ran" not in ran.stdout  # SECCOMP_RET_KILL_PROCESS: no handler is asked
