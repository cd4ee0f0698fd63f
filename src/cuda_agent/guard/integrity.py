"""The harness's native entry points, checked from outside the candidate's process.

Native code in the candidate's process can change what the harness's timing reaches without touching
a Python object the in-process snapshot holds: it can point an import-table (GOT) slot of a library
the harness uses (``clock_gettime`` in the interpreter, ``cudaEventElapsedTime`` in torch's CUDA
library) at its own function, or swap the C function behind a builtin (a ``PyMethodDef``'s
``ml_meth``, a builtin's ``m_ml``, or the object's own ``vectorcall`` pointer, which the interpreter
calls before either). Neither is visible from inside once the candidate controls the
process. Both are plain memory, so the evaluator reads them from outside (``/proc/PID/mem``):

* ``native_slots()`` runs in the worker at start-up, before any candidate code, and reports where the
  C function pointers behind the harness's builtins live (addresses are the harness's own facts then);
* ``IntegrityWatch.start`` reads, from outside, those pointers and every GOT slot of every library
  mapped at start-up (relocations ``GLOB_DAT`` and ``JUMP_SLOT`` of its dynamic symbol table);
* ``IntegrityWatch.problems`` reads them again (after load, after the checks, after the rounds, and
  once during each timing round at a moment drawn at random, ``read_sometime``: a patch undone in the
  last call of each round is in place for the rest of it). A method slot must not change. A GOT slot may change
  only as lazy binding changes it: a ``GLOB_DAT`` slot never (the loader fills it at load), a
  ``JUMP_SLOT`` slot only to the address of a definition of its own symbol in a library mapped at start
  (for an indirect function, ``STT_GNU_IFUNC``, whatever its resolver chose: code of the defining
  library, or the vDSO), so a slot pointed at other code already in a library (a gadget) is seen too.
  (Binding every slot at start, ``LD_BIND_NOW``, would make any change a verdict too, at the price of
  changing how the harness's process loads; this check needs nothing of the process.)
* The code itself: every executable mapping of a file (and the vDSO) present at start must not be
  replaced by code the candidate could have written, nor made writable, and must hold no more anonymous memory
  (``/proc/PID/smaps``) than at start. Code pages are private file mappings, so any write to one,
  through ``mprotect`` or ``/proc/self/mem``, leaves a copy-on-write page behind even once the bytes
  are put back; a patched copy of a library mapped over its code shows as another file.

The allocators the framework's tensors come from are reached through data pointers of the same kind:
c10's table of allocators in libc10's writable data (and, for the CUDA caching allocator,
``c10::cuda::CUDACachingAllocator::allocator`` in libc10_cuda's), which native code can point at an
allocator of its own (``c10::SetCPUAllocator``) that then sees every allocation the harness makes, its
input draws and record reads included, and so tells checked calls from timed ones; and each allocator
object's class, whose vtable pointer can be swapped for a copied vtable, or whose vtable entries can be
patched in place, with the table untouched. ``allocator_slots()`` finds, before candidate code, the
words that point at each allocator, the object's vtable pointer and its vtable's entries, and the watch
reads them as it reads a method slot: none may change. The C library's clocks are reached the same way:
glibc calls the vDSO's ``clock_gettime`` through a pointer in the loader's read-only data, which native
code can make writable again (only executable mappings are refused) and point at its own function;
``vdso_slots()`` lists every such pointer, and they must not change either. Both backends watch all of
them (on a GPU the measured times are CUDA events', but the harness's host clock and CPU tensors are
there too). On a GPU the CUDA runtime reaches the driver through a table of its own, filled when it
starts and kept in its writable data (``cudaEventElapsedTime`` calls ``cuEventElapsedTime`` through it):
``driver_slots()`` lists every word there that points into the driver's code, and none may change.

The sandbox makes most writes fail (``sandbox/nocode.py``: nothing may become executable after the
harness's start-up; for CPU jobs ``/proc`` is read-only, so ``/proc/self/mem`` cannot be opened for
writing; the CUDA driver does not start with a read-only ``/proc``, so on a GPU such a write is seen
here rather than refused). What is left: a patch in place only for a small share of each round (the
random read sees it with that share's probability), and a data pointer this module does not know (the
driver's own tables, torch's ``c10::cuda::DriverAPI``); the
outside clock and the records still stand behind it.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import os
import secrets
import struct
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from cuda_agent.guard.elfmaps import (
    Mapping, code_mappings, elf_sections, library_slots, load_segments, mapped_libraries, mapping_at, per_file,
    read_maps, read_runs, read_smaps, symbol_definitions, word_runs,
)

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
    code: list[Mapping] = field(default_factory=list)  # executable mappings of files at start
    # Slots lazily bound since start stay changed at every later read: each (address, value) is judged once.
    judged: dict[tuple[int, int], bool] = field(default_factory=dict)

    @classmethod
    def start(cls, pid: int, method_slots: dict[str, int], candidate_dirs: tuple[str, ...]) -> "IntegrityWatch":
        """Raises OSError where this process may not read the candidate's memory."""
        dirs = tuple(os.path.realpath(d).rstrip("/") + "/" for d in candidate_dirs)
        watch = cls(pid, dirs, {address: name for name, address in method_slots.items()})
        watch.runs = word_runs(list(watch.slots))
        mappings = read_smaps(pid)
        watch.code = code_mappings(mappings, dirs)
        watch.harness_files = frozenset(m.path for m in mappings if m.path.startswith("/"))
        for start, path in mapped_libraries(mappings, dirs):
            first_load, runs, _, _ = library_slots(path)
            base = start - first_load
            watch.libraries.append((base, path))
            watch.runs += [(base + a, base + b) for a, b in runs]
        watch.first = read_runs(pid, watch.runs)
        return watch

    def _slot(self, address: int) -> tuple[str, str] | None:
        """(library, symbol) of the GOT slot at ``address``, if it is one."""
        for base, path in self.libraries:
            _, runs, offsets, symbols = library_slots(path)
            if runs and base + runs[0][0] <= address < base + runs[-1][1]:
                i = bisect.bisect_left(offsets, address - base)
                if i < len(offsets) and offsets[i] == address - base:
                    return path, symbols[i]
        return None

    def problems(self, pages: bool = True) -> list[str]:
        """What changed since ``start``, worded for a verdict; empty when nothing did. The runs are
        compared whole (a bytes comparison), word by word only where they differ. ``pages``: also count
        the code's copy-on-write pages (``/proc/PID/smaps``, a few times the cost of ``maps`` in a CUDA
        process; a written page stays counted, so the last check of an evaluation is enough)."""
        mappings = read_smaps(self.pid) if pages else read_maps(self.pid)
        found = self._code_problems(mappings, pages)
        for (start, _), before, now in zip(self.runs, self.first, read_runs(self.pid, self.runs)):
            if now == before:
                continue
            for at in range(0, min(len(before), len(now)) - 7, 8):
                if now[at:at + 8] == before[at:at + 8]:
                    continue
                address, old, new = start + at, *struct.unpack_from("<Q", before, at), *struct.unpack_from("<Q", now, at)
                if address in self.slots:
                    name = self.slots[address]
                    change = "was replaced" if f" {ALLOCATOR}" in name else "now calls other code"
                    found.append(f"{name} {change} (0x{old:x} -> 0x{new:x})")
                    continue
                slot = self._slot(address)
                if slot is None:
                    continue  # a word between two slots, not a slot
                target = mapping_at(mappings, new)
                if (address, new) not in self.judged:
                    self.judged[address, new] = self._bound(slot[1], new, target)
                if not self.judged[address, new]:
                    where = "unmapped memory" if target is None else (target.path or "anonymous memory")
                    found.append(f"the import slot of {slot[1].lstrip('*')} in {Path(slot[0]).name} now points "
                                 f"elsewhere than its definition (0x{new:x}, in {where})")
        return found

    @contextlib.contextmanager
    def read_sometime(self, within_s: float) -> Iterator[list[str]]:
        """One read (``problems``, without the page count) at a moment drawn uniformly over the next
        ``within_s`` seconds, from a thread of this process, while the block runs (the candidate's
        timing round); what it found is in the yielded list once the block is over. A read that has not
        begun when the block ends is not made. Reads after a round see only what the candidate left in
        place when its last call returned: a patch undone in that call (a round's length is learnable)
        escapes them, but is in place for the rest of the round, and a read at a random moment sees it
        with the probability of that share. The target cannot tell it is read."""
        found: list[str] = []
        done = threading.Event()

        def read() -> None:
            if not done.wait(secrets.SystemRandom().uniform(0.0, max(within_s, 0.0))):
                try:
                    found.extend(self.problems(pages=False))
                except OSError:
                    pass  # gone or going: the read after the round decides

        reader = threading.Thread(target=read, name="integrity-read", daemon=True)
        reader.start()
        try:
            yield found
        finally:
            done.set()
            reader.join()

    def _bound(self, symbol: str, new: int, target: Mapping | None) -> bool:
        """Whether lazy binding could have written ``new`` into a slot for ``symbol``: a ``JUMP_SLOT``
        (marked ``*``) pointed at the symbol's definition in a library mapped at start (for an indirect
        function, anywhere in the defining library's code or the vDSO)."""
        if not symbol.startswith("*") or target is None or "x" not in target.perms:
            return False
        if target.path != "[vdso]" and not _acceptable(target, self.candidate_dirs, self.harness_files):
            return False
        for base, path in self.libraries:
            for value, indirect in per_file(symbol_definitions, path, {}).get(symbol[1:], ()):
                if base + value == new or indirect and target.path in (path, "[vdso]"):
                    return True
        return False

    def _code_problems(self, mappings: list[Mapping], pages: bool = True) -> list[str]:
        """Each executable mapping of a file kept at start: not made writable, no page of it written since
        (copy-on-write pages count as anonymous), and no part of it replaced by code the candidate could
        have written. Code unmapped, or its addresses reused by memory that cannot run or by another
        library file, is left alone: a library unloaded and its place reused is no attack."""
        ordered = sorted(mappings, key=lambda m: m.start)
        starts = [m.start for m in ordered]
        found = []
        for kept in self.code:
            name = Path(kept.path).name if kept.path.startswith("/") else kept.path
            written = 0
            for now in ordered[max(0, bisect.bisect_right(starts, kept.start) - 1):bisect.bisect_left(starts, kept.end)]:
                if now.end <= kept.start:
                    continue
                at = max(now.start, kept.start)
                if (now.path, now.inode) == (kept.path, kept.inode) and now.offset - now.start == kept.offset - kept.start:
                    if "w" in now.perms:
                        found.append(f"the code of {name} at 0x{at:x} was made writable ({now.perms})")
                    written += now.anonymous_kb
                elif "x" in now.perms and not _acceptable(now, self.candidate_dirs, self.harness_files):
                    found.append(f"the code of {name} at 0x{at:x} was replaced by {now.path or 'anonymous memory'}")
            if pages and written > kept.anonymous_kb:
                found.append(f"the code of {name} was written ({written - kept.anonymous_kb} kB of its pages no "
                             "longer the file's)")
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
    descriptor: ``PyMethodDescrObject``), the addresses of its ``PyMethodDef`` pointer, of that def's
    ``ml_meth``, and of the object's own ``vectorcall`` pointer (what the interpreter calls first, the
    def's function only through it): what an evaluator reads from outside to see the C function behind
    it swapped. The layout is checked against each function's own name, and the vectorcall pointer
    against the interpreter's code, and skipped where it does not match (another interpreter build)."""
    import ctypes

    if getattr(sys, "_is_gil_enabled", lambda: True)() is False or hasattr(sys, "gettotalrefcount"):
        return {}  # free-threaded and debug builds lay objects out differently
    word = ctypes.sizeof(ctypes.c_void_p)
    head = ctypes.sizeof(ctypes.c_ssize_t) + word
    # (its PyMethodDef pointer, its vectorcall pointer): after m_ml, m_self, m_module, m_weakreflist;
    # after the descriptor's d_type, d_name, d_qualname and d_method.
    offsets = {"builtin_function_or_method": (head, head + 4 * word),
               "method_descriptor": (head + 3 * word, head + 4 * word)}
    code = [(m.start, m.end) for m in read_maps(os.getpid()) if "x" in m.perms and m.path.startswith("/")]
    out: dict[str, int] = {}
    for name, fn in functions.items():
        at = offsets.get(type(fn).__name__)
        if at is None:
            continue
        field_address = id(fn) + at[0]
        method_def = ctypes.c_void_p.from_address(field_address).value
        if not method_def:
            continue
        ml_name = ctypes.c_char_p.from_address(method_def).value
        if ml_name is None or ml_name.decode(errors="replace") != getattr(fn, "__name__", None):
            continue
        out[f"method {name} (its PyMethodDef)"] = field_address
        out[f"method {name}"] = method_def + word
        vectorcall = ctypes.c_void_p.from_address(id(fn) + at[1]).value or 0
        if any(start <= vectorcall < end for start, end in code):
            out[f"method {name} (its vectorcall)"] = id(fn) + at[1]
    return out


ALLOCATOR = "allocator"  # every allocator slot's name says "the <device> allocator"
_GET_ALLOCATOR = "_ZN3c1012GetAllocatorERKNS_10DeviceTypeE"  # c10::GetAllocator(c10::DeviceType const&)
_DEVICE_TYPES = (("CPU", 0, "libc10.so"), ("CUDA", 1, "libc10_cuda.so"))  # c10::DeviceType, where it is kept
# A cap: the walk stops at the vtable's first word that is not code (the CUDA caching allocator's: 64 or more).
_VTABLE_ENTRIES = 128


def _words(spans: list[tuple[int, int]], wanted: Callable[[int], bool]) -> dict[int, int]:
    """Address -> value of the 8-byte words of this process's memory in ``spans`` whose value is ``wanted``."""
    import ctypes

    found = {}
    for start, end in spans:
        data = ctypes.string_at(start, end - start)
        found |= {start + 8 * i: value for i, (value,) in enumerate(struct.iter_unpack("<Q", data[:len(data) // 8 * 8]))
                  if wanted(value)}
    return found


def _writable_data(maps: list[Mapping], library: str) -> list[tuple[int, int]]:
    """A library's writable data: where its writable mappings (and the zero-filled pages after them) lie
    within its file's writable loadable segments. The segments bound the zero-filled part: an unrelated
    anonymous mapping the kernel placed right after a small library is not its data (a Python arena
    holding pointers to libm's functions once made an empty table look filled)."""
    start = next((m.start for m in maps if m.path == library and m.offset == 0), None)
    first_load, segments = per_file(_writable_segments, library, (0, ()))
    if start is None or not segments:
        return [(m.start, m.end) for m in maps if m.path == library and "w" in m.perms]
    spans = []
    for low, high in ((start - first_load + vaddr, start - first_load + vaddr + size) for vaddr, size in segments):
        for m in maps:
            if "w" in m.perms and m.path in (library, "") and m.start < high and low < m.end:
                spans.append((max(m.start, low), min(m.end, high)))
    return spans


@functools.lru_cache(maxsize=256)
def _writable_segments(path: str, size: int, mtime_ns: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(vaddr of the first loadable segment, page-aligned; ((vaddr, size in memory), ...) of each writable
    loadable segment) of an ELF64 little-endian file; (0, ()) for anything else."""
    with open(path, "rb") as f:
        elf = elf_sections(f)
        loads = load_segments(f, elf[0]) if elf is not None else []
    if not loads:
        return 0, ()
    return min(v for _, v, _ in loads) & ~0xFFF, tuple((v, size) for flags, v, size in loads if flags & 2)


def _object_slots(maps: list[Mapping], obj: int, name: str) -> dict[str, int]:
    """The C++ object at ``obj``'s class: its vtable pointer (the object's first word) when it points into a
    library's read-only data, and that vtable's entries while they point at a library's code. Swapping
    the pointer for a copied vtable, or patching an entry of the vtable in place (its page made writable
    again: only executable mappings are refused), sends the object's virtual calls to other code."""
    import ctypes

    def inside(address: int, perms: Callable[[str], bool]) -> bool:
        mapping = mapping_at(maps, address)
        return mapping is not None and mapping.path.startswith("/") and perms(mapping.perms)

    vtable = ctypes.c_void_p.from_address(obj).value or 0
    if not inside(vtable, lambda p: p.startswith("r") and "w" not in p and "x" not in p):
        return {}
    out = {f"{name}'s class (its vtable pointer)": obj}
    for i in range(_VTABLE_ENTRIES):
        if not inside(vtable + 8 * i, lambda p: p.startswith("r")):
            break
        entry = ctypes.c_void_p.from_address(vtable + 8 * i).value or 0
        if not inside(entry, lambda p: "x" in p):
            break
        out[f"{name}'s virtual function {i} (its vtable)"] = vtable + 8 * i
    return out


def allocator_slots(cuda: bool = False) -> dict[str, int]:
    """Where the allocators the framework's tensors come from are reached, in this process: for the CPU
    (and, with ``cuda``, the CUDA caching allocator), what ``c10::GetAllocator`` returns now, found in the
    words that point at it (c10's allocator table in libc10's writable data; for CUDA also
    ``c10::cuda::CUDACachingAllocator::allocator`` in libc10_cuda's), and the object's own class
    (``_object_slots``). A library whose data holds more than a few such words is skipped: nothing then
    says which of them is the one read. Empty where libc10 or the function is not found."""
    import ctypes

    maps = read_maps(os.getpid())
    paths = {Path(m.path).name: m.path for m in maps if m.path.startswith("/")}
    if "libc10.so" not in paths:
        return {}
    try:
        get = getattr(ctypes.CDLL(paths["libc10.so"]), _GET_ALLOCATOR)
    except (OSError, AttributeError):
        return {}
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    out: dict[str, int] = {}
    for device, number, keeper in _DEVICE_TYPES:
        if device == "CUDA" and (not cuda or keeper not in paths):
            continue
        value = get(ctypes.byref(ctypes.c_int8(number)))  # registered when its library loads; null if not
        if not value:
            continue
        name = f"the {device} {ALLOCATOR}"
        keepers = [("libc10.so", "c10's allocator table")] + [(keeper, f"{keeper}'s data")] * (keeper != "libc10.so")
        for library, where in keepers:
            found = _words(_writable_data(maps, paths[library]), lambda word: word == value)
            if len(found) <= 2:
                out |= {f"{name} ({where}{f', pointer {i + 1}' if i else ''})": a for i, a in enumerate(found)}
        out |= _object_slots(maps, value, name)
    return out


def vdso_slots() -> dict[str, int]:
    """The pointers into the vDSO that the C library's clocks call through (glibc keeps them in the
    loader's data, made read-only after relocation: ``GLRO(dl_vdso_clock_gettime64)`` and the like):
    every word of the loader's and libc's read-only data mappings that points into the vDSO. Native code
    can make such a page writable again (only executable mappings are refused) and point
    ``clock_gettime`` at its own function without touching a slot, a method or code."""
    maps = read_maps(os.getpid())
    vdso = next((m for m in maps if m.path == "[vdso]"), None)
    if vdso is None:
        return {}
    out = {}
    for m in maps:
        name = Path(m.path).name
        if not name.startswith(("ld-linux", "libc.so")) or m.perms != "r--p" or m.offset == 0:
            continue
        for address in _words([(m.start, m.end)], lambda word: vdso.start <= word < vdso.end):
            out[f"a pointer into the vDSO in {name}'s read-only data (+0x{address - m.start + m.offset:x})"] = address
    return out


def entry_point_slots(holder: str, target: str, what: str) -> dict[str, int]:
    """The function pointers one library keeps to another's code, in this process: every word of the
    writable data of the library whose file name starts with ``holder`` that points into the code of
    the one whose file name starts with ``target``, named ``what`` and the target's symbol there (or
    its offset). Such a table is how a library reaches another without an import slot: the CUDA
    runtime fills one with the driver's entry points when it starts (``cuGetProcAddress``), and calls
    the driver through it from then on. It sits in ordinary writable memory, so native code can point an
    entry at its own function with no ``mprotect``, no import slot and no code written. Empty where
    either library is not mapped."""
    maps = read_maps(os.getpid())
    holders = {m.path for m in maps if Path(m.path).name.startswith(holder) and m.path.startswith("/")}
    code = [m for m in maps if Path(m.path).name.startswith(target) and "x" in m.perms]
    if len(holders) != 1 or not code:
        return {}
    path = code[0].path
    base = next((m.start for m in maps if m.path == path and m.offset == 0), code[0].start - code[0].offset)
    base -= library_slots(path)[0]
    names: dict[int, str] = {}
    for symbol, values in sorted(per_file(symbol_definitions, path, {}).items(), key=lambda kv: (len(kv[0]), kv[0])):
        for value, _ in values:
            names.setdefault(base + value, symbol)
    out = {}
    pointers = _words(_writable_data(maps, holders.pop()), lambda word: any(m.start <= word < m.end for m in code))
    for address, pointer in pointers.items():
        out[f"{what} {names.get(pointer, f'+0x{pointer - base:x}')} (0x{address:x})"] = address
    return out


def driver_slots() -> dict[str, int]:
    """The CUDA runtime's pointers to the driver's entry points (``entry_point_slots``): the route from
    ``cudaEventElapsedTime`` (what every CUDA event's time comes through) to ``cuEventElapsedTime``
    that neither an import slot nor code lies on. Empty before the runtime has started (the worker
    starts it before it reports its slots: ``worker.warm_up_runtime``)."""
    return entry_point_slots("libcudart.so", "libcuda.so", "the CUDA runtime's pointer to")
