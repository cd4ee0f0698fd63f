"""Timed outputs read from outside the candidate's process, at positions only the evaluator knows.

The worker describes each call of a timed region (where its output and input tensors live, their
dtypes, shapes and strides) in the region's DONE datagram and keeps them alive until CONT. The
evaluator stops the candidate's process tree, draws which calls to check and at which positions
from a secret that never enters that process, and reads those values from outside: CPU tensors
through ``/proc/PID/mem`` (``ProcessMemory``), GPU tensors through the reference process, which maps
the allocations the worker exported after the region (``GpuMemory``, ``evaluate.vmm``). A description
can lie only by pointing at memory that holds the right values for that call's inputs, which is
computing them; the process is stopped, so nothing is computed while it is read.
"""

from __future__ import annotations

import bisect
import math
import os
import struct
from typing import Any, Callable

from cuda_agent.evaluate.protocol import CallRecord, LeafSample
from cuda_agent.evaluate.records import INPUT_VALUES, OUTPUT_VALUES, positions
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
        described = call.get(key)
        if not isinstance(described, list) or len(described) > 64:
            raise OutsideError(f"call {call['i']}: its {role} tensors are not described")
        leaves[role] = [_plan_leaf(leaf_index, leaf, probe, role, count) for leaf_index, leaf in enumerate(described)]
    return call["i"], leaves


def _plan_leaf(leaf_index: int, leaf: Any, probe: int, role: str,
               count: int) -> tuple[list[int], str, int, str | None, list[int]]:
    try:
        pointer, dtype, shape, strides = leaf
        shape = [int(n) for n in shape]
        strides = [int(s) for s in strides]
    except (TypeError, ValueError):
        raise OutsideError(f"{role} {leaf_index}: its description is malformed") from None
    if dtype not in FORMATS or not isinstance(pointer, int) or len(shape) != len(strides) or len(shape) > MAX_DIMS \
            or any(n < 0 for n in shape) or any(s < 0 for s in strides):
        raise OutsideError(f"{role} {leaf_index}: an unreadable description ({dtype}, {len(shape)} dims)")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise OutsideError(f"{role} {leaf_index}: {numel} elements")
    size, form = FORMATS[dtype]
    addresses = []
    for flat in positions(probe, role, leaf_index, numel, count):
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


# (fds, sizes, reads, apart_s) -> (the bytes of each read, the reads that changed between two reads)
RemoteRead = Callable[[list[int], list[int], list[tuple[int, int, int]], float], tuple[list[bytes], list[int]]]
APART_S = 0.001  # between the two reads of GPU memory: a write still landing shows as a change
MAX_HELD = 16384  # allocations held for one evaluation (20 MiB each: the largest card's memory twice over)


class GpuMemory(OutsideReader):
    """GPU tensors: read by a process the candidate cannot reach (``remote``, the reference process) in the
    allocations the worker exported after its regions (``take``: ``regions.Chunk``s). An allocation is
    exported once and its descriptor kept here for the evaluation (torch's allocator reuses its memory from
    region to region); one exported again at the same address replaces the one held."""

    def __init__(self, remote: RemoteRead) -> None:
        self.remote = remote
        self.held: dict[int, Any] = {}  # base -> Chunk
        self.chunks: list[Any] = []  # held, sorted by address

    def take(self, chunks: list[Any]) -> None:
        """Own these allocations' descriptors from now on (the caller's list is emptied)."""
        for chunk in chunks:
            replaced = self.held.pop(chunk.base, None)
            if replaced is not None:
                os.close(replaced.fd)
            self.held[chunk.base] = chunk
        chunks.clear()
        self.chunks = sorted(self.held.values(), key=lambda c: c.base)
        if len(self.held) > MAX_HELD:
            raise OutsideError(f"the candidate's process exported more than {MAX_HELD} allocations (its memory keeps "
                               "moving: every timed output must be read in memory of torch's allocator)")

    def close(self) -> None:
        for chunk in self.held.values():
            os.close(chunk.fd)
        self.held.clear()
        self.chunks = []

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
        data, changed = self.remote([self.chunks[c].fd for c in order], [self.chunks[c].size for c in order],
                                    reads, APART_S)
        if len(data) != len(reads) or any(len(d) != r[2] for d, r in zip(data, reads)):
            raise OutsideError("the reader returned other bytes than were asked for")
        if changed:
            raise OutsideError(f"{len(changed)} of {len(reads)} values changed between two reads {APART_S * 1e3:g} ms "
                               "apart while the candidate's processes were stopped (GPU work still writing its "
                               "outputs after its region ended)")
        return data
