"""A process tree read from outside, through ``/proc`` (or the job's cgroup where it has one): its processes, their
threads and CPU time, the signals they catch, a process's state. The evaluator's watchers and ``WorkerProcess`` look at
a candidate's processes this way, without asking them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def descendants(pid: int, cgroup: Path | None = None) -> list[int]:
    """``pid`` and every process below it (children of children, whatever their session or
    process group: a sandboxed worker runs in a session of its own under bwrap).

    The evaluator asks this around every timed region (the candidate stopped, its signal handlers
    read), so cheap sources are used: each thread's ``children`` list in ``/proc`` and the members of
    ``cgroup`` (the tree's own job cgroup, which a sandboxed process cannot leave) together; one of them
    where the kernel keeps no children lists; a scan of every process on the host only where neither is
    there (tens of ms a call on a host where torch.compile's workers and other evaluations run)."""
    members = _cgroup_members(cgroup) if cgroup is not None else None
    if members is not None and pid not in members:
        members = None  # not this tree's cgroup: not believed
    if _CHILDREN_LISTS:
        found = _walk(pid, _listed_children)
        # Both where both are cheap: a process that left the cgroup is still below its parent, and one whose
        # parent died (re-parented outside the tree) is still in the cgroup.
        seen = set(found)
        return found + [p for p in members or () if p not in seen]
    if members is not None:
        return [pid, *(p for p in members if p != pid)]
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = _read_small(entry.path + "/stat")
        except OSError:
            continue
        parent = int(stat.rsplit(b")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    return _walk(pid, lambda process: children.get(process, []))


def _walk(pid: int, children_of: Callable[[int], list[int]]) -> list[int]:
    """``pid`` and everything below it, by ``children_of``."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children_of(current))
    return found


def _listed_children(pid: int) -> list[int]:
    """``pid``'s children by its threads' ``children`` lists (each thread lists those it started)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    listed: list[int] = []
    for tid in tids:
        try:
            listed.extend(int(c) for c in _read_small(f"/proc/{pid}/task/{tid}/children").split())
        except (OSError, ValueError):
            continue
    return listed


def _read_small(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _cgroup_members(cgroup: Path) -> list[int] | None:
    """Every process in ``cgroup`` and the cgroups below it; None if it cannot be read."""
    members: list[int] = []
    try:
        for directory, _, files in os.walk(cgroup):
            if "cgroup.procs" in files:
                members.extend(int(p) for p in _read_small(os.path.join(directory, "cgroup.procs")).split())
    except (OSError, ValueError):
        return None
    return members or None


# Whether this kernel keeps /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN).
_CHILDREN_LISTS = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def tree_threads(pid: int, cgroup: Path | None = None) -> dict[int, str]:
    """Thread id -> name of every thread of ``pid`` and the processes below it, read from outside
    (``/proc/PID/task``): what the process tree says of itself cannot change this view."""
    return {tid: name for tid, (name, _) in tree_thread_cpu(pid, cgroup).items()}


def tree_thread_cpu(pid: int, cgroup: Path | None = None) -> dict[int, tuple[str, int]]:
    """Thread id -> (name, nanoseconds it has run on a CPU) for every thread of ``pid`` and the processes
    below it, read from outside (``/proc/PID/task/TID/schedstat``; where the kernel keeps no schedstat,
    ``stat``'s user and system ticks)."""
    tick_ns = 10**9 // os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, int]] = {}
    for process in descendants(pid, cgroup):
        try:
            tids = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue
        for tid in tids:
            task = f"/proc/{process}/task/{tid}"
            try:
                name = Path(f"{task}/comm").read_text().strip()
                try:
                    ran = int(Path(f"{task}/schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    fields = Path(f"{task}/stat").read_text().rsplit(")", 1)[1].split()
                    ran = (int(fields[11]) + int(fields[12])) * tick_ns
            except (OSError, ValueError, IndexError):
                continue
            out[int(tid)] = (name, ran)
    return out


def caught_signals(pid: int, cgroup: Path | None = None) -> dict[int, int]:
    """Process id -> the signals it has handlers installed for (``SigCgt`` of ``/proc/PID/status``, bit
    ``n - 1`` for signal ``n``), for ``pid`` and every process below it, read from outside: the
    kernel's record, which code in the process changes only by installing or removing a handler."""
    masks: dict[int, int] = {}
    for process in descendants(pid, cgroup):
        try:
            status = Path(f"/proc/{process}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("SigCgt:"):
                masks[process] = int(line.split()[1], 16)
    return masks


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, T, ...), or None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
