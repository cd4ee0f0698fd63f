"""What the build stage of a Triton candidate keeps of the compile process's cache (``evaluate.triton_build``):
kernel files only, group files renamed to where the copy lies, nothing that points elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cuda_agent.evaluate.channel import Stop
from cuda_agent.evaluate import triton_build
from cuda_agent.evaluate.triton_build import _keep, copy_kernels


def compile_cache(root: Path) -> Path:
    """A cache as Triton's compile leaves it: a kernel's files and its group file, the launcher it built, a link."""
    cache = root / "kernels"
    kernel = cache / "HASHA"
    kernel.mkdir(parents=True)
    (kernel / "k.cubin").write_bytes(b"\x7fELF cubin")
    (kernel / "k.json").write_text(json.dumps({"name": "k"}))
    (kernel / "k.ttir").write_text("module {}")  # an intermediate representation: not kept
    (kernel / "__grp__k.json").write_text(json.dumps(
        {"child_paths": {"k.cubin": str(kernel / "k.cubin"), "k.json": str(kernel / "k.json"),
                         "k.ttir": str(kernel / "k.ttir")}}))
    (cache / "HASHB").mkdir()
    (cache / "HASHB" / "k.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": []}))
    (cache / "HASHB" / "__grp__evil.json").write_text(json.dumps({"child_paths": {"k.cubin": "/etc/passwd"}}))
    (cache / "HASHC").mkdir()
    (cache / "HASHC" / "cuda_utils.so").write_bytes(b"\x7fELF native code")
    (cache / "HASHC" / "link.json").symlink_to("/etc/hostname")
    return cache


def test_only_kernel_files_are_kept_and_groups_point_into_the_copy(tmp_path):
    home = tmp_path / "cache" / "key"
    home.parent.mkdir()
    _keep(compile_cache(tmp_path / "job"), home)
    kept = sorted(p.relative_to(home).as_posix() for p in home.rglob("*") if p.is_file())
    assert kept == ["HASHA/__grp__k.json", "HASHA/k.cubin", "HASHA/k.json", "HASHB/k.autotune.json", "done"]
    copy = copy_kernels(home, tmp_path / "eval-job")
    group = json.loads((copy / "HASHA" / "__grp__k.json").read_text())["child_paths"]
    assert group == {"k.cubin": str(copy / "HASHA" / "k.cubin"), "k.json": str(copy / "HASHA" / "k.json")}
    assert all(Path(p).is_file() for p in group.values()) and not (copy / "done").exists()


def test_a_cache_too_big_for_one_task_stops_the_build(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_build, "MAX_FILES", 2)
    with pytest.raises(Stop, match="more than 2 files"):
        _keep(compile_cache(tmp_path / "job"), tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_the_evaluated_process_reads_the_kept_kernels_and_writes_nothing(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from cuda_agent.evaluate.triton_runtime import _read_only_cache
    from cuda_agent.guard.runtime import RuleBroken

    home = tmp_path / "cache" / "key"
    home.parent.mkdir()
    _keep(compile_cache(tmp_path / "job"), home)
    copy = copy_kernels(home, tmp_path / "eval-job")
    copy.chmod(0o555)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(copy))  # knobs.cache.dir, as prepare_triton sets it
    cache = _read_only_cache()
    assert cache("HASHA").get_group("k.json") == {"k.cubin": str(copy / "HASHA" / "k.cubin"),
                                                  "k.json": str(copy / "HASHA" / "k.json")}
    missing = cache("HASHZ")  # another specialisation: found nowhere, and no directory made for it
    assert missing.get_group("k.json") is None and not (copy / "HASHZ").exists()
    with pytest.raises(RuleBroken) as caught:
        missing.put(b"\x7fELF", "k.cubin")
    assert caught.value.rule == "triton-compile"
