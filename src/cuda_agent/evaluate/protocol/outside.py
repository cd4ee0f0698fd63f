"""Timed outputs read from outside the candidate's process, at positions only the evaluator knows.

The worker describes each call of a timed region (where its output and input tensors live, their
dtypes, shapes and strides) in the region's DONE datagram and keeps them alive until CONT. The
evaluator stops the candidate's process tree, draws which calls to check and at which positions
from a secret that never enters that process, and reads those values from outside: CPU tensors
through ``/proc/PID/mem`` (``ProcessMemory``), GPU tensors through the reference process, which maps
the allocations the worker exported after the region (``GpuMemory``, ``evaluate.protocol.vmm``). A description
can lie only by pointing at memory that holds the right values for that call's inputs, which is
computing them; the process is stopped, so nothing is computed while it is read.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import mmap
import os
import struct
from typing import Any, Callable, Protocol

from cuda_agent.evaluate.protocol.messages import CallRecord, GpuHeld, LeafSample
from cuda_agent.evaluate.protocol.records import INPUT_VALUES, OUTPUT_VALUES, positions
from cuda_agent.tensors import tensors_in

# dtype -> (bytes, struct format of one element; bfloat16 is read as the high half of a float32)
FORMATS = {
    "float32": (4, "<f"), "float64": (8, "<d"), "float16": (2, "<e"), "bfloat16": (2, None),
    "int8": (1, "<b"), "uint8": (1, "<B"), "int16": (2, "<h"), "int32": (4, "<i"), "int64": (8, "<q"),
    "bool": (1, "<?"), "complex64": (8, "<ff"), "complex128": (16, "<dd"),
}
ITEMSIZE = {name: size for name, (size, _) in FORMATS.items()}
MAX_DIMS = 16
MAX_NUMEL = 1 << 40


class OutsideError(Exception):
    """A call's description cannot be read: out of range, malformed, or memory that is not there."""


def _leaf(tensor: Any) -> list[Any]:
    return [tensor.data_ptr(), str(tensor.dtype).removeprefix("torch."), list(tensor.shape), list(tensor.stride())]


def describe(index: int, output: Any, inputs: list[Any]) -> dict[str, Any]:
    """Where call ``index``'s output and input tensors live (worker side)."""
    return {"i": index, "o": [_leaf(t.detach()) for t in tensors_in(output)],
            "in": [_leaf(t.detach()) for t in tensors_in(inputs)]}


class OutsideReader:
    """Reads calls' values at a probe's positions; subclasses say how bytes at an address are read."""

    def close(self) -> None:
        pass

    def record(self, call: Any, probe: int) -> CallRecord:
        """Call ``call`` (a ``describe`` dict) read at ``probe``'s positions: the record the reference
        compares with the expected output of that call's inputs (``records.compare_record``)."""
        return self.records([call], probe)[0]

    def records(self, calls: list[Any], probe: int) -> list[CallRecord]:
        """Several calls at once: their reads go in one batch (``_read``)."""
        planned = [_plan(call, probe) for call in calls]
        wanted = [(address, size) for _, leaves in planned for role in leaves.values()
                  for _, _, size, _, addresses in role for address in addresses]
        data = iter(self._read(wanted))
        out = []
        for index, leaves in planned:
            samples: dict[str, list[LeafSample]] = {}
            for role, described in leaves.items():
                samples[role] = []
                for shape, dtype, size, form, addresses in described:
                    values: list[float] = []
                    for _ in addresses:
                        values.extend(_decode(next(data), form))
                    samples[role].append(LeafSample(shape=shape, dtype=dtype, values=values))
            out.append(CallRecord(index=index, outputs=samples["output"], inputs=samples["input"]))
        return out

    def _read(self, wanted: list[tuple[int, int]]) -> list[bytes]:
        raise NotImplementedError


def _plan(call: Any, probe: int) -> tuple[int, dict[str, list[tuple[list[int], str, int, str | None, list[int]]]]]:
    """The call's index, and for each role its leaves: shape, dtype, element size, format, the addresses
    of the elements at ``probe``'s positions."""
    if not isinstance(call, dict) or not isinstance(call.get("i"), int):
        raise OutsideError("a call's description is malformed")
    leaves = {}
    for role, key, count in (("output", "o", OUTPUT_VALUES), ("input", "in", INPUT_VALUES)):
        leaves[role] = [_plan_leaf(n, layout, probe, role, count) for n, layout in enumerate(_described(call, key, role))]
    return call["i"], leaves


def _layout(leaf: Any, role: str, leaf_index: int) -> tuple[int, str, list[int], list[int]]:
    """A described tensor's pointer, dtype, shape and strides, checked for sense."""
    try:
        pointer, dtype, shape, strides = leaf
        shape = [int(n) for n in shape]
        strides = [int(s) for s in strides]
    except (TypeError, ValueError):
        raise OutsideError(f"{role} {leaf_index}: its description is malformed") from None
    if dtype not in FORMATS or not isinstance(pointer, int) or len(shape) != len(strides) or len(shape) > MAX_DIMS \
            or any(n < 0 for n in shape) or any(s < 0 for s in strides):
        raise OutsideError(f"{role} {leaf_index}: an unreadable description ({dtype}, {len(shape)} dims)")
    if math.prod(shape) > MAX_NUMEL:
        raise OutsideError(f"{role} {leaf_index}: {math.prod(shape)} elements")
    return pointer, dtype, shape, strides


def span_bytes(shape: list[int], strides: list[int], itemsize: int) -> int:
    """The bytes from a tensor's first element to the end of its last, as its strides lay them out."""
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * itemsize


def _plan_leaf(leaf_index: int, layout: tuple[int, str, list[int], list[int]], probe: int, role: str,
               count: int) -> tuple[list[int], str, int, str | None, list[int]]:
    pointer, dtype, shape, strides = layout
    size, form = FORMATS[dtype]
    addresses = []
    for flat in positions(probe, role, leaf_index, math.prod(shape), count):
        offset = 0
        for extent, stride in zip(reversed(shape), reversed(strides)):
            flat, at = divmod(flat, extent)
            offset += at * stride
        address = pointer + offset * size
        if address <= 0:
            raise OutsideError(f"address {address:#x} is not in the process")
        addresses.append(address)
    return shape, dtype, size, form, addresses


def _decode(data: bytes, form: str | None) -> tuple[float, ...]:
    if form is None:  # bfloat16
        return struct.unpack("<f", b"\0\0" + data)
    return tuple(float(v) for v in struct.unpack(form, data))


class ProcessMemory(OutsideReader):
    """CPU tensors: another process's memory through ``/proc/PID/mem``; open it on the candidate's harness
    process while that process can still be trusted to exist, read only while it is stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _read(self, wanted: list[tuple[int, int]]) -> list[bytes]:
        out = []
        for address, size in wanted:
            try:
                data = os.pread(self.fd, size, address)
            except OSError as exc:
                raise OutsideError(f"address {address:#x} cannot be read from outside ({exc.strerror})") from None
            if len(data) != size:
                raise OutsideError(f"address {address:#x}: {len(data)} of {size} bytes")
            out.append(data)
        return out


class GpuRemote(Protocol):
    """The reference process's reads and writes of the candidate's GPU memory (``reference_process.ReferenceGpu``):
    ``held`` names the allocations used, ``fds`` are the descriptors of those the reference does not hold yet."""

    def read(self, held: GpuHeld, fds: list[int], sizes: list[int], reads: list[tuple[int, int, int]],
             apart_s: float) -> tuple[list[bytes], list[int]]:
        """The bytes of each read ``(allocation, offset, bytes)``, and the reads that changed between two reads."""

    def write(self, held: GpuHeld, fds: list[int], sizes: list[int], offsets: list[int], seeds: list[int],
              leaves: list[list[list[Any]]]) -> None:
        """The inputs of ``seeds``' calls drawn and written, each tensor ``[dtype, shape, strides, at]``; else
        ``OutsideError``."""

    def keep(self, held: GpuHeld, fds: list[int], sizes: list[int], offsets: list[int], leaves: list[list[Any]],
             call: int) -> None:
        """Call ``call``'s output tensors ``[dtype, shape, strides, at]`` copied into the reference's memory, kept
        there for its whole comparison; else ``OutsideError``."""

    def after_done(self, within_s: float) -> "Armed":
        """One quiet probe (``quiet.after_done``), asked for before a region's GO without waiting: launched as soon
        as what this returns rings (within ``within_s``)."""


class Armed(Protocol):
    """A probe the reference waits to launch at a region's DONE (``reference_process.ArmedProbe``)."""

    def ring(self) -> int:
        """The region said DONE: probe now. When it was rung (``time.time_ns``)."""

    def call_off(self) -> None:
        """The region went no further: no probe."""

    def answer(self) -> tuple[float, int]:
        """Waits for the reply: the probe's wait in us, when it was launched (0: called off)."""


APART_S = 0.001  # between the two reads of GPU memory: a write still landing shows as a change
MAX_HELD = 16384  # allocations held for one evaluation (20 MiB each: the largest card's memory twice over)
_IDS = itertools.count(1)  # the allocations' names in the reference's requests: never one name for two


class GpuMemory(OutsideReader):
    """GPU tensors: read by a process the candidate cannot reach (``remote``, the reference process) in the
    allocations the worker exported after its regions (``take``: ``regions.Chunk``s). An allocation is
    exported once and its descriptor kept here for the evaluation (torch's allocator reuses its memory from
    region to region); one exported again at the same address replaces the one held. The reference keeps
    what it was handed mapped for the evaluation: each descriptor is sent once, another allocation at the
    same address makes it drop the one it held."""

    def __init__(self, remote: GpuRemote) -> None:
        self.remote = remote
        self.held: dict[int, Any] = {}  # base -> Chunk
        self.chunks: list[Any] = []  # held, sorted by address
        self.ids: dict[int, int] = {}  # base -> the held allocation's name
        self.given: set[int] = set()  # names of those the reference holds
        self.gone: list[int] = []  # names it holds of allocations another took the place of

    def take(self, chunks: list[Any]) -> None:
        """Own these allocations' descriptors from now on (the caller's list is emptied)."""
        for chunk in chunks:
            replaced = self.held.pop(chunk.base, None)
            if replaced is not None:
                os.close(replaced.fd)
                name = self.ids.pop(chunk.base)
                if name in self.given:
                    self.given.discard(name)
                    self.gone.append(name)
            self.held[chunk.base] = chunk
            self.ids[chunk.base] = next(_IDS)
        chunks.clear()
        self.chunks = sorted(self.held.values(), key=lambda c: c.base)
        if len(self.held) > MAX_HELD:
            raise OutsideError(f"the candidate's process exported more than {MAX_HELD} allocations (its memory keeps "
                               "moving: every timed output must be read in memory of torch's allocator)")

    def after_done(self, within_s: float) -> Armed:
        """What a region left running on the GPU once it said DONE (``quiet.after_done``), probed by the reader:
        asked before GO, launched when what this returns rings."""
        return self.remote.after_done(within_s)

    def close(self) -> None:
        for chunk in self.held.values():
            os.close(chunk.fd)
        self.held.clear()
        self.chunks = []

    def handed(self, order: list[int], ask: Callable[[GpuHeld, list[int], list[int]], Any]) -> Any:
        """``ask(held, fds, sizes)`` of the reference for the allocations ``order`` (indices into ``chunks``), with
        the descriptors of those it does not hold yet; after a failure all are sent again (it may hold some)."""
        names = [self.ids[self.chunks[c].base] for c in order]
        new = [p for p, name in enumerate(names) if name not in self.given]
        held = GpuHeld(ids=names, new=new, drop=list(self.gone))
        try:
            answer = ask(held, [self.chunks[order[p]].fd for p in new], [self.chunks[c].size for c in order])
        except BaseException:
            self.given.clear()
            raise
        self.given.update(names)
        self.gone.clear()
        return answer

    def covering(self, tensors: list[tuple[int, str, list[int], list[int]]], role: str) -> tuple[list[int], list[int], int]:
        """The held allocations (indices into ``chunks``) that described tensors lie in, each tensor's span in
        allocations that follow one another, their offsets from the lowest of them and its address (where the
        reference is told the allocations and tensors lie); else ``OutsideError``."""
        chunks, bases = self.chunks, [c.base for c in self.chunks]
        needed: set[int] = set()
        for pointer, dtype, shape, strides in tensors:
            end = pointer + span_bytes(shape, strides, ITEMSIZE[dtype])
            at = bisect.bisect_right(bases, pointer) - 1
            reached = pointer
            while end > reached and 0 <= at < len(chunks) and chunks[at].base <= reached < chunks[at].base + chunks[at].size:
                needed.add(at)
                reached = chunks[at].base + chunks[at].size
                at += 1
            if end > reached:
                raise OutsideError(f"{role} memory at {pointer:#x} ({end - pointer} bytes) is not in the GPU memory "
                                   "the candidate's process exported")
        order = sorted(needed)
        low = chunks[order[0]].base if order else 0
        return order, [chunks[c].base - low for c in order], low

    def keep(self, call: Any, max_bytes: int) -> int | None:
        """Call ``call``'s (a ``describe`` dict) output tensors copied by the reference out of the allocations they
        lie in, while the process is stopped, for their comparison after the rounds; the bytes kept, or None where
        they would be more than ``max_bytes`` (nothing kept)."""
        tensors = _described(call, "o", "output")
        size = sum(span_bytes(s, t, ITEMSIZE[d]) for _, d, s, t in tensors)
        if size > max_bytes:
            return None
        order, offsets, low = self.covering(tensors, "output")
        leaves = [[d, s, t, p - low] for p, d, s, t in tensors]
        self.handed(order, lambda held, fds, sizes: self.remote.keep(held, fds, sizes, offsets, leaves, call["i"]))
        return size

    def _read(self, wanted: list[tuple[int, int]]) -> list[bytes]:
        bases = [c.base for c in self.chunks]
        used: dict[int, int] = {}  # chunk -> its number in the request
        reads = []
        for address, size in wanted:
            at = bisect.bisect_right(bases, address) - 1
            chunk = self.chunks[at] if at >= 0 else None
            if chunk is None or address + size > chunk.base + chunk.size:
                raise OutsideError(f"address {address:#x} is not in the GPU memory the candidate's process exported "
                                   "after the region")
            reads.append((used.setdefault(at, len(used)), address - chunk.base, size))
        order = sorted(used, key=used.__getitem__)
        if not reads:
            return []
        data, changed = self.handed(order, lambda held, fds, sizes: self.remote.read(held, fds, sizes, reads, APART_S))
        if len(data) != len(reads) or any(len(d) != r[2] for d, r in zip(data, reads)):
            raise OutsideError("the reader returned other bytes than were asked for")
        if changed:
            raise OutsideError(f"{len(changed)} of {len(reads)} values changed between two reads {APART_S * 1e3:g} ms "
                               "apart while the candidate's processes were stopped (GPU work still writing its "
                               "outputs after its region ended)")
        return data


# (seeds, per call per input tensor [dtype, shape, strides], whether the shared memory's descriptor is wanted) ->
# (per call per tensor [offset, bytes] in that memory, its size, its descriptor where one was sent)
Draw = Callable[[list[int], list[list[list[Any]]], bool], tuple[list[list[list[int]]], int, int | None]]
WRITE_CHUNK = 1 << 30  # a write through /proc/PID/mem moves at most ~2 GiB at once


class InputWriter:
    """The values of a timed region's inputs, written into the candidate's process from outside while it is
    stopped, after it said READY and before GO (CPU backend). The worker draws each call's inputs itself from
    a seed it was told, which gives them their memory and layout; the values it will be timed on are drawn
    by the reference process (``draw``) from seeds only the evaluator knows, so no output can be computed
    before its region starts: a region's inputs are unknown to the candidate's process until it is let go.
    Then the evaluator's own flush, as the worker's before READY: what was written here is not left in a
    cache the baselines' inputs are flushed from."""

    def __init__(self, pid: int, draw: Draw, flush_bytes: int) -> None:
        self.pid, self.draw = pid, draw
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        self.drawn: mmap.mmap | None = None
        self.flush = (ctypes.c_char * flush_bytes)() if flush_bytes else None

    def close(self) -> None:
        if self.drawn is not None:
            self.drawn.close()
            self.drawn = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def write(self, calls: list[Any], seeds: list[int]) -> int:
        """Each call's described input tensors (``describe``'s "in") given the values of ``seeds``' draws;
        the bytes written."""
        targets = _described_inputs(calls)
        spans, size, fd = self.draw(seeds, [[[d, s, t] for _, d, s, t in call] for call in targets],
                                    self.drawn is None)
        if fd is not None:
            try:
                if self.drawn is not None:
                    self.drawn.close()
                self.drawn = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(fd)
        if self.drawn is None or len(spans) != len(targets):
            raise OutsideError("the reference drew other calls than were asked for")
        writable = _writable(self.pid)
        starts = [start for start, _ in writable]
        view = memoryview(self.drawn)
        written = 0
        try:
            for call, call_spans in zip(targets, spans):
                if len(call_spans) != len(call):
                    raise OutsideError("the reference drew other inputs than were described")
                for (pointer, dtype, shape, strides), (offset, nbytes) in zip(call, call_spans):
                    if nbytes != span_bytes(shape, strides, ITEMSIZE[dtype]) or offset + nbytes > size:
                        raise OutsideError("the reference's inputs do not fit their description")
                    at = bisect.bisect_right(starts, pointer) - 1
                    if nbytes and (at < 0 or pointer + nbytes > writable[at][1]):
                        raise OutsideError(f"input memory at {pointer:#x} ({nbytes} bytes) is not memory the "
                                           "process can write itself")
                    for part in range(0, nbytes, WRITE_CHUNK):
                        length = min(WRITE_CHUNK, nbytes - part)
                        if os.pwrite(self.fd, view[offset + part:offset + part + length], pointer + part) != length:
                            raise OutsideError(f"input memory at {pointer + part:#x}: a short write")
                    written += nbytes
        except OSError as exc:
            raise OutsideError(f"input memory cannot be written from outside ({exc.strerror})") from None
        finally:
            view.release()
        if self.flush is not None:
            ctypes.memset(self.flush, 0, len(self.flush))
        return written


def _described_inputs(calls: list[Any]) -> list[list[tuple[int, str, list[int], list[int]]]]:
    """Each call's input tensors as READY described them (``describe``'s "in")."""
    return [_described(call, "in", "input") for call in calls]


def _described(call: Any, key: str, role: str) -> list[tuple[int, str, list[int], list[int]]]:
    """A call's tensors of one role (``describe``'s ``key``: "o" or "in"), each checked by ``_layout``."""
    described = call.get(key) if isinstance(call, dict) else None
    if not isinstance(described, list) or len(described) > 64:
        which = f"call {call['i']}" if isinstance(call, dict) and isinstance(call.get("i"), int) else "a call"
        raise OutsideError(f"{which}: its {role} tensors are not described")
    return [_layout(leaf, role, n) for n, leaf in enumerate(described)]


def _writable(pid: int) -> list[tuple[int, int]]:
    """The process's private writable mappings, sorted: the only memory an input is written into (a write
    through /proc/PID/mem would go through a read-only page too)."""
    ranges = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            span, perms = line.split(maxsplit=2)[:2]
            if perms[1] == "w" and perms[3] == "p":
                start, end = span.split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)


class GpuInputWriter:
    """``InputWriter`` on a GPU: the region's input values are drawn and written by the reference process
    (``memory.remote``), through the allocations the worker exported as it said READY (``memory``'s,
    ``GpuMemory.take``), mapped read-write there, while the candidate's processes are stopped; then the L2 is
    flushed and the device synchronised before GO."""

    def __init__(self, memory: GpuMemory) -> None:
        self.memory = memory

    def close(self) -> None:
        pass  # the descriptors are ``memory``'s

    def write(self, calls: list[Any], seeds: list[int]) -> int:
        targets = _described_inputs(calls)
        written = sum(span_bytes(shape, strides, ITEMSIZE[dtype]) for call in targets for _, dtype, shape, strides in call)
        order, offsets, low = self.memory.covering([tensor for call in targets for tensor in call], "input")
        if not order:
            return 0
        leaves = [[[d, s, t, p - low] for p, d, s, t in call] for call in targets]
        self.memory.handed(order, lambda held, fds, sizes: self.memory.remote.write(
            held, fds, sizes, offsets, seeds, leaves))
        return written
