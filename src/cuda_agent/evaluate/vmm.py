"""A candidate's GPU memory read by another process, across the sandbox's namespaces (trust v3, class 1).

Under ``expandable_segments`` torch's caching allocator backs its memory with physical allocations of
the driver's virtual memory API (``cuMemCreate``), each a page of a segment (2 or 20 MiB). After each
timed region the candidate's harness exports every allocation its calls' tensors span as a POSIX file
descriptor (``Exporter``, ``cuMemExportToShareableHandle``), after the region's DONE, outside the bracket.
The evaluator relays the descriptors of the allocations that hold the positions it drew to the reference
process (SCM_RIGHTS), which maps them read-only and reads those positions twice, apart, while the
candidate's processes are stopped (``Importer``). Legacy CUDA IPC handles cannot do this: they need one
PID namespace, and each sandbox has its own (measured: ``benchmarks/probes/vmm_share_probe.py``).

Every driver entry point is bound when the object is made: the exporter before any candidate code loads.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import time
from typing import Any

from cuda_agent.evaluate.outside import span_bytes

POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
PROT_READ = 1  # CU_MEM_ACCESS_FLAGS_PROT_READ: the reader cannot write the candidate's memory
PROT_READWRITE = 3  # only to write a region's inputs (``Importer.write``)
MAX_CHUNKS = 8192  # allocations one region may export (a 6 GiB input and output span about 600)

u64 = ctypes.c_uint64


class VmmError(Exception):
    """An allocation could not be exported, imported, mapped or read."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _bind(names: dict[str, list[Any]]) -> dict[str, Any]:
    """The driver's functions, looked up once, each returning its CUresult."""
    driver = ctypes.CDLL("libcuda.so.1")
    bound = {}
    for name, argtypes in names.items():
        function = getattr(driver, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
        bound[name] = function
    return bound


def _check(result: int, what: str) -> None:
    if result != 0:
        raise VmmError(f"{what}: CUresult {result}")


class Exporter:
    """The candidate's side: descriptors of the allocations that back a set of address ranges."""

    def __init__(self) -> None:
        f = _bind({
            "cuMemRetainAllocationHandle": [ctypes.POINTER(u64), ctypes.c_void_p],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64],
            "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, u64],
            "cuMemRelease": [u64],
        })
        self._retain = f["cuMemRetainAllocationHandle"]
        self._range = f["cuMemGetAddressRange_v2"]
        self._export = f["cuMemExportToShareableHandle"]
        self._release = f["cuMemRelease"]
        self._close = os.close
        self._sorted = sorted
        self.known: dict[int, tuple[int, int]] = {}  # base -> (driver handle, size) the evaluator holds
        self.checked: dict[int, int] = {}  # start -> end of each run of allocations looked up since the last region
        self.checked_bases: list[int] = []  # the runs' starts, sorted
        self.pending: tuple[list[tuple[int, int]], list[int]] = ([], [])  # exported before the region, not yet sent
        self.failed: str | None = None
        self._bisect = bisect.bisect_right
        self._insort = bisect.insort

    def check(self, spans: list[tuple[int, int]]) -> None:
        """Before a region (while its inputs are drawn, outside the bracket): look up the allocations ``spans``
        lie in (this region's inputs, the last region's outputs, whose memory the next outputs reuse) and
        export those not exported before; ``finish`` hands them over after the region."""
        try:
            chunks, fds, _ = self._walk(spans)
        except VmmError as exc:
            self.failed = str(exc)
            return
        self.pending[0].extend(chunks)
        self.pending[1].extend(fds)

    def finish(self, spans: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int], int]:
        """After a region: the allocations not exported before (``(base, size)`` each and a descriptor of each:
        the caller sends and closes them), those ``spans`` lie in among them, and how many allocations had to be
        looked up now (the ones ``check`` did not see before the region: its time is the region's)."""
        pending, self.pending = self.pending, ([], [])
        failed, self.failed = self.failed, None
        try:
            if failed is not None:
                raise VmmError(failed)
            chunks, fds, looked_up = self._walk(spans)
        except BaseException:
            for descriptor in pending[1]:
                self._close(descriptor)
            raise
        finally:
            self.checked.clear()
            self.checked_bases.clear()
        return pending[0] + chunks, pending[1] + fds, looked_up

    def take_pending(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What ``check`` exported before the region, handed over now (at READY, where the evaluator writes the
        region's inputs before GO); ``finish`` then sends only what is new after the region."""
        if self.failed is not None:
            raise VmmError(self.failed)
        pending, self.pending = self.pending, ([], [])
        return pending

    def export(self, spans: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int], int]:
        """``check`` and ``finish`` at once."""
        self.check(spans)
        return self.finish([])

    def _walk(self, spans: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int], int]:
        """Torch's allocator reuses its memory from region to region: an allocation exported once stays readable
        through the evaluator's descriptor, and is exported again only where another took its place (the
        driver's handle differs)."""
        chunks: list[tuple[int, int]] = []
        fds: list[int] = []
        looked_up = 0
        handle, base, size, fd = u64(), u64(), ctypes.c_size_t(), ctypes.c_int(-1)
        known, runs, starts = self.known, self.checked, self.checked_bases
        try:
            for start, end in self._sorted(spans):
                at = start
                while at < end:
                    where = self._bisect(starts, at) - 1
                    if where >= 0 and at < runs[starts[where]]:  # looked up since the last region ended
                        at = runs[starts[where]]
                        continue
                    looked_up += 1
                    if looked_up > MAX_CHUNKS:
                        raise VmmError(f"the region's tensors span more than {MAX_CHUNKS} allocations")
                    _check(self._retain(ctypes.byref(handle), ctypes.c_void_p(at)),
                           f"address {at:#x} is not memory of torch's allocator under expandable segments")
                    try:
                        _check(self._range(ctypes.byref(base), ctypes.byref(size), u64(at)), "its address range")
                        if base.value > at or size.value <= 0:
                            raise VmmError(f"address {at:#x}: an empty or misplaced allocation")
                        if known.get(base.value) != (handle.value, size.value):
                            _check(self._export(ctypes.byref(fd), handle, POSIX_FD, u64(0)), "its export")
                            fds.append(fd.value)
                            chunks.append((base.value, size.value))
                            known[base.value] = (handle.value, size.value)
                    finally:
                        self._release(handle)
                    at = base.value + size.value
                    self._add_run(base.value, at)
        except BaseException:
            for descriptor in fds:
                self._close(descriptor)
            for chunk in chunks:
                known.pop(chunk[0], None)
            raise
        return chunks, fds, looked_up

    def _add_run(self, low: int, high: int) -> None:
        """``[low, high)`` looked up: merged with the runs it touches, so that a span over hundreds of adjacent
        allocations is skipped with one lookup (a 6 GiB tensor is 300 of them)."""
        runs, starts = self.checked, self.checked_bases
        where = self._bisect(starts, low) - 1
        if where >= 0 and runs[starts[where]] >= low:  # touches (or overlaps) the run before
            low = starts[where]
            high = max(high, runs.pop(low))
            starts.pop(where)
        where = self._bisect(starts, low)
        while where < len(starts) and starts[where] <= high:  # runs it reaches into
            high = max(high, runs.pop(starts[where]))
            starts.pop(where)
        runs[low] = high
        self._insort(starts, low)

    def forget(self) -> None:
        """The evaluator holds none of this process's allocations any more (a new evaluation's brackets)."""
        self.known.clear()


def spans(described: list[dict[str, Any]], itemsize: dict[str, int]) -> list[tuple[int, int]]:
    """The device address range ``[start, end)`` each described tensor (``outside.describe``) spans
    (torch's strides are never negative)."""
    out = []
    for call in described:
        for pointer, dtype, shape, strides in [*call["o"], *call["in"]]:
            if dtype in itemsize and all(n > 0 for n in shape):  # else the evaluator names what it cannot read
                out.append((pointer, pointer + span_bytes(shape, strides, itemsize[dtype])))
    return out


class Importer:
    """The reader's side (a process the candidate cannot reach, on the same GPU): maps exported
    allocations read-only and reads bytes at offsets into them."""

    def __init__(self, device: int) -> None:
        f = _bind({
            "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemMap": [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64],
            "cuMemSetAccess": [u64, ctypes.c_size_t, ctypes.POINTER(_Access), ctypes.c_size_t],
            "cuMemcpyDtoH_v2": [ctypes.c_void_p, u64, ctypes.c_size_t],
            "cuMemcpyDtoD_v2": [u64, u64, ctypes.c_size_t],
            "cuMemUnmap": [u64, ctypes.c_size_t],
            "cuMemAddressFree": [u64, ctypes.c_size_t],
            "cuMemRelease": [u64],
            "cuCtxSynchronize": [],
        })
        self.f = f
        self.access = _Access(_Location(LOCATION_DEVICE, device), PROT_READ)
        self.write_access = _Access(_Location(LOCATION_DEVICE, device), PROT_READWRITE)

    def write(self, fds: list[int], sizes: list[int], offsets: list[int],
              copies: list[tuple[int, int, int]]) -> None:
        """Map the allocations behind ``fds`` (of ``sizes`` bytes) read-write in one address range, each at its
        ``offsets`` entry (as they lie in the candidate's: a tensor may span several), and copy each ``(source,
        at, nbytes)``: ``nbytes`` from this process's device address ``source`` to ``at`` in that range. The
        copies are done when this returns; the mappings are gone."""
        if len(fds) != len(sizes) or len(sizes) != len(offsets):
            raise VmmError(f"{len(fds)} descriptors for {len(sizes)} allocations at {len(offsets)} offsets")
        covered = sorted(zip(offsets, sizes))
        for (low, size), (high, _) in zip(covered, covered[1:] + [(None, 0)]):
            if low < 0 or size <= 0 or (high is not None and low + size > high):
                raise VmmError("allocations that overlap where they are to be mapped")
        starts = [low for low, _ in covered]
        for _, at, nbytes in copies:  # each within allocations that follow one another without a gap
            where = bisect.bisect_right(starts, at) - 1
            end = at
            if where >= 0 and covered[where][0] + covered[where][1] > at:
                end = covered[where][0] + covered[where][1]
                where += 1
                while end < at + nbytes and where < len(covered) and covered[where][0] == end:
                    end += covered[where][1]
                    where += 1
            if nbytes <= 0 or end < at + nbytes:
                raise VmmError(f"a write of {nbytes} bytes at {at} lies outside the allocations handed over")
        f = self.f
        extent = max(low + size for low, size in covered) if covered else 0
        reserved = u64()
        mapped: list[tuple[int, int, int, bool]] = []  # (address, size, handle, mapped)
        try:
            if extent:
                _check(f["cuMemAddressReserve"](ctypes.byref(reserved), extent, 0, u64(0), u64(0)), "address reserve")
            for fd, size, offset in zip(fds, sizes, offsets):
                handle = u64()
                _check(f["cuMemImportFromShareableHandle"](ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD),
                       "import of an exported allocation")
                entry = [reserved.value + offset, size, handle.value, False]
                mapped.append(entry)  # type: ignore[arg-type]
                _check(f["cuMemMap"](u64(entry[0]), size, 0, handle, u64(0)),
                       f"map of an exported allocation of {size} bytes (is that its size?)")
                entry[3] = True
                _check(f["cuMemSetAccess"](u64(entry[0]), size, ctypes.byref(self.write_access), 1), "write access")
            for source, at, nbytes in copies:
                _check(f["cuMemcpyDtoD_v2"](u64(reserved.value + at), u64(source), nbytes), "write")
            _check(f["cuCtxSynchronize"](), "synchronise")
        finally:
            for address, size, handle, is_mapped in mapped:
                if is_mapped:
                    f["cuMemUnmap"](u64(address), size)
                f["cuMemRelease"](u64(handle))
            if reserved.value:
                f["cuMemAddressFree"](reserved, extent)

    def read(self, fds: list[int], sizes: list[int], reads: list[tuple[int, int, int]],
             apart_s: float) -> tuple[list[bytes], list[int]]:
        """Each read ``(chunk, offset, nbytes)`` of the allocations behind ``fds`` (of ``sizes`` bytes),
        read twice ``apart_s`` apart: the first read's bytes, and the reads whose bytes changed between."""
        if len(fds) != len(sizes):
            raise VmmError(f"{len(fds)} descriptors for {len(sizes)} allocations")
        for chunk, offset, nbytes in reads:
            if not (0 <= chunk < len(sizes)) or offset < 0 or nbytes <= 0 or offset + nbytes > sizes[chunk]:
                raise VmmError(f"a read of {nbytes} bytes at {offset} lies outside allocation {chunk}")
        f = self.f
        mapped: list[tuple[int, int, int, bool]] = []  # (address, size, handle, mapped)
        try:
            for fd, size in zip(fds, sizes):
                handle, address = u64(), u64()
                _check(f["cuMemImportFromShareableHandle"](ctypes.byref(handle), ctypes.c_void_p(fd), POSIX_FD),
                       "import of an exported allocation")
                entry = [0, size, handle.value, False]
                mapped.append(entry)  # type: ignore[arg-type]
                _check(f["cuMemAddressReserve"](ctypes.byref(address), size, 0, u64(0), u64(0)), "address reserve")
                entry[0] = address.value
                _check(f["cuMemMap"](address, size, 0, handle, u64(0)),
                       f"map of an exported allocation of {size} bytes (is that its size?)")
                entry[3] = True
                _check(f["cuMemSetAccess"](address, size, ctypes.byref(self.access), 1), "read access")
            first = self._read_all(mapped, reads)
            time.sleep(apart_s)
            second = self._read_all(mapped, reads)
        finally:
            for address, size, handle, is_mapped in mapped:
                if is_mapped:
                    f["cuMemUnmap"](u64(address), size)
                if address:
                    f["cuMemAddressFree"](u64(address), size)
                f["cuMemRelease"](u64(handle))
        return first, [i for i, (a, b) in enumerate(zip(first, second)) if a != b]

    def _read_all(self, mapped: list[Any], reads: list[tuple[int, int, int]]) -> list[bytes]:
        out = []
        for chunk, offset, nbytes in reads:
            buffer = ctypes.create_string_buffer(nbytes)
            _check(self.f["cuMemcpyDtoH_v2"](buffer, u64(mapped[chunk][0] + offset), nbytes), "read")
            out.append(buffer.raw)
        return out


def start_exporter() -> tuple[Exporter | None, str]:
    """The candidate worker's exporter, tried on a tensor of its own before any candidate code loads; None
    and the reason where this process's memory cannot be exported (the evaluator then falls back to
    records taken in the candidate's process, and says so)."""
    import torch

    if not torch.cuda.is_initialized():
        return None, "CUDA is not started in this process"
    try:
        exporter = Exporter()
        probe = torch.empty(1024, device="cuda")
        chunks, fds, _ = exporter.export(spans([{"o": [[probe.data_ptr(), "float32", [1024], [1]]], "in": []}],
                                               {"float32": 4}))
        exporter.forget()
    except (OSError, AttributeError, VmmError) as exc:
        return None, f"{type(exc).__name__}: {exc} (is PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set?)"
    for fd in fds:
        os.close(fd)
    return exporter, "on"
