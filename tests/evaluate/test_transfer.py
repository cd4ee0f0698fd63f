import json

import pytest
import torch

from cuda_agent.evaluate.worker.transfer import TransferError, manifest_devices, read_outputs, write_outputs


def roundtrip(value, tmp_path):
    manifest = json.loads(json.dumps(write_outputs(value, tmp_path / "out")))
    return manifest, read_outputs(manifest, tmp_path / "out", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_tensor_roundtrip_is_exact(tmp_path, dtype):
    value = (torch.randn(3, 5) * 10).to(dtype)
    _, back = roundtrip(value, tmp_path)
    assert back.dtype == dtype and torch.equal(back, value)


def test_structures_and_views(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    value = (base.t(), [torch.empty(0, 3), 2.5, None], {"a": base[1:3, ::2], 3: True})
    manifest, back = roundtrip(value, tmp_path)
    assert type(back) is tuple and type(back[1]) is list and back[1][1:] == [2.5, None]
    assert torch.equal(back[0], base.t()) and torch.equal(back[2]["a"], base[1:3, ::2]) and back[2][3] is True
    assert back[1][0].shape == (0, 3)
    assert manifest_devices(manifest) == ["cpu", "cpu", "cpu"]


def test_size_mismatch_is_rejected(tmp_path):
    manifest = write_outputs(torch.ones(4), tmp_path / "out")
    manifest["shape"] = [5]
    with pytest.raises(TransferError, match="does not hold 20 bytes"):
        read_outputs(manifest, tmp_path / "out", "cpu")


@pytest.mark.parametrize(
    "manifest",
    [
        {"kind": "tensor", "file": "../../etc/passwd", "dtype": "float32", "shape": [1]},
        {"kind": "tensor", "file": "leaf-0.bin", "dtype": "nn", "shape": [1]},
        {"kind": "tensor", "file": "leaf-0.bin", "dtype": "float32", "shape": [-1]},
        {"kind": "value", "value": {"x": 1}},
        {"kind": "pickle"},
        {"kind": "list", "items": "no"},
    ],
)
def test_hostile_manifests_are_rejected(tmp_path, manifest):
    (tmp_path / "out").mkdir()
    with pytest.raises(TransferError):
        read_outputs(manifest, tmp_path / "out", "cpu")


def test_unsupported_output_type(tmp_path):
    with pytest.raises(TransferError, match="output is a object; outputs must be tensors or plain values"):
        write_outputs(object(), tmp_path / "out")


def test_tensor_subclass_is_refused_with_its_place(tmp_path):
    class Lazy(torch.Tensor):
        pass

    value = [torch.ones(2), {"y": torch.ones(2).as_subclass(Lazy)}]
    with pytest.raises(TransferError, match=r"output\[1\]\['y'\] is a Lazy; outputs must be plain torch.Tensor"):
        write_outputs(value, tmp_path / "out")
