"""Hand a candidate's outputs to the reference process: raw bytes plus a JSON manifest.

No pickle crosses from the candidate to the trusted side: the manifest is
JSON, every tensor is a flat run of bytes whose size is checked against the
declared shape and dtype. The bytes go into the memory the reference shared
(``evaluate.worker.shared``) when the output fits there, else into files written
through a shared memory map (several times faster than ``torch.save``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from cuda_agent.evaluate.worker.shared import SharedBuffer, SharedError, aligned, packed_size
from cuda_agent.tensors import tensors_in

_LEAF = re.compile(r"^leaf-\d+\.bin$")


class TransferError(ValueError):
    pass


def write_outputs(value: Any, directory: Path, shared: SharedBuffer | None = None) -> dict[str, Any]:
    """Write ``value`` (plain tensors in lists/tuples/dicts, plain values) and return its manifest:
    into ``shared`` if every tensor fits there, else into files in ``directory``.

    Anything else, a tensor subclass included, raises :class:`TransferError`
    naming where in the output it was found.
    """
    if shared is None or packed_bytes(value) > shared.nbytes:
        shared = None
        directory.mkdir(parents=True, exist_ok=True)
    return _write(value, directory, [0, 0], "output", shared)


def packed_bytes(value: Any) -> int:
    """Bytes the tensors of ``value`` take in shared memory, laid out as ``write_outputs`` does."""
    return packed_size([t.numel() * t.element_size() for t in tensors_in(value)])


def _write(value: Any, directory: Path, counter: list[int], path: str, shared: SharedBuffer | None) -> dict[str, Any]:
    """``counter``: [next leaf number, next free byte of ``shared``]."""
    import torch

    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor:
            # A subclass can defer its computation into the comparison.
            raise TransferError(f"{path} is a {type(value).__name__}; outputs must be plain torch.Tensor")
        name = f"leaf-{counter[0]}.bin"
        counter[0] += 1
        data = value.detach().contiguous().reshape(-1)
        raw = data.view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
        if shared is not None:
            where: dict[str, Any] = {"offset": counter[1]}
            shared.view(counter[1], raw.numel()).copy_(raw)
            counter[1] += aligned(raw.numel())
        elif raw.numel():
            target = torch.from_file(str(directory / name), shared=True, size=raw.numel(), dtype=torch.uint8)
            target.copy_(raw)
            del target
            where = {"file": name}
        else:
            (directory / name).write_bytes(b"")
            where = {"file": name}
        return where | {
            "kind": "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "device": value.device.type,
        }
    if isinstance(value, (list, tuple)):
        items = [_write(v, directory, counter, f"{path}[{i}]", shared) for i, v in enumerate(value)]
        return {"kind": type(value).__name__, "items": items}
    if isinstance(value, dict):
        keys = list(value)
        if not all(isinstance(k, (str, int)) for k in keys):
            raise TransferError(f"{path}: output dict keys must be str or int")
        items = [_write(value[k], directory, counter, f"{path}[{k!r}]", shared) for k in keys]
        return {"kind": "dict", "keys": keys, "items": items}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "value", "value": value}
    raise TransferError(f"{path} is a {type(value).__name__}; outputs must be tensors or plain values")


def read_outputs(manifest: Any, directory: Path, device: str, shared: SharedBuffer | None = None) -> Any:
    """Rebuild the outputs on ``device``, validating every field of the manifest. Bytes in ``shared``
    are copied out at once: the candidate can still write there."""
    return _read(manifest, directory, device, 0, shared)


def _read(node: Any, directory: Path, device: str, depth: int, shared: SharedBuffer | None) -> Any:
    import torch

    if depth > 64 or not isinstance(node, dict):
        raise TransferError("malformed output manifest")
    kind = node.get("kind")
    if kind == "tensor":
        dtype = getattr(torch, str(node.get("dtype")), None)
        shape = node.get("shape")
        if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
            isinstance(d, int) and d >= 0 for d in shape
        ):
            raise TransferError("malformed tensor description")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if "offset" in node:
            if shared is None:
                raise TransferError("the manifest names shared memory, but none was shared")
            try:
                raw = shared.view(node["offset"], nbytes)
            except SharedError as exc:
                raise TransferError(str(exc)) from None
            snapshot = raw.to(device) if device != "cpu" else raw.clone()
            return snapshot.view(dtype).reshape(shape)
        name = node.get("file")
        if not isinstance(name, str) or not _LEAF.match(name):
            raise TransferError("malformed output file name")
        path = directory / name
        if not path.is_file() or os.path.getsize(path) != nbytes:
            raise TransferError(f"output file {name} does not hold {nbytes} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        raw = torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape).to(device)
    if kind in ("list", "tuple"):
        items = [_read(n, directory, device, depth + 1, shared) for n in _items(node)]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        keys = node.get("keys")
        items = _items(node)
        if not isinstance(keys, list) or len(keys) != len(items) or not all(isinstance(k, (str, int)) for k in keys):
            raise TransferError("malformed output dict")
        return {k: _read(n, directory, device, depth + 1, shared) for k, n in zip(keys, items)}
    if kind == "value":
        value = node.get("value")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise TransferError("malformed output value")
        return value
    raise TransferError(f"unknown output kind {kind!r}")


def manifest_devices(node: Any) -> list[str]:
    """The device type of every tensor leaf, in order (what the candidate says it returned)."""
    if not isinstance(node, dict):
        return []
    if node.get("kind") == "tensor":
        return [str(node.get("device"))]
    items = node.get("items")
    return [d for n in items for d in manifest_devices(n)] if isinstance(items, list) else []


def _items(node: dict[str, Any]) -> list[Any]:
    items = node.get("items")
    if not isinstance(items, list):
        raise TransferError("malformed output manifest")
    return items
