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
  as lazy binding changes it: to code in a library file (not the candidate's own extension in its job
  directory, not anonymous or deleted memory, not a memfd).

It cannot see a slot pointed at other existing library code (a gadget), or a patch undone before the
read; the outside clock and the records still stand behind it.
"""

from __future__ import annotations

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


def got_slots(mappings: list[Mapping], skip: tuple[str, ...] = ()) -> dict[int, tuple[str, str]]:
    """Address -> (library, symbol) of every GOT slot of the ELF files mapped, except those under ``skip``."""
    bases: dict[str, int] = {}
    for m in mappings:
        if m.offset == 0 and m.path.startswith("/") and m.path not in bases and not m.path.startswith(skip):
            bases[m.path] = m.start
    out: dict[int, tuple[str, str]] = {}
    for path, start in bases.items():
        try:
            stat = os.stat(path)
            first_load, slots = _got_slots(path, stat.st_size, stat.st_mtime_ns)
        except (OSError, struct.error, ValueError, IndexError):
            continue  # not a readable ELF file: nothing of it to check
        base = start - first_load
        for offset, symbol in slots:
            out[base + offset] = (path, symbol)
    return out


def read_words(pid: int, addresses: list[int]) -> dict[int, int]:
    """The 8-byte words at ``addresses`` in ``pid``'s memory, read in runs (GOT slots sit together)."""
    values: dict[int, int] = {}
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        ordered = sorted(addresses)
        i = 0
        while i < len(ordered):
            j = i
            while j + 1 < len(ordered) and ordered[j + 1] - ordered[i] < 1 << 20 and ordered[j + 1] - ordered[j] <= 4096:
                j += 1
            start = ordered[i]
            data = os.pread(fd, ordered[j] + 8 - start, start)
            for address in ordered[i:j + 1]:
                at = address - start
                if at + 8 <= len(data):
                    values[address] = struct.unpack_from("<Q", data, at)[0]
            i = j + 1
    finally:
        os.close(fd)
    return values


def _target(mappings: list[Mapping], address: int) -> Mapping | None:
    for m in mappings:
        if m.start <= address < m.end:
            return m
    return None


def _acceptable(target: Mapping | None, candidate_dirs: tuple[str, ...]) -> bool:
    """Code a lazily bound slot may come to point at: executable, from a library file, not the candidate's."""
    return (target is not None and "x" in target.perms and target.path.startswith("/")
            and not target.path.endswith("(deleted)") and not target.path.startswith(("/memfd:", "/dev/", "/SYSV"))
            and not target.path.startswith(candidate_dirs))


@dataclass
class IntegrityWatch:
    """The harness's native entry points in one candidate process, as first read from outside."""

    pid: int
    candidate_dirs: tuple[str, ...]
    slots: dict[int, str]  # address -> what it is ("method time.perf_counter_ns", ...)
    got: dict[int, tuple[str, str]]
    values: dict[int, int] = field(default_factory=dict)

    @classmethod
    def start(cls, pid: int, method_slots: dict[str, int], candidate_dirs: tuple[str, ...]) -> "IntegrityWatch":
        """Raises OSError where this process may not read the candidate's memory."""
        dirs = tuple(os.path.realpath(d).rstrip("/") + "/" for d in candidate_dirs)
        watch = cls(pid, dirs, {address: name for name, address in method_slots.items()},
                    got_slots(read_maps(pid), dirs))
        watch.values = read_words(pid, [*watch.slots, *watch.got])
        return watch

    def problems(self) -> list[str]:
        """What changed since ``start``, worded for a verdict; empty when nothing did."""
        now = read_words(self.pid, [*self.slots, *self.got])
        found = [f"{name} now calls other code (0x{self.values[a]:x} -> 0x{now.get(a, 0):x})"
                 for a, name in self.slots.items() if a in self.values and now.get(a) != self.values[a]]
        changed = [a for a in self.got if a in self.values and now.get(a) != self.values[a]]
        if changed:
            mappings = read_maps(self.pid)
            for address in changed:
                target = _target(mappings, now.get(address, 0))
                if not _acceptable(target, self.candidate_dirs):
                    library, symbol = self.got[address]
                    where = "unmapped memory" if target is None else (target.path or "anonymous memory")
                    found.append(f"the import slot of {symbol} in {Path(library).name} now points into {where}")
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
