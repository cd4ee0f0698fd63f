"""Timed outputs read from outside the candidate's process, at positions only the evaluator knows.

The worker describes each call of a timed region (where its output and input tensors live, their
dtypes, shapes and strides) in the region's DONE datagram and keeps them alive until CONT. The
evaluator stops the candidate's process tree, draws which calls to check and at which positions
from a secret that never enters that process, and reads those values through ``/proc/PID/mem``
(``OutsideReader``). A description can lie only by pointing at memory that holds the right values
for that call's inputs, which is computing them; the process is stopped, so nothing is computed
while it is read. CPU tensors only: GPU memory needs another process's mapping of it.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

from cuda_agent.evaluate.protocol import CallRecord, LeafSample
from cuda_agent.evaluate.records import INPUT_VALUES, OUTPUT_VALUES, positions
from cuda_agent.tensors import tensors_in

# dtype -> (bytes, struct format of one element; bfloat16 is read as the high half of a float32)
FORMATS = {
    "float32": (4, "<f"), "float64": (8, "<d"), "float16": (2, "<e"), "bfloat16": (2, None),
    "int8": (1, "<b"), "uint8": (1, "<B"), "int16": (2, "<h"), "int32": (4, "<i"), "int64": (8, "<q"),
    "bool": (1, "<?"), "complex64": (8, "<ff"), "complex128": (16, "<dd"),
}
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
    """Reads values of another process's memory; open it on the candidate's harness process while that
    process can still be trusted to exist, read only while it is stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def record(self, call: Any, probe: int) -> CallRecord:
        """Call ``call`` (a ``describe`` dict) read at ``probe``'s positions: the record the reference
        compares with the expected output of that call's inputs (``records.compare_record``)."""
        if not isinstance(call, dict) or not isinstance(call.get("i"), int):
            raise OutsideError("a call's description is malformed")
        leaves = {}
        for role, key, count in (("output", "o", OUTPUT_VALUES), ("input", "in", INPUT_VALUES)):
            described = call.get(key)
            if not isinstance(described, list) or len(described) > 64:
                raise OutsideError(f"call {call['i']}: its {role} tensors are not described")
            leaves[role] = [self._sample(leaf_index, leaf, probe, role, count)
                            for leaf_index, leaf in enumerate(described)]
        return CallRecord(index=call["i"], outputs=leaves["output"], inputs=leaves["input"])

    def _sample(self, leaf_index: int, leaf: Any, probe: int, role: str, count: int) -> LeafSample:
        try:
            pointer, dtype, shape, strides = leaf
            shape = [int(n) for n in shape]
            strides = [int(s) for s in strides]
        except (TypeError, ValueError):
            raise OutsideError(f"{role} {leaf_index}: its description is malformed") from None
        if dtype not in FORMATS or not isinstance(pointer, int) or len(shape) != len(strides) or len(shape) > MAX_DIMS \
                or any(n < 0 for n in shape):
            raise OutsideError(f"{role} {leaf_index}: an unreadable description ({dtype}, {len(shape)} dims)")
        numel = math.prod(shape)
        if numel > MAX_NUMEL:
            raise OutsideError(f"{role} {leaf_index}: {numel} elements")
        size, form = FORMATS[dtype]
        values: list[float] = []
        for flat in positions(probe, role, leaf_index, numel, count):
            offset = 0
            for extent, stride in zip(reversed(shape), reversed(strides)):
                flat, at = divmod(flat, extent)
                offset += at * stride
            values.extend(self._element(pointer + offset * size, size, form))
        return LeafSample(shape=shape, dtype=dtype, values=values)

    def _element(self, address: int, size: int, form: str | None) -> tuple[float, ...]:
        if address <= 0:
            raise OutsideError(f"address {address:#x} is not in the process")
        try:
            data = os.pread(self.fd, size, address)
        except OSError as exc:
            raise OutsideError(f"address {address:#x} cannot be read from outside ({exc.strerror})") from None
        if len(data) != size:
            raise OutsideError(f"address {address:#x}: {len(data)} of {size} bytes")
        if form is None:  # bfloat16
            return struct.unpack("<f", b"\0\0" + data)
        return tuple(float(v) for v in struct.unpack(form, data))
