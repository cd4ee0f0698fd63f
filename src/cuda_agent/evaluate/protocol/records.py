"""Records of timed calls: a call's outputs and inputs read at secret positions (runs in workers).

Every timed call is a candidate for a check, and which ones are checked is decided by the
evaluator after all rounds ran, so no call can be told apart as the checked one. What makes that
affordable is a record small enough to keep for every recorded call: the values at ``OUTPUT_VALUES``
positions of each output tensor and ``INPUT_VALUES`` of each input tensor, drawn from a secret
``probe`` per round. On a GPU the record is read in stream order right after the region's end
event, so an output finished by work that ran after the end (another stream, a thread that launches
later) is recorded unfinished. The reference process draws the same positions from the same probe
for the expected output and compares them there (``ReferenceSide.check_records``).
"""

from __future__ import annotations

import math
import random
from typing import Any

from cuda_agent.tensors import pieces, tensors_in

RECORDED_PER_REGION = 2  # calls of a timed region that are recorded, chosen once the region ended
OUTPUT_VALUES = 16  # positions read per output tensor
INPUT_VALUES = 4  # per input tensor: an input changed by the call shows there


def positions(probe: int, role: str, leaf: int, numel: int, count: int) -> list[int]:
    """``count`` distinct flat (row-major) positions of leaf ``leaf`` of ``role`` ("output"/"input")
    of ``numel`` elements, the same in every process that knows ``probe``."""
    if numel <= 0:
        return []
    rng = random.Random(f"{probe}:{role}:{leaf}:{numel}")
    return sorted(rng.sample(range(numel), min(count, numel)))


def _index(flat: list[int], device: Any) -> Any:
    """``flat`` (row-major positions) as the index tensor ``_values_at`` takes, on ``device``."""
    import torch

    return torch.tensor(flat, dtype=torch.long, device=device)


def _values_at(data: Any, index: Any) -> Any:
    """``data`` read at ``index`` (``_index``: row-major positions, whatever its strides), flat,
    complex values as their real and imaginary parts. One gather: on a GPU the records of a region
    are queued while the region runs, and a record that costs the host more than the region lasts
    leaves the GPU idle after the end event, which reads as work run past the end."""
    import torch

    values = torch.take(data, index)
    if values.is_complex():
        values = torch.view_as_real(values)
    return values.reshape(-1)


class Recorder:
    """Reads records during one round; ``finish()`` (after the round's synchronise) returns them.

    The reads are queued on the device and copied back once per round: a record costs one small
    gather per tensor, outside the timed region. Building an index costs a host-to-device copy
    (milliseconds the first time in a process): ``prime`` builds, before the round's first region,
    those of the shapes the previous round recorded (``keys``), for this round's probe."""

    MAX_KEYS = 64  # shapes primed for the next round: a task whose shapes change every call primes nothing useful

    def __init__(self, probe: int) -> None:
        self.probe = probe
        self._indices: dict[tuple[Any, ...], Any] = {}
        self._pending: list[tuple[int, list[tuple[list[int], str, Any]], list[tuple[list[int], str, Any]]]] = []

    def record(self, index: int, output: Any, inputs: list[Any]) -> None:
        self._pending.append((index, self._take(output, "output", OUTPUT_VALUES),
                              self._take(inputs, "input", INPUT_VALUES)))

    def prime(self, keys: list[tuple[Any, ...]]) -> None:
        """Build the indices of ``keys`` (from a previous round's ``keys()``) for this probe."""
        for key in keys[:self.MAX_KEYS]:
            role, leaf, shape, device = key
            numel = math.prod(shape)
            count = OUTPUT_VALUES if role == "output" else INPUT_VALUES
            self._indices[key] = _index(positions(self.probe, role, leaf, numel, count), device)

    def keys(self) -> list[tuple[Any, ...]]:
        return list(self._indices)

    def _take(self, value: Any, role: str, count: int) -> list[tuple[list[int], str, Any]]:
        taken = []
        for leaf, tensor in enumerate(tensors_in(value)):
            data = tensor.detach()
            shape = tuple(data.shape)
            key = (role, leaf, shape, data.device)
            index = self._indices.get(key)
            if index is None:
                index = self._indices[key] = _index(positions(self.probe, role, leaf, data.numel(), count), data.device)
            taken.append((list(shape), str(data.dtype).removeprefix("torch."), _values_at(data, index)))
        return taken

    def finish(self) -> list[dict[str, Any]]:
        """The round's records as ``CallRecord`` fields: one device-to-host copy for all of them."""
        import torch

        pending, self._pending = self._pending, []
        flat = [values for _, outputs, inputs in pending for _, _, values in outputs + inputs]
        numbers: list[float] = []
        if flat:
            numbers = torch.cat([v.to("cpu", torch.float64) for v in flat]).tolist()
        at = 0
        records = []
        for index, outputs, inputs in pending:
            leaves: dict[str, list[dict[str, Any]]] = {"outputs": [], "inputs": []}
            for role, taken in (("outputs", outputs), ("inputs", inputs)):
                for shape, dtype, values in taken:
                    leaves[role].append({"shape": shape, "dtype": dtype, "values": numbers[at:at + values.numel()]})
                    at += values.numel()
            records.append({"index": index} | leaves)
        return records


def compare_record(expected: Any, inputs: list[Any], record: Any, probe: int, atol: float, rtol: float,
                   scale: bool) -> dict[str, Any]:
    """A record (``CallRecord``) against the expected output and the inputs it was computed from:
    ``{"ok", "reason", "rule"}``; ``rule`` is ``input-mutation`` where an input's values differ."""
    import torch

    from cuda_agent.evaluate.protocol.compare import compare_outputs, output_rms

    for role, truth, leaves, count in (("input", inputs, record.inputs, INPUT_VALUES),
                                       ("output", expected, record.outputs, OUTPUT_VALUES)):
        wanted = list(tensors_in(truth))
        if len(leaves) != len(wanted):
            return {"ok": False, "reason": f"{len(leaves)} {role} tensor(s) recorded, expected {len(wanted)}",
                    "rule": None}
        for leaf, (tensor, sample) in enumerate(zip(wanted, leaves)):
            where = f"{role}[{leaf}]"
            dtype = str(tensor.dtype).removeprefix("torch.")
            if list(sample.shape) != list(tensor.shape) or sample.dtype != dtype:
                return {"ok": False, "rule": None, "reason": f"{where} is {sample.dtype}{sample.shape}, expected "
                                                             f"{dtype}{list(tensor.shape)}"}
            flat = positions(probe, role, leaf, tensor.numel(), count)
            data = tensor.detach()
            truth_values = _values_at(data, _index(flat, data.device)).cpu()
            if len(sample.values) != truth_values.numel():
                return {"ok": False, "rule": None, "reason": f"{where}: {len(sample.values)} values recorded, "
                                                             f"expected {truth_values.numel()}"}
            seen = torch.tensor(sample.values, dtype=torch.float64)
            if role == "input":
                if not torch.equal(seen, truth_values.to(torch.float64)):
                    return {"ok": False, "rule": "input-mutation",
                            "reason": f"{where} changed during a timed call"}
                continue
            if not (data.is_floating_point() or data.is_complex()):
                ok = torch.equal(seen, truth_values.to(torch.float64))
                if not ok:
                    return {"ok": False, "rule": None, "reason": f"{where}: values differ at secret positions"}
                continue
            # The scale of the tolerance is the whole expected output's, as in a full comparison.
            tol = atol * output_rms(data.float() if data.dtype in (torch.float16, torch.bfloat16) else data) \
                if scale and not data.is_complex() else atol
            truth64 = truth_values.to(torch.float64)
            reports = compare_outputs(truth64, seen, tol, rtol, where)
            if not reports[0]["ok"]:
                return {"ok": False, "rule": None,
                        "reason": f"{where} at {len(flat)} secret positions: {reports[0]['reason']}"}
    return {"ok": True, "reason": None, "rule": None}


def sample_output(output: Any, probe: int) -> list[dict[str, Any]]:
    """``output`` read at the positions a record of ``probe`` reads (``LeafSample`` fields): the same
    values a timed call's record holds, for an output computed again."""
    recorder = Recorder(probe)
    recorder.record(0, output, [])
    return recorder.finish()[0]["outputs"]


def same_samples(first: Any, second: Any) -> bool:
    """Whether two lists of ``LeafSample`` hold the same tensors' values bit for bit (NaN equals NaN)."""
    if len(first) != len(second):
        return False
    for a, b in zip(first, second):
        if list(a.shape) != list(b.shape) or a.dtype != b.dtype or len(a.values) != len(b.values):
            return False
        if any(x != y and not (math.isnan(x) and math.isnan(y)) for x, y in zip(a.values, b.values)):
            return False
    return True


def same_outputs(first: Any, second: Any) -> bool:
    """Whether two outputs hold the same values in every element (NaN equals NaN), a piece at a time:
    two runs of a candidate on the same inputs, to tell whether its results vary from run to run."""
    import torch

    a_leaves, b_leaves = list(tensors_in(first)), list(tensors_in(second))
    if len(a_leaves) != len(b_leaves):
        return False
    for a, b in zip(a_leaves, b_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)
        if torch.equal(a, b):
            continue  # one wait for the device, no temporaries: pieces only where a NaN may make it unequal
        for _, (x, y) in pieces(a, b):
            if not torch.equal(x, y) and not bool(((x == y) | ((x != x) & (y != y))).all()):
                return False
    return True
