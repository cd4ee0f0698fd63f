"""The harness's native entry points, checked from outside the candidate's process (issue 17, class 1).

Native code in the candidate's process can change what the harness's timing reaches without touching
a Python object the in-process snapshot holds: it can point an import-table (GOT) slot of a library
the harness uses (``clock_gettime`` in the interpreter, ``cudaEventElapsedTime`` in torch's CUDA
library) at its own function, or swap the C function behind a builtin (a ``PyMethodDef``'s
``ml_meth``, a builtin's ``m_ml``). Neither is visible from inside once the candidate controls the
process. Both are plain memory, so the evaluator reads them from outside (``/proc/PID/mem``):

* ``native_slots()`` runs in the worker at start-up, before any candidate code, and reports where the
  C function pointers behind the harness's builtins live (addresses are the harness's own facts then);
* ``IntegrityWatch.start`` reads, from outside, those pointers and every GOT slot of every library
  mapped at start-up (relocations ``GLOB_DAT`` and ``JUMP_SLOT`` of its dynamic symbol table);
* ``IntegrityWatch.check`` reads them again. A method slot must not change. A GOT slot may change only
  as lazy binding changes it: to code in a library file the candidate could not have written (not its
  own extension in its job directory, not a file in the sandbox's private /tmp or /dev/shm unless the
  harness had it mapped already, not anonymous or deleted memory, not a memfd).

It cannot see a slot pointed at other existing library code (a gadget), or a patch undone before the
read; the outside clock and the records still stand behind it.
"""

from __future__ import annotations

import bisect
import functools
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_GOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # e_machine -> (GLOB_DAT, JUMP_SLOT): x86-64, aarch64
_SHT_RELA, _SHT_DYNSYM = 4, 11


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    path: str


def read_maps(pid: int) -> list[Mapping]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(None, 5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append(Mapping(start, end, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
    return out


@functools.lru_cache(maxsize=1024)
def _got_slots(path: str, size: int, mtime_ns: int) -> tuple[int, tuple[tuple[int, str], ...]]:
    """(vaddr of the first loadable segment, page-aligned; ((slot vaddr, symbol), ...)) of an ELF64
    little-endian shared object or executable; (0, ()) for anything else. ``size`` and ``mtime_ns`` key
    the cache."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return 0, ()
        machine = struct.unpack_from("<H", head, 18)[0]
        if machine not in _GOT_RELOCATIONS:
            return 0, ()
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        f.seek(phoff)
        programs = f.read(phentsize * phnum)
        loads = [struct.unpack_from("<Q", programs, i * phentsize + 16)[0] for i in range(phnum)
                 if struct.unpack_from("<I", programs, i * phentsize)[0] == 1]
        first_load = (min(loads) & ~0xFFF) if loads else 0
        f.seek(shoff)
        sections = [struct.unpack_from("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]

        def section(index: int) -> bytes:
            _, _, _, _, offset, length, *_ = sections[index]
            f.seek(offset)
            return f.read(length)

        wanted = _GOT_RELOCATIONS[machine]
        slots: list[tuple[int, str]] = []
        for index, (_name, kind, _flags, _addr, _offset, _size, link, _info, _align, entsize) in enumerate(sections):
            if kind != _SHT_RELA or link >= len(sections) or sections[link][1] != _SHT_DYNSYM:
                continue
            symbols, strings, data = section(link), section(sections[link][6]), section(index)
            for i in range(0, len(data) - 23, entsize or 24):
                offset, info = struct.unpack_from("<QQ", data, i)
                if info & 0xFFFFFFFF not in wanted or not info >> 32:
                    continue
                name_at = struct.unpack_from("<I", symbols, (info >> 32) * 24)[0]
                slots.append((offset, strings[name_at:strings.index(b"\0", name_at)].decode(errors="replace")))
        return first_load, tuple(slots)


def _libraries(mappings: list[Mapping], skip: tuple[str, ...]) -> list[tuple[int, str]]:
    """(load base, path) of every ELF file mapped, except those under ``skip``."""
    bases: dict[str, int] = {}
    for m in mappings:
        if m.offset == 0 and m.path.startswith("/") and m.path not in bases and not m.path.startswith(skip):
            bases[m.path] = m.start
    return [(start, path) for path, start in bases.items()]


@functools.lru_cache(maxsize=1024)
def _library_runs(path: str, size: int, mtime_ns: int) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], tuple[str, ...]]:
    """(first load vaddr, runs of its GOT slots, slot offsets sorted, their symbols): per file, once."""
    first_load, slots = _got_slots(path, size, mtime_ns)
    ordered = sorted(slots)
    return first_load, tuple(_runs([offset for offset, _ in ordered])), tuple(o for o, _ in ordered), \
        tuple(n for _, n in ordered)


def _library(path: str) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], tuple[str, ...]]:
    try:
        stat = os.stat(path)
        return _library_runs(path, stat.st_size, stat.st_mtime_ns)
    except (OSError, struct.error, ValueError, IndexError):
        return 0, (), (), ()  # not a readable ELF file: nothing of it to check


def got_slots(mappings: list[Mapping], skip: tuple[str, ...] = ()) -> dict[int, tuple[str, str]]:
    """Address -> (library, symbol) of every GOT slot of the ELF files mapped, except those under ``skip``."""
    out: dict[int, tuple[str, str]] = {}
    for start, path in _libraries(mappings, skip):
        first_load, _runs_of, offsets, symbols = _library(path)
        for offset, symbol in zip(offsets, symbols):
            out[start - first_load + offset] = (path, symbol)
    return out


def _runs(addresses: list[int]) -> list[tuple[int, int]]:
    """[start, end) spans covering ``addresses`` (8-byte words): GOT slots sit together, so a library's
    are a span or a few, read and compared as one."""
    runs: list[tuple[int, int]] = []
    for address in sorted(set(addresses)):
        if runs and address - runs[-1][1] <= 4096 and address + 8 - runs[-1][0] <= 1 << 22:
            runs[-1] = (runs[-1][0], address + 8)
        else:
            runs.append((address, address + 8))
    return runs


def read_runs(pid: int, runs: list[tuple[int, int]]) -> list[bytes]:
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return [os.pread(fd, end - start, start) for start, end in runs]
    finally:
        os.close(fd)


def _target(mappings: list[Mapping], address: int) -> Mapping | None:
    for m in mappings:
        if m.start <= address < m.end:
            return m
    return None


# Where the sandbox lets a candidate write files (its job directory besides): private tmpfs mounts.
_WRITABLE = ("/tmp/", "/dev/shm/", "/run/", "/var/run/")


def _acceptable(target: Mapping | None, candidate_dirs: tuple[str, ...], harness_files: frozenset[str]) -> bool:
    """Code a lazily bound slot may come to point at: executable, from a library file the candidate could
    not have written (mapped before its code ran, or outside every place it can write), never its own."""
    return (target is not None and "x" in target.perms and target.path.startswith("/")
            and not target.path.endswith("(deleted)") and not target.path.startswith(("/memfd:", "/dev/", "/SYSV"))
            and not target.path.startswith(candidate_dirs)
            and (target.path in harness_files or not target.path.startswith(_WRITABLE)))


@dataclass
class IntegrityWatch:
    """The harness's native entry points in one candidate process, as first read from outside."""

    pid: int
    candidate_dirs: tuple[str, ...]
    slots: dict[int, str]  # address -> what it is ("method time.perf_counter_ns", ...)
    libraries: list[tuple[int, str]] = field(default_factory=list)  # (address of offset 0, path)
    harness_files: frozenset[str] = frozenset()  # every file mapped before candidate code
    runs: list[tuple[int, int]] = field(default_factory=list)
    first: list[bytes] = field(default_factory=list)  # the runs' bytes as first read

    @classmethod
    def start(cls, pid: int, method_slots: dict[str, int], candidate_dirs: tuple[str, ...]) -> "IntegrityWatch":
        """Raises OSError where this process may not read the candidate's memory."""
        dirs = tuple(os.path.realpath(d).rstrip("/") + "/" for d in candidate_dirs)
        watch = cls(pid, dirs, {address: name for name, address in method_slots.items()})
        watch.runs = _runs(list(watch.slots))
        mappings = read_maps(pid)
        watch.harness_files = frozenset(m.path for m in mappings if m.path.startswith("/"))
        for start, path in _libraries(mappings, dirs):
            first_load, runs, _, _ = _library(path)
            base = start - first_load
            watch.libraries.append((base, path))
            watch.runs += [(base + a, base + b) for a, b in runs]
        watch.first = read_runs(pid, watch.runs)
        return watch

    def _slot(self, address: int) -> tuple[str, str] | None:
        """(library, symbol) of the GOT slot at ``address``, if it is one."""
        for base, path in self.libraries:
            _, runs, offsets, symbols = _library(path)
            if runs and base + runs[0][0] <= address < base + runs[-1][1]:
                i = bisect.bisect_left(offsets, address - base)
                if i < len(offsets) and offsets[i] == address - base:
                    return path, symbols[i]
        return None

    def problems(self) -> list[str]:
        """What changed since ``start``, worded for a verdict; empty when nothing did. The runs are
        compared whole (a bytes comparison), word by word only where they differ."""
        found: list[str] = []
        mappings: list[Mapping] | None = None
        for (start, _), before, now in zip(self.runs, self.first, read_runs(self.pid, self.runs)):
            if now == before:
                continue
            for at in range(0, min(len(before), len(now)) - 7, 8):
                if now[at:at + 8] == before[at:at + 8]:
                    continue
                address, old, new = start + at, *struct.unpack_from("<Q", before, at), *struct.unpack_from("<Q", now, at)
                if address in self.slots:
                    found.append(f"{self.slots[address]} now calls other code (0x{old:x} -> 0x{new:x})")
                    continue
                slot = self._slot(address)
                if slot is None:
                    continue  # a word between two slots, not a slot
                mappings = mappings if mappings is not None else read_maps(self.pid)
                target = _target(mappings, new)
                if not _acceptable(target, self.candidate_dirs, self.harness_files):
                    where = "unmapped memory" if target is None else (target.path or "anonymous memory")
                    found.append(f"the import slot of {slot[1]} in {Path(slot[0]).name} now points into {where}")
        return found


# -- in the worker, before candidate code -------------------------------------------------------
def harness_native_functions(cuda: bool) -> dict[str, Any]:
    """The C functions the harness's timing reaches: the clocks, and on a GPU the CUDA event methods
    behind ``torch.cuda.Event`` and torch's synchronize."""
    import time

    functions: dict[str, Any] = {f"time.{n}": getattr(time, n) for n in
                                 ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns")}
    if cuda:
        import torch

        base = torch._C._CudaEventBase
        functions |= {f"torch._C._CudaEventBase.{n}": base.__dict__[n] for n in
                      ("record", "elapsed_time", "synchronize", "query") if n in base.__dict__}
        functions["torch._C._cuda_synchronize"] = torch._C._cuda_synchronize
    return functions


def native_slots(functions: dict[str, Any]) -> dict[str, int]:
    """For each C-implemented function in ``functions`` (a builtin: ``PyCFunctionObject``; a method
    descriptor: ``PyMethodDescrObject``), the addresses of its ``PyMethodDef`` pointer and of that
    def's ``ml_meth``: what an evaluator reads from outside to see the C function behind it swapped.
    The layout is checked against each function's own name and skipped where it does not match
    (another interpreter build)."""
    import ctypes

    if getattr(sys, "_is_gil_enabled", lambda: True)() is False or hasattr(sys, "gettotalrefcount"):
        return {}  # free-threaded and debug builds lay objects out differently
    head = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)
    offsets = {"builtin_function_or_method": head, "method_descriptor": head + 3 * ctypes.sizeof(ctypes.c_void_p)}
    out: dict[str, int] = {}
    for name, fn in functions.items():
        at = offsets.get(type(fn).__name__)
        if at is None:
            continue
        field_address = id(fn) + at
        method_def = ctypes.c_void_p.from_address(field_address).value
        if not method_def:
            continue
        ml_name = ctypes.c_char_p.from_address(method_def).value
        if ml_name is None or ml_name.decode(errors="replace") != getattr(fn, "__name__", None):
            continue
        out[f"method {name} (its PyMethodDef)"] = field_address
        out[f"method {name}"] = method_def + ctypes.sizeof(ctypes.c_void_p)
    return out
