import sys
import time

import pytest
from echo_worker import ECHO

from cuda_agent.sandbox import Limits, WorkerCrashed, WorkerForgedReply, WorkerProcess, WorkerTimeout, run_command


def test_run_command_collects_output(tmp_path):
    result = run_command([sys.executable, "-c", "print('hello')"], cwd=tmp_path)
    assert result.ok and result.output.strip() == "hello"


def test_cpu_time_counts_the_process_and_the_children_it_reaped(tmp_path):
    # A compiler driver (nvcc, g++) does its work in children it waits for: they must be counted.
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {spin!r}])\n" + spin
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.ok and result.cpu_s is not None and result.cpu_s >= 0.6
    assert run_command([sys.executable, "-c", "import sys; sys.exit(3)"], cwd=tmp_path).returncode == 3


def test_time_limit_kills_the_whole_group(tmp_path):
    marker = tmp_path / "child-alive"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w').close()\n")
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(grandchild)!r}])\ntime.sleep(60)\n"
    result = run_command([sys.executable, "-c", code], cwd=tmp_path, limits=Limits(timeout_s=1))
    assert result.timed_out and not result.ok and "timed out" in result.describe_failure()
    time.sleep(4)
    assert not marker.exists(), "a grandchild outlived the time limit"


def test_output_cap_keeps_head_and_tail(tmp_path):
    code = "import sys\nsys.stdout.write('START' + 'x' * 5_000_000 + 'END')\nsys.stdout.flush()\nimport time; time.sleep(30)"
    result = run_command([sys.executable, "-c", code], cwd=tmp_path, limits=Limits(output_bytes=100_000, timeout_s=20))
    assert result.output_flooded and not result.timed_out
    assert result.output.startswith("START") and "omitted" in result.output
    assert len(result.output) < 40_000


def test_memory_limit_for_cpu_jobs(tmp_path):
    code = "x = bytearray(2 * 1024**3)"
    result = run_command([sys.executable, "-c", code], cwd=tmp_path, limits=Limits(memory_bytes=512 * 1024**2))
    assert not result.ok and "MemoryError" in result.output




def worker(tmp_path):
    return WorkerProcess(argv=[sys.executable, "-c", ECHO], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})


def test_worker_replies_on_private_pipes(tmp_path):
    with worker(tmp_path) as w:
        assert w.request({"op": "echo", "value": 1}, 10) == {"echo": 1}
        w.send({"op": "echo", "value": 2})
        w.send({"op": "echo", "value": 3})
        assert [w.receive(10), w.receive(10)] == [{"echo": 2}, {"echo": 3}]
    # Output is drained by a thread; only after close is all of it guaranteed to be in.
    assert w.output.count("noise on stdout") == 3


def test_a_reply_without_its_nonce_is_refused(tmp_path):
    forger = ECHO.replace("        msg = json.loads(line)\n",
                          "        msg = json.loads(line)\n        replies.write(b'{\"echo\": 99}\\n')\n")
    with WorkerProcess(argv=[sys.executable, "-c", forger], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}) as w:
        with pytest.raises(WorkerForgedReply, match="does not answer its request"):
            w.request({"op": "echo", "value": 1}, 10)
        assert w.proc.poll() is not None  # killed: nothing it says can be trusted any more


def test_worker_crash_and_timeout(tmp_path):
    with worker(tmp_path) as w:
        with pytest.raises(WorkerCrashed, match="exited with status 7"):
            w.request({"op": "crash"}, 10)
    with worker(tmp_path) as w:
        with pytest.raises(WorkerTimeout, match="no answer within 1 s"):
            w.request({"op": "hang"}, 1)
        assert w.proc.poll() is not None


def _worker_with_a_child(tmp_path) -> WorkerProcess:
    """An echo worker that has started a child in a session of its own."""
    import os

    code = ("import os, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)'])\n"
            + ECHO)
    return WorkerProcess(argv=[sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ))


def _family(worker: WorkerProcess) -> list[int]:
    from cuda_agent.sandbox.proctree import descendants

    assert worker.request({"op": "echo", "value": 1}, 10)["echo"] == 1
    deadline = time.monotonic() + 10
    while len(descendants(worker.proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return descendants(worker.proc.pid)


def test_pause_stops_the_worker_and_its_children_until_resumed(tmp_path):
    """While the baselines are timed, nothing of the candidate's may run: not its process, not a
    child in a session of its own."""
    from cuda_agent.sandbox.proctree import process_state

    with _worker_with_a_child(tmp_path) as worker:
        family = _family(worker)
        assert len(family) >= 2
        assert worker.pause()
        assert all(process_state(pid) in ("T", "t") for pid in family)
        worker.resume()
        assert worker.request({"op": "echo", "value": 2}, 10)["echo"] == 2
        assert all(process_state(pid) not in ("T", "t") for pid in family)


def test_the_processes_a_pause_found_are_stopped_at_once_next_time_and_let_go_with_the_rest(tmp_path):
    """After a GPU region the processes the last pause found are stopped without walking the tree
    (``stop_known``, through pidfds); the pause after it stops them all and waits, and resume lets every one go,
    also where no pause followed (the probe between them failed)."""
    from cuda_agent.sandbox.proctree import process_state

    with _worker_with_a_child(tmp_path) as worker:
        family = _family(worker)
        worker.stop_known()  # nothing found yet: nothing stopped
        time.sleep(0.05)
        assert all(process_state(pid) not in ("T", "t") for pid in family)
        assert worker.pause()
        worker.resume()
        assert worker.request({"op": "echo", "value": 2}, 10)["echo"] == 2
        for then_pause in (True, False):
            worker.stop_known()
            deadline = time.monotonic() + 5
            while not all(process_state(pid) in ("T", "t") for pid in family) and time.monotonic() < deadline:
                time.sleep(0.001)
            assert all(process_state(pid) in ("T", "t") for pid in family)
            if then_pause:
                assert worker.pause()
            worker.resume()
            assert worker.request({"op": "echo", "value": 3}, 10)["echo"] == 3
            assert all(process_state(pid) not in ("T", "t") for pid in family)


def test_every_way_of_finding_a_process_tree_finds_the_same_processes(tmp_path, monkeypatch):
    """The cheap walks (each thread's children list; the members of a job cgroup) find what a scan of every
    process on the host finds: a child in a session of its own, a child started by a thread that is not the
    main one."""
    import os
    import subprocess

    from cuda_agent.sandbox import proctree

    code = ("import os, subprocess, sys, threading, time\n"
            "sleep = [sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(60)']\n"
            "subprocess.Popen(sleep)\n"
            "threading.Thread(target=lambda: subprocess.Popen(sleep), daemon=True).start()\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(proctree.descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        walked = proctree.descendants(proc.pid)
        monkeypatch.setattr(proctree, "_CHILDREN_LISTS", False)
        scanned = proctree.descendants(proc.pid)
        assert len(scanned) == 3 and walked[0] == scanned[0] == proc.pid
        assert sorted(walked) == sorted(scanned)
        # A cgroup's members, read from a directory laid out as cgroup v2 lays it out (here a plain one).
        job = tmp_path / "job"
        (job / "below").mkdir(parents=True)
        (job / "cgroup.procs").write_text(f"{scanned[2]}\n{proc.pid}\n")
        (job / "below" / "cgroup.procs").write_text(f"{scanned[1]}\n")
        grouped = proctree.descendants(proc.pid, job)
        assert grouped[0] == proc.pid and sorted(grouped) == sorted(scanned)
        # A member of the cgroup that is no longer below the tree (its parent gone) is found there.
        (job / "below" / "cgroup.procs").write_text(f"{scanned[1]}\n{os.getpid()}\n")
        assert sorted(proctree.descendants(proc.pid, job)) == sorted(scanned + [os.getpid()])
        monkeypatch.setattr(proctree, "_CHILDREN_LISTS", True)
        assert sorted(proctree.descendants(proc.pid, job)) == sorted(scanned + [os.getpid()])
        (job / "below" / "cgroup.procs").write_text(f"{scanned[1]}\n")
        # A cgroup that does not hold the process (or cannot be read) is not believed: the tree is walked.
        assert sorted(proctree.descendants(proc.pid, tmp_path / "missing")) == sorted(scanned)
    finally:
        for pid in proctree.descendants(proc.pid)[::-1]:
            os.kill(pid, 9)
        proc.wait()


def test_signal_handlers_are_read_from_outside(tmp_path):
    """A handler installed by code in the worker shows in the kernel's record of its process, whichever
    call installed it (Python's signal module here; sigaction or sigset from C alike)."""
    import signal

    code = ("import signal\n"
            + ECHO.replace(
                "        if msg['op'] == 'crash':\n",
                "        if msg['op'] == 'handle':\n            signal.signal(signal.SIGUSR1, lambda *a: None)\n"
                "        if msg['op'] == 'crash':\n"))
    with WorkerProcess(argv=[sys.executable, "-c", code], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}) as w:
        w.request({"op": "echo", "value": 1}, 10)
        before = w.signal_handlers()
        assert w.proc.pid in before
        assert not before[w.proc.pid] & (1 << (signal.SIGUSR1 - 1))
        w.request({"op": "handle", "value": 2}, 10)
        after = w.signal_handlers()
        assert after[w.proc.pid] & ~before[w.proc.pid] == 1 << (signal.SIGUSR1 - 1)


def test_cpu_time_of_each_thread_is_read_from_outside(tmp_path):
    """A thread that existed before and is handed work shows with the CPU time it used, apart from the
    thread that answers the requests (``other_threads_ms``, the evaluator's borrowed-thread check)."""
    from cuda_agent.evaluate.decide import other_threads_ms

    code = ("import threading, time\n"
            "go = threading.Event()\n"
            "def borrowed():\n"
            "    go.wait()\n"
            "    end = time.process_time() + 0.3\n"
            "    while time.process_time() < end: pass\n"
            "    threading.Event().wait()\n"
            "threading.Thread(target=borrowed, daemon=True, name='pool').start()\n"
            + ECHO.replace("        if msg['op'] == 'crash':\n",
                           "        if msg['op'] == 'hand':\n            go.set()\n            time.sleep(1.0)\n"
                           "        if msg['op'] == 'crash':\n"))
    with WorkerProcess(argv=[sys.executable, "-c", code], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}) as w:
        w.request({"op": "echo", "value": 1}, 10)
        before = w.thread_cpu()
        assert w.proc.pid in before and len(before) == 2
        w.request({"op": "hand", "value": 2}, 10)
        main_ms, others = other_threads_ms(before, w.thread_cpu(), w.proc.pid)
    assert main_ms < 150  # it slept
    assert len(others) == 1 and others[0][0] > 150, others
