"""The operator catalog: crawled from the installed torch, constraints found by probing."""

from __future__ import annotations

import json

import pytest

from cuda_agent.synth.catalog import Catalog, build_catalog


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return build_catalog(transformers=False)


def test_crawl_finds_modules_functions_and_tensor_ops(catalog):
    usable = {op.name for op in catalog.usable()}
    assert {"nn.Conv2d", "nn.Linear", "nn.GroupNorm", "nn.GELU", "F.softmax", "torch.tanh", "torch.diag"} <= usable
    assert len(usable) > 150


def test_probe_records_ranks_shape_and_signatures(catalog):
    conv = catalog.get("nn.Conv2d")
    assert 4 in conv.ranks and 2 not in conv.ranks and 5 not in conv.ranks
    assert {p.name for p in conv.params if p.required} == {"in_channels", "out_channels", "kernel_size"}
    assert conv.family == "conv" and conv.kind == "module"
    tanh = catalog.get("torch.tanh")
    assert tanh.ranks == [1, 2, 3, 4, 5] and all(tanh.keeps_shape.values()) and tanh.family == "elementwise"
    assert catalog.get("torch.add").arity == 2


def test_stochastic_operators_are_flagged_and_nan_producers_are_not(catalog):
    assert catalog.get("nn.Dropout").stochastic and catalog.get("nn.RReLU").stochastic
    assert not catalog.get("torch.log").stochastic  # NaN on negative inputs, but the same NaN twice
    assert not catalog.get("nn.ReLU").stochastic


def test_unusable_operators_keep_their_reason(catalog):
    loss = catalog.get("nn.MSELoss")
    assert not loss.usable and "target" in loss.reason
    unflatten = catalog.get("nn.Unflatten")
    assert not unflatten.usable and "unflattened_size" in unflatten.reason


def test_save_load_round_trip_and_bad_files(catalog, tmp_path):
    path = tmp_path / "catalog.json"
    catalog.save(path)
    again = Catalog.load(path)
    assert [op.to_dict() for op in again.operators] == [op.to_dict() for op in catalog.operators]
    assert again.versions == catalog.versions
    path.write_text(json.dumps({"format": 999, "operators": []}))
    with pytest.raises(ValueError, match="cuda-agent catalog"):
        Catalog.load(path)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable operator catalog"):
        Catalog.load(tmp_path / "junk.json")


def test_transformers_layers_are_crawled_when_installed():
    pytest.importorskip("transformers")
    catalog = build_catalog(transformers=True)
    usable = {op.name for op in catalog.usable("transformers")}
    assert any(name.endswith("RMSNorm") for name in usable)
    assert any(name.endswith("MLP") for name in usable)
    assert "transformers" in catalog.versions
