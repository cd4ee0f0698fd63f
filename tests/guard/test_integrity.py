"""The harness's native entry points read from outside a process (guard.integrity), on this test's own
process: /proc/self/mem reads the same memory another process's /proc/PID/mem would."""

import ctypes
import dataclasses
import os
import shutil

import pytest

from cuda_agent.guard.elfmaps import _got_slots, got_slots, read_maps
from cuda_agent.guard.integrity import IntegrityWatch, harness_native_functions, native_slots

libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
PAGE = os.sysconf("SC_PAGE_SIZE")


def write_word(address, value):
    page = address & ~(PAGE - 1)
    assert libc.mprotect(page, PAGE, 3) == 0  # PROT_READ | PROT_WRITE: the attack's first step too
    ctypes.c_void_p.from_address(address).value = value


def test_the_import_slots_of_a_loaded_library_are_found():
    slots = got_slots(read_maps(os.getpid()))
    symbols = {symbol for _library, symbol in slots.values()}
    assert "clock_gettime" in symbols and "malloc" in symbols
    libc_path = next(m.path for m in read_maps(os.getpid()) if "libc.so" in m.path or "libc-" in m.path)
    stat = os.stat(libc_path)
    first_load, own = _got_slots(libc_path, stat.st_size, stat.st_mtime_ns)
    assert own and first_load == 0  # a shared object is linked at 0


def test_the_c_function_behind_a_builtin_is_found_and_checked_against_its_name():
    slots = native_slots(harness_native_functions(cuda=False))
    assert {"method time.perf_counter", "method time.perf_counter (its PyMethodDef)"} <= set(slots)
    # Python functions have no PyMethodDef: nothing to report for them.
    assert native_slots({"a python function": test_the_import_slots_of_a_loaded_library_are_found}) == {}


def test_a_swapped_method_slot_is_seen():
    slots = native_slots(harness_native_functions(cuda=False))
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    assert watch.problems() == []
    address = slots["method time.perf_counter_ns"]
    real = ctypes.c_void_p.from_address(address).value
    other = ctypes.c_void_p.from_address(slots["method time.monotonic_ns"]).value
    ctypes.c_void_p.from_address(address).value = other  # perf_counter_ns now runs monotonic_ns
    try:
        problems = watch.problems()
    finally:
        ctypes.c_void_p.from_address(address).value = real
    assert problems and "time.perf_counter_ns now calls other code" in problems[0]
    assert watch.problems() == []


def test_a_swapped_vectorcall_pointer_is_seen():
    """The interpreter calls a builtin through the object's own vectorcall pointer, the def's function
    only behind it: swapped there, the PyMethodDef and its ml_meth stay as they were."""
    slots = native_slots(harness_native_functions(cuda=False))
    address = slots["method time.perf_counter_ns (its vectorcall)"]
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    real = ctypes.c_void_p.from_address(address).value
    one_argument = ctypes.c_void_p.from_address(id(len) + address - id(__import__("time").perf_counter_ns)).value
    assert one_argument != real  # METH_O's vectorcall, not METH_NOARGS'
    ctypes.c_void_p.from_address(address).value = one_argument
    try:
        problems = watch.problems()
    finally:
        ctypes.c_void_p.from_address(address).value = real
    assert problems == [f"method time.perf_counter_ns (its vectorcall) now calls other code (0x{real:x} -> "
                        f"0x{one_argument:x})"]
    assert watch.problems() == []


def test_a_cpu_allocator_set_through_c10_is_seen():
    """c10::SetCPUAllocator, as native code of a candidate would call it: another allocator (here the
    mobile one, so that this process keeps working) then serves every CPU allocation of the harness."""
    import torch

    from cuda_agent.guard.integrity import ALLOCATOR, allocator_slots

    slots = allocator_slots()
    assert "the CPU allocator (c10's allocator table)" in slots and ALLOCATOR in "the CPU allocator"
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    assert watch.problems() == []
    c10 = ctypes.CDLL(next(m.path for m in read_maps(os.getpid()) if m.path.endswith("/libc10.so")))
    get, mobile, set_ = (getattr(c10, n) for n in ("_ZN3c1015GetCPUAllocatorEv", "_ZN3c1028GetDefaultMobileCPUAllocatorEv",
                                                   "_ZN3c1015SetCPUAllocatorEPNS_9AllocatorEh"))
    get.restype = mobile.restype = ctypes.c_void_p
    set_.argtypes = (ctypes.c_void_p, ctypes.c_uint8)
    real = get()
    set_(mobile(), 255)
    try:
        assert get() != real and torch.ones(4).sum().item() == 4.0
        problems = watch.problems()
    finally:
        set_(real, 255)
    assert problems and "the CPU allocator (c10's allocator table) was replaced" in problems[0]
    assert get() == real and watch.problems() == []


def test_the_cpu_allocators_class_is_watched_its_vtable_pointer_and_each_entry():
    """The allocator object keeps its place in c10's table while its virtual calls go elsewhere: its
    vtable pointer swapped (the object is in libc10's writable data), or an entry of its vtable patched
    in place (the page made writable again). Both are seen; nothing else is reported meanwhile."""
    import torch  # noqa: F401  (libc10 mapped, its allocators registered, when run alone too)

    from cuda_agent.guard.integrity import allocator_slots

    slots = allocator_slots()
    pointer = slots["the CPU allocator's class (its vtable pointer)"]
    entries = [a for n, a in slots.items() if n.startswith("the CPU allocator's virtual function")]
    vtable = ctypes.c_void_p.from_address(pointer).value
    assert len(entries) >= 4 and entries[0] == vtable and entries == [vtable + 8 * i for i in range(len(entries))]
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    assert watch.problems() == []
    # Another class's vtable, for the time of one read (nothing allocates meanwhile).
    ctypes.c_void_p.from_address(pointer).value = vtable + 8
    try:
        problems = watch.problems()
    finally:
        ctypes.c_void_p.from_address(pointer).value = vtable
    assert problems == [f"the CPU allocator's class (its vtable pointer) was replaced (0x{vtable:x} -> 0x{vtable + 8:x})"]
    last = entries[-1]
    real = ctypes.c_void_p.from_address(last).value
    write_word(last, real + 16)
    try:
        problems = watch.problems()
    finally:
        ctypes.c_void_p.from_address(last).value = real
    name = f"the CPU allocator's virtual function {len(entries) - 1} (its vtable)"
    assert problems == [f"{name} was replaced (0x{real:x} -> 0x{real + 16:x})"]
    assert watch.problems() == []


def test_lazy_binding_to_any_version_of_a_symbol_is_lazy_binding():
    """A name defined once per symbol version (glibc's pthread_cond_timedwait of 2.2.5 and 2.3.2, memcpy
    of 2.2.5 and 2.14): a slot lazily bound to whichever version its library asked for is no patch. Only
    the first definition counted once, and the first threading.Event.wait(timeout) in a process then
    read as a patched import slot of libpython."""
    from cuda_agent.guard.elfmaps import mapping_at as _target, symbol_definitions as _definitions

    maps = read_maps(os.getpid())
    libc_path = next(m.path for m in maps if "libc.so" in m.path)
    stat = os.stat(libc_path)
    defined = _definitions(libc_path, stat.st_size, stat.st_mtime_ns)
    name = next((n for n in ("pthread_cond_timedwait", "memcpy", "realpath") if len(defined.get(n, ())) >= 2), None)
    if name is None:
        pytest.skip("this C library defines none of the symbols tried in more than one version")
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    base = next(b for b, path in watch.libraries if path == libc_path)
    for value, indirect in defined[name]:
        if not indirect:
            assert watch._bound("*" + name, base + value, _target(maps, base + value))
    code = next(m for m in maps if m.path == libc_path and "x" in m.perms)
    assert not watch._bound("*" + name, code.start + 1, _target(maps, code.start + 1))


def test_a_read_at_a_random_moment_of_a_block_sees_a_patch_undone_before_the_block_ends():
    """What a candidate round-aware enough to undo its patch in each round's last call leaves: the
    reads after the block see nothing, the one within it does. A read not begun when the block ends
    is not made (the block does not wait for it)."""
    import time

    slots = native_slots(harness_native_functions(cuda=False))
    address = slots["method time.perf_counter_ns"]
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    real = ctypes.c_void_p.from_address(address).value
    other = ctypes.c_void_p.from_address(slots["method time.monotonic_ns"]).value
    with watch.read_sometime(0.05) as found:
        ctypes.c_void_p.from_address(address).value = other
        try:
            time.sleep(0.3)
        finally:
            ctypes.c_void_p.from_address(address).value = real
    assert watch.problems() == []
    assert found == [f"method time.perf_counter_ns now calls other code (0x{real:x} -> 0x{other:x})"]
    began = time.monotonic()
    with watch.read_sometime(3600.0) as found:
        pass
    assert found == [] and time.monotonic() - began < 1.0


def test_the_vdso_pointers_of_the_c_librarys_clocks_are_found_and_a_redirected_one_is_seen():
    from cuda_agent.guard.integrity import vdso_slots

    slots = vdso_slots()
    vdso = next(m for m in read_maps(os.getpid()) if m.path == "[vdso]")
    assert slots and all(vdso.start <= ctypes.c_void_p.from_address(a).value < vdso.end for a in slots.values())
    assert all("ld-linux" in name or "libc.so" in name for name in slots)
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    assert watch.problems() == []
    # The last of them (glibc orders them clock_gettime, gettimeofday, time, getcpu, clock_getres),
    # whatever it is, pointed elsewhere for the time of one read.
    name, address = list(slots.items())[-1]
    real = ctypes.c_void_p.from_address(address).value
    write_word(address, real + 16)
    try:
        problems = watch.problems()
    finally:
        write_word(address, real)
    assert problems == [f"{name} now calls other code (0x{real:x} -> 0x{real + 16:x})"]
    assert watch.problems() == []


def test_an_import_slot_pointed_at_memory_outside_a_library_is_seen_and_lazy_binding_is_not():
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    # abort's slot: nothing calls it while it points elsewhere (a clock's slot could be called by another
    # thread of this process in that window, and jump into the buffer).
    address, (library, _) = next((a, entry) for a, entry in got_slots(read_maps(os.getpid())).items()
                                 if entry[1] == "abort")
    real = ctypes.c_void_p.from_address(address).value
    buffer = ctypes.create_string_buffer(64)  # anonymous heap memory standing in for injected code
    write_word(address, ctypes.addressof(buffer))
    try:
        problems = watch.problems()
        # A slot pointed at code of a library file is what lazy binding does: not reported (the blind spot
        # docs/SECURITY.md names: a gadget in a library).
        write_word(address, ctypes.cast(libc.abort, ctypes.c_void_p).value)
        rebound = watch.problems()
    finally:
        write_word(address, real)
    assert problems and f"import slot of abort in {os.path.basename(library)}" in problems[0]
    assert "heap" in problems[0] or "anonymous" in problems[0]
    assert rebound == []


def test_an_import_slot_pointed_at_a_library_written_to_tmp_after_start_is_seen(tmp_path):
    """A library file the candidate wrote where the sandbox lets it write (its private /tmp) is not a
    library lazy binding could reach: pointing a slot into one is reported, unlike one mapped before."""
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip(f"the test's directory {tmp_path} is not under /tmp")
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    address = next(a for a, entry in got_slots(read_maps(os.getpid())).items() if entry[1] == "abort")
    real = ctypes.c_void_p.from_address(address).value
    source = next(m.path for m in read_maps(os.getpid()) if "libm.so" in m.path or "libm-" in m.path)
    copy = tmp_path / "libcopy.so"
    shutil.copy(source, copy)
    injected = ctypes.CDLL(str(copy))
    write_word(address, ctypes.cast(injected.cos, ctypes.c_void_p).value)
    try:
        problems = watch.problems()
    finally:
        write_word(address, real)
    assert problems and "libcopy.so" in problems[0]


def test_slots_of_the_candidates_own_files_are_not_watched(tmp_path):
    maps = read_maps(os.getpid())
    some_library = next(m.path for m in maps if m.path.endswith(".so") or ".so." in m.path)
    everything = got_slots(maps)
    without = got_slots(maps, (os.path.dirname(some_library) + "/",))
    assert len(without) < len(everything)
    assert all(not library.startswith(os.path.dirname(some_library) + "/") for library, _ in without.values())


def test_a_process_that_cannot_be_read_is_an_oserror():
    with pytest.raises(OSError):
        IntegrityWatch.start(2**22 + 12345, {}, ())


def test_an_import_slot_pointed_at_other_library_code_is_seen():
    """The gadget route: code in a library file, but not the slot's own symbol's definition, which is all
    lazy binding ever writes there."""
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    address = next(a for a, entry in got_slots(read_maps(os.getpid())).items() if entry[1] == "abort")
    real = ctypes.c_void_p.from_address(address).value
    write_word(address, ctypes.cast(libc.exit, ctypes.c_void_p).value)
    try:
        problems = watch.problems()
    finally:
        write_word(address, real)
    assert any("import slot of abort" in p and "elsewhere than its definition" in p for p in problems), problems


def test_lazy_binding_is_told_from_a_redirected_slot():
    """A JUMP_SLOT moved from its PLT stub to its symbol's definition is what the loader does on first
    call; the same slot moved to another function of that library is not."""
    maps = read_maps(os.getpid())
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    libc_path = next(m.path for m in maps if "libc.so" in m.path or "libc-" in m.path)
    target = next(m for m in maps if m.start <= ctypes.cast(libc.abort, ctypes.c_void_p).value < m.end)
    assert watch._bound("*abort", ctypes.cast(libc.abort, ctypes.c_void_p).value, target)
    assert not watch._bound("*abort", ctypes.cast(libc.exit, ctypes.c_void_p).value, target)
    assert not watch._bound("abort", ctypes.cast(libc.abort, ctypes.c_void_p).value, target)  # GLOB_DAT: never
    assert libc_path == target.path


def _library_code(name):
    """(mapping, address of a function) of an executable mapping of the library ``name`` in this process."""
    lib = ctypes.CDLL(name)
    address = ctypes.cast(lib.cos, ctypes.c_void_p).value
    mapping = next(m for m in read_maps(os.getpid()) if m.start <= address < m.end)
    assert "x" in mapping.perms and mapping.path.startswith("/")
    return mapping, address


def test_a_code_page_written_through_proc_mem_is_seen_even_with_its_bytes_put_back():
    """Writing code pages copies them (copy on write): the copy stays anonymous memory in the file's
    mapping whatever the bytes, which smaps counts. The sandbox refuses the write itself (read-only /proc)."""
    mapping, address = _library_code("libm.so.6")
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    assert watch.problems() == []
    try:
        fd = os.open("/proc/self/mem", os.O_RDWR)
    except OSError as exc:
        pytest.skip(f"/proc/self/mem cannot be opened for writing here: {exc}")
    try:
        os.pwrite(fd, os.pread(fd, 1, address), address)  # the same byte: nothing runs differently
    finally:
        os.close(fd)
    problems = watch.problems()
    assert any(f"the code of {os.path.basename(mapping.path)} was written (4 kB" in p for p in problems), problems


def test_a_copy_of_a_library_mapped_over_its_code_is_seen(tmp_path):
    mapping, _ = _library_code("libm.so.6")
    copy = tmp_path / "libm-copy.so"
    shutil.copy(mapping.path, copy)
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    with open(copy, "rb") as f:
        # The same bytes at the same place (PROT_READ|PROT_EXEC, MAP_PRIVATE|MAP_FIXED): only the file differs.
        placed = libc.mmap(mapping.start, PAGE, 5, 0x12, f.fileno(), mapping.offset)
    assert placed == mapping.start
    problems = watch.problems()
    assert any("was replaced by" in p and "libm-copy.so" in p for p in problems), problems


def test_code_made_writable_is_seen():
    mapping, _ = _library_code("libm.so.6")
    watch = IntegrityWatch.start(os.getpid(), {}, ("/nonexistent-job",))
    assert libc.mprotect(mapping.start, PAGE, 7) == 0  # PROT_READ | PROT_WRITE | PROT_EXEC
    try:
        problems = watch.problems()
    finally:
        assert libc.mprotect(mapping.start, PAGE, 5) == 0
    assert any("was made writable (rwxp)" in p for p in problems), problems
    assert watch.problems() == []  # made executable again, never written: the file's pages still


def test_a_librarys_table_of_pointers_to_another_is_found_and_a_redirected_entry_is_seen(tmp_path):
    """The CPU analogue of the CUDA runtime's table of driver entry points (``driver_slots``): a library
    that keeps pointers to libm's functions in its writable data, filled at run time."""
    import subprocess

    from cuda_agent.guard.integrity import _writable_data, driver_slots, entry_point_slots

    source = tmp_path / "table.c"
    source.write_text("#include <math.h>\ndouble (*entry_table[4])(double);\n"
                      "void fill(void) { entry_table[0] = cos; entry_table[1] = sin; }\n")
    library = tmp_path / "libentrytable.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O0", "-o", str(library), str(source), "-lm"], check=True)
    table = ctypes.CDLL(str(library))
    assert entry_point_slots("libentrytable.so", "libm.so", "the table's pointer to") == {}  # not filled yet
    libm = ctypes.CDLL(next(m.path for m in read_maps(os.getpid()) if os.path.basename(m.path).startswith("libm.so")))
    cos, sin = (ctypes.cast(f, ctypes.c_void_p).value for f in (libm.cos, libm.sin))
    # Memory of someone else's right after the library's last pages (on CI's machine a Python arena once,
    # holding pointers to libm's functions) is not the library's data; the table is.
    maps = read_maps(os.getpid())
    last = max((m for m in maps if m.path == str(library)), key=lambda m: m.end)
    neighbour = dataclasses.replace(last, start=last.end, end=last.end + PAGE, perms="rw-p", offset=0, path="")
    maps = sorted([m for m in maps if m.end <= neighbour.start or m.start >= neighbour.end] + [neighbour],
                  key=lambda m: m.start)
    spans = _writable_data(maps, str(library))
    table_at = ctypes.addressof(ctypes.c_void_p.in_dll(table, "entry_table"))
    assert any(start <= table_at < end for start, end in spans)
    assert all(end <= neighbour.start for start, end in spans), spans
    table.fill()
    slots = entry_point_slots("libentrytable.so", "libm.so", "the table's pointer to")
    assert len(slots) == 2 and all(name.startswith("the table's pointer to ") for name in slots)
    first = ctypes.c_void_p.in_dll(table, "entry_table")
    base = ctypes.addressof(first)
    assert sorted(slots.values()) == [base, base + 8]
    assert {ctypes.c_void_p.from_address(a).value for a in slots.values()} == {cos, sin}
    watch = IntegrityWatch.start(os.getpid(), slots, ("/nonexistent-job",))
    table.fill()  # the library's own writes of the same pointers change nothing
    assert watch.problems() == []
    # The first entry pointed at other code in the same library, as a candidate's redirect would be,
    # through plain writable memory: no mprotect.
    name = next(n for n, a in slots.items() if a == base)
    ctypes.c_void_p.from_address(base).value = sin
    try:
        problems = watch.problems()
    finally:
        table.fill()
    assert problems == [f"{name} now calls other code (0x{cos:x} -> 0x{sin:x})"]
    assert watch.problems() == []
    assert driver_slots() == {}  # no CUDA runtime in this process
