"""A process's memory map read from outside (``/proc/PID/maps``, ``smaps``, ``mem``) and the ELF tables of the files it
maps: the import-table (GOT) slots and symbol definitions of each library, cached per version of the file. The
integrity watch (``guard.integrity``) reads the candidate's process through these."""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_GOT_RELOCATIONS = {62: (6, 7), 183: (1025, 1026)}  # e_machine -> (GLOB_DAT, JUMP_SLOT): x86-64, aarch64
_SHT_RELA, _SHT_DYNSYM = 4, 11


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    perms: str
    offset: int
    path: str
    inode: int = 0
    anonymous_kb: int = 0  # only from read_smaps: pages of it that are no longer the file's


def _mapping(line: str) -> Mapping:
    parts = line.split(None, 5)
    start, end = (int(x, 16) for x in parts[0].split("-"))
    return Mapping(start, end, parts[1], int(parts[2], 16), parts[5].strip() if len(parts) > 5 else "",
                   int(parts[4]))


def read_maps(pid: int) -> list[Mapping]:
    return [_mapping(line) for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]


_HEADER = re.compile(r"[0-9a-f]+-[0-9a-f]+ ")


def read_smaps(pid: int) -> list[Mapping]:
    """``read_maps`` with each mapping's ``Anonymous`` size (a few ms for a CUDA process's ~2,000)."""
    out: list[Mapping] = []
    head: Mapping | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if _HEADER.match(line):
            if head is not None:
                out.append(head)
            head = _mapping(line)
        elif head is not None and line.startswith("Anonymous:"):
            head = replace(head, anonymous_kb=int(line.split()[1]))
    if head is not None:
        out.append(head)
    return out


def code_mappings(mappings: list[Mapping], skip: tuple[str, ...]) -> list[Mapping]:
    """The executable mappings of files (and the vDSO) a watch keeps: not the candidate's own files."""
    return [m for m in mappings if "x" in m.perms and (m.path.startswith("/") or m.path == "[vdso]")
            and not m.path.startswith(skip)]


def elf_sections(f: Any) -> tuple[bytes, list[tuple[int, ...]]] | None:
    """(ELF header, section headers) of an open ELF64 little-endian file; None for anything else."""
    head = f.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    shoff = struct.unpack_from("<Q", head, 40)[0]
    shentsize, shnum = struct.unpack_from("<HH", head, 58)
    f.seek(shoff)
    return head, [struct.unpack_from("<IIQQQQIIQQ", f.read(shentsize)) for _ in range(shnum)]


def load_segments(f: Any, head: bytes) -> list[tuple[int, int, int]]:
    """(flags, vaddr, size in memory) of each loadable segment (``PT_LOAD``) of an open ELF64 file."""
    phoff = struct.unpack_from("<Q", head, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", head, 54)
    f.seek(phoff)
    programs = f.read(phentsize * phnum)
    headers = [struct.unpack_from("<IIQQQQQ", programs, i * phentsize) for i in range(phnum)]
    return [(flags, vaddr, memsz) for kind, flags, _offset, vaddr, _paddr, _filesz, memsz in headers if kind == 1]


def _section(f: Any, sections: list[tuple[int, ...]], index: int) -> bytes:
    _, _, _, _, offset, length, *_ = sections[index]
    f.seek(offset)
    return f.read(length)


def _string(strings: bytes, at: int) -> str:
    return strings[at:strings.index(b"\0", at)].decode(errors="replace")


@functools.lru_cache(maxsize=1024)
def _got_slots(path: str, size: int, mtime_ns: int) -> tuple[int, tuple[tuple[int, str], ...]]:
    """(vaddr of the first loadable segment, page-aligned; ((slot vaddr, symbol), ...)) of an ELF64
    little-endian shared object or executable; (0, ()) for anything else. A ``JUMP_SLOT`` slot's symbol
    is marked with a leading ``*`` (only those are bound lazily). ``size`` and ``mtime_ns`` key the cache."""
    with open(path, "rb") as f:
        elf = elf_sections(f)
        if elf is None:
            return 0, ()
        head, sections = elf
        machine = struct.unpack_from("<H", head, 18)[0]
        if machine not in _GOT_RELOCATIONS:
            return 0, ()
        loads = [vaddr for _flags, vaddr, _size in load_segments(f, head)]
        first_load = (min(loads) & ~0xFFF) if loads else 0
        wanted = _GOT_RELOCATIONS[machine]
        slots: list[tuple[int, str]] = []
        for index, (_name, kind, _flags, _addr, _offset, _size, link, _info, _align, entsize) in enumerate(sections):
            if kind != _SHT_RELA or link >= len(sections) or sections[link][1] != _SHT_DYNSYM:
                continue
            symbols = _section(f, sections, link)
            strings, data = _section(f, sections, sections[link][6]), _section(f, sections, index)
            for i in range(0, len(data) - 23, entsize or 24):
                offset, info = struct.unpack_from("<QQ", data, i)
                if info & 0xFFFFFFFF not in wanted or not info >> 32:
                    continue
                name = _string(strings, struct.unpack_from("<I", symbols, (info >> 32) * 24)[0])
                slots.append((offset, ("*" if info & 0xFFFFFFFF == wanted[1] else "") + name))
        return first_load, tuple(slots)


@functools.lru_cache(maxsize=256)
def symbol_definitions(path: str, size: int, mtime_ns: int) -> dict[str, tuple[tuple[int, bool], ...]]:
    """Symbol -> ((value, indirect), ...) of every function an ELF file's dynamic symbol table defines
    (``STT_FUNC``, or ``STT_GNU_IFUNC``: indirect, its slot gets what its resolver returns). A name can
    be defined more than once, one per symbol version (glibc's ``pthread_cond_timedwait`` of 2.2.5 and
    of 2.3.2), and a slot is bound to the version its library asked for: every one counts."""
    out: dict[str, tuple[tuple[int, bool], ...]] = {}
    with open(path, "rb") as f:
        elf = elf_sections(f)
        if elf is None:
            return out
        sections = elf[1]
        for index, (_name, kind, _flags, _addr, _offset, _size, link, *_) in enumerate(sections):
            if kind != _SHT_DYNSYM or link >= len(sections):
                continue
            symbols, strings = _section(f, sections, index), _section(f, sections, link)
            for at in range(0, len(symbols) - 23, 24):
                name_at, info, _other, defined_in, value = struct.unpack_from("<IBBHQ", symbols, at)
                if defined_in and value and info & 0xF in (2, 10):
                    name = _string(strings, name_at)
                    out[name] = out.get(name, ()) + ((value, info & 0xF == 10),)
    return out


def mapped_libraries(mappings: list[Mapping], skip: tuple[str, ...]) -> list[tuple[int, str]]:
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
    return first_load, tuple(word_runs([offset for offset, _ in ordered])), tuple(o for o, _ in ordered), \
        tuple(n for _, n in ordered)


def per_file(table: Callable[[str, int, int], T], path: str, empty: T) -> T:
    """``table(path, size, mtime_ns)``, cached per version of the file; ``empty`` where it is not a
    readable ELF file (nothing of it to check)."""
    try:
        stat = os.stat(path)
        return table(path, stat.st_size, stat.st_mtime_ns)
    except (OSError, struct.error, ValueError, IndexError):
        return empty


def library_slots(path: str) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...], tuple[str, ...]]:
    return per_file(_library_runs, path, (0, (), (), ()))


def got_slots(mappings: list[Mapping], skip: tuple[str, ...] = ()) -> dict[int, tuple[str, str]]:
    """Address -> (library, symbol) of every GOT slot of the ELF files mapped, except those under ``skip``."""
    out: dict[int, tuple[str, str]] = {}
    for start, path in mapped_libraries(mappings, skip):
        first_load, _runs_of, offsets, symbols = library_slots(path)
        for offset, symbol in zip(offsets, symbols):
            out[start - first_load + offset] = (path, symbol.lstrip("*"))
    return out


def word_runs(addresses: list[int]) -> list[tuple[int, int]]:
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


def mapping_at(mappings: list[Mapping], address: int) -> Mapping | None:
    for m in mappings:
        if m.start <= address < m.end:
            return m
    return None
