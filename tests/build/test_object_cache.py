"""The per-unit object cache: keys, publishing, torn entries, concurrency, and an edit rebuilding one unit."""

import dataclasses
import importlib.util
import json
import threading
import uuid

import pytest

from cuda_agent.build import build, compile_only
from cuda_agent.build.builder import included_sources, is_glue, unit_key, uses_pch
from cuda_agent.build.cache import ObjectCache
from cuda_agent.build.toolchain import detect_toolchain
from cuda_agent.candidates import Candidate, Extension, load_candidate


def plain(sources, name="m", cflags=()):
    """A candidate without torch headers: compiles in a fraction of a second."""
    return Candidate(model_new="class ModelNew: pass\n", extensions=(Extension(name, dict(sources), cflags=tuple(cflags)),),
                     kind="workspace", origin="test")


def edited(candidate, rel, text):
    ext = candidate.extensions[0]
    return dataclasses.replace(candidate, extensions=(dataclasses.replace(ext, sources={**ext.sources, rel: text}),))


# -- the store -------------------------------------------------------------------------------------

def test_publish_then_lookup_returns_the_bytes_and_record(tmp_path):
    cache = ObjectCache(tmp_path / "objects")
    produced = tmp_path / "a.o"
    produced.write_bytes(b"object bytes")
    assert cache.lookup("ab" * 20) is None
    entry = cache.publish("ab" * 20, produced, {"unit": "a.cpp"})
    assert entry.path.read_bytes() == b"object bytes"
    assert cache.lookup("ab" * 20).record["unit"] == "a.cpp"


def test_a_torn_or_damaged_object_is_never_used_and_is_replaced(tmp_path):
    cache = ObjectCache(tmp_path / "objects")
    produced = tmp_path / "a.o"
    produced.write_bytes(b"x" * 1000)
    key = "cd" * 20
    entry = cache.publish(key, produced, {"unit": "a.cpp"})
    entry.path.unlink()
    entry.path.write_bytes(b"x" * 500)  # half an object, as a crashed copy would leave it
    assert cache.lookup(key) is None
    entry.path.unlink()
    entry.path.write_bytes(b"y" * 1000)  # right size, wrong bytes
    assert cache.lookup(key) is None
    again = cache.publish(key, produced, {"unit": "a.cpp"})
    assert again.path.read_bytes() == b"x" * 1000


def test_racing_publishers_leave_one_whole_entry(tmp_path):
    cache = ObjectCache(tmp_path / "objects")
    key = "ef" * 20
    results = []

    def publish(i):
        produced = tmp_path / f"{i}.o"
        produced.write_bytes(bytes([i]) * 100_000)
        results.append(cache.publish(key, produced, {"unit": "a.cpp", "writer": i}))

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = cache.lookup(key)
    writer = final.record["writer"]
    assert final.path.read_bytes() == bytes([writer]) * 100_000  # object and record of the same writer
    assert {r.record["writer"] for r in results} == {writer}
    assert not list((tmp_path / "objects" / "tmp").iterdir())  # nothing staged is left behind


def test_the_lock_admits_one_holder_at_a_time(tmp_path):
    cache = ObjectCache(tmp_path / "objects")
    with cache.lock("aa" * 20, wait_s=5) as first:
        assert first
        with cache.lock("aa" * 20, wait_s=0.2) as second:
            assert not second  # waited, gave up: the caller compiles alone, publishing stays safe
        with cache.lock("bb" * 20, wait_s=0.2) as other:
            assert other


# -- keys ------------------------------------------------------------------------------------------

def test_unit_key_follows_the_candidate_headers_a_unit_includes():
    toolchain = detect_toolchain("cpu")
    base = plain({"kernels/a.cpp": '#include "util.h"\nint a() { return U; }\n', "kernels/util.h": "#define U 1\n",
                  "kernels/other.h": "#define V 2\n", "kernels/b.cpp": "int b() { return 2; }\n"})
    ext = base.extensions[0]
    assert included_sources(ext, "kernels/a.cpp") == ["kernels/util.h"]
    key_a, key_b = unit_key(ext, "kernels/a.cpp", toolchain, False), unit_key(ext, "kernels/b.cpp", toolchain, False)
    util = edited(base, "kernels/util.h", "#define U 3\n").extensions[0]
    assert unit_key(util, "kernels/a.cpp", toolchain, False) != key_a
    assert unit_key(util, "kernels/b.cpp", toolchain, False) == key_b
    other = edited(base, "kernels/other.h", "#define V 4\n").extensions[0]
    assert unit_key(other, "kernels/a.cpp", toolchain, False) == key_a


def test_unit_key_is_conservative_where_the_scan_cannot_see():
    ext = plain({"kernels/a.cpp": '#define H "x.h"\n#include H\n', "kernels/x.h": "", "kernels/y.h": ""}).extensions[0]
    assert included_sources(ext, "kernels/a.cpp") == ["kernels/x.h", "kernels/y.h"]
    ext = plain({"kernels/a.cpp": "int a;\n", "kernels/y.h": ""}, cflags=["-Ikernels"]).extensions[0]
    assert included_sources(ext, "kernels/a.cpp") == ["kernels/y.h"]
    # A header at the source root is on -I ahead of the system's: part of every unit's key.
    ext = plain({"kernels/a.cpp": "int a;\n", "vector": "", "kernels/y.h": ""}).extensions[0]
    assert included_sources(ext, "kernels/a.cpp") == ["vector"]
    # Relative quoted includes resolve from the includer's directory, angled ones from the root.
    ext = plain({"kernels/a_binding.cpp": '#include "../binding_registry.h"\n#include <kernels/k.h>\n',
                 "binding_registry.h": "", "kernels/k.h": ""}).extensions[0]
    assert included_sources(ext, "kernels/a_binding.cpp") == ["binding_registry.h", "kernels/k.h"]


def test_unit_key_changes_with_flags_module_and_toolchain():
    toolchain = detect_toolchain("cpu")
    ext = plain({"kernels/a.cpp": "int a;\n"}).extensions[0]
    key = unit_key(ext, "kernels/a.cpp", toolchain, False)
    assert unit_key(dataclasses.replace(ext, cflags=("-DFAST",)), "kernels/a.cpp", toolchain, False) != key
    assert unit_key(dataclasses.replace(ext, name="other"), "kernels/a.cpp", toolchain, False) != key
    assert unit_key(ext, "kernels/a.cpp", dataclasses.replace(toolchain, cxx_version="g++ 99"), False) != key
    assert unit_key(ext, "kernels/a.cpp", dataclasses.replace(toolchain, torch_version="9.9"), False) != key
    assert unit_key(ext, "kernels/a.cpp", toolchain, False) == key


def test_only_plain_glue_units_get_the_precompiled_header(monkeypatch):
    monkeypatch.delenv("CUDA_AGENT_BUILD_PCH", raising=False)
    assert is_glue("binding.cpp") and is_glue("kernels/gelu_binding.cpp") and not is_glue("kernels/gelu.cpp")
    ext = plain({"kernels/g_binding.cpp": "#include <torch/types.h>\n", "kernels/d_binding.cpp": "#define X\n#include <torch/types.h>\n",
                 "kernels/g.cpp": "int g;\n"}).extensions[0]
    assert uses_pch(ext, "kernels/g_binding.cpp")
    assert not uses_pch(ext, "kernels/d_binding.cpp")  # a #define before the first include must come first
    assert not uses_pch(ext, "kernels/g.cpp")  # kernels: -O3, their own includes
    assert not uses_pch(dataclasses.replace(ext, cflags=("-O3",)), "kernels/g_binding.cpp")  # the .gch must match the flags
    monkeypatch.setenv("CUDA_AGENT_BUILD_PCH", "0")
    assert not uses_pch(ext, "kernels/g_binding.cpp")


# -- builds ----------------------------------------------------------------------------------------

def compiled(result):
    return sorted(u["unit"] for u in result.units if not u["reused"])


def test_an_edit_recompiles_that_unit_only_and_a_damaged_object_is_rebuilt(tmp_path):
    sources = {"kernels/a.cpp": '#include "k.h"\nint a() { return K; }\n', "kernels/k.h": "#define K 1\n",
               "kernels/b.cpp": "int b() { return 2; }\n"}
    first = compile_only(plain(sources), "cpu", cache_dir=tmp_path)
    assert first.ok, first.log
    assert compiled(first) == ["kernels/a.cpp", "kernels/b.cpp"]
    second = compile_only(edited(plain(sources), "kernels/b.cpp", "int b() { return 3; }\n"), "cpu", cache_dir=tmp_path)
    assert second.ok and compiled(second) == ["kernels/b.cpp"]
    third = compile_only(edited(plain(sources), "kernels/k.h", "#define K 2\n"), "cpu", cache_dir=tmp_path)
    assert third.ok and compiled(third) == ["kernels/a.cpp"]
    # Damage b.cpp's published object: the next build that needs it compiles it again.
    key = next(u["key"] for u in first.units if u["unit"] == "kernels/b.cpp")
    obj = ObjectCache(tmp_path / "objects").entry(key) / "object"
    data = obj.read_bytes()
    obj.unlink()
    obj.write_bytes(data[: len(data) // 2])
    fourth = compile_only(edited(plain(sources), "kernels/a.cpp", "int a() { return 5; }\n"), "cpu", cache_dir=tmp_path)
    assert fourth.ok and compiled(fourth) == ["kernels/a.cpp", "kernels/b.cpp"]


def test_a_failed_unit_is_not_stored_and_its_error_is_reported(tmp_path):
    bad = plain({"kernels/a.cpp": "int a() { return nope; }\n", "kernels/b.cpp": "int b;\n"})
    result = compile_only(bad, "cpu", cache_dir=tmp_path)
    assert not result.ok and "kernels/a.cpp" in result.error
    assert [(d.file, d.line) for d in result.errors][:1] == [("kernels/a.cpp", 1)]
    key = next(u["key"] for u in result.units if u["unit"] == "kernels/a.cpp")
    assert ObjectCache(tmp_path / "objects").lookup(key) is None


def test_warnings_of_a_reused_unit_are_reported_again(tmp_path):
    src = {"kernels/a.cpp": "#warning look here\nint a;\n"}
    first = compile_only(plain(src), "cpu", cache_dir=tmp_path)
    again = compile_only(plain({**src, "kernels/b.cpp": "int b;\n"}), "cpu", cache_dir=tmp_path)
    assert [u["reused"] for u in again.units if u["unit"] == "kernels/a.cpp"] == [True]
    for result in (first, again):
        assert [(d.file, d.severity) for d in result.diagnostics] == [("kernels/a.cpp", "warning")]


def test_concurrent_builds_of_one_source_compile_each_unit_once(tmp_path):
    sources = {f"kernels/k{i}.cpp": f"int k{i}(int x) {{ return x * {i}; }}\n" for i in range(4)}
    results = []
    threads = [threading.Thread(target=lambda: results.append(compile_only(plain(sources), "cpu", cache_dir=tmp_path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results)
    # The whole-build cache may answer some outright; every unit compiled exactly once across all.
    units = [u for r in results for u in r.units if not u["reused"]]
    assert sorted(u["unit"] for u in units) == sorted(sources)
    entries = [p for p in (tmp_path / "objects").glob("??/*") if p.is_dir()]
    assert len(entries) == len(sources)
    for entry in entries:
        record = json.loads((entry / "record.json").read_text())
        assert record["bytes"] == (entry / "object").stat().st_size


@pytest.mark.slow
def test_kernel_edit_rebuilds_the_kernel_and_the_module_still_computes(examples, cache_dir):
    torch = pytest.importorskip("torch")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    assert build(candidate, "cpu", cache_dir=cache_dir).ok
    kernel = "kernels/scaled_swish.cpp"
    # A fresh token: the session cache (CUDA_AGENT_TEST_CACHE may keep it between runs) has never seen this kernel.
    text = candidate.extensions[0].sources[kernel].replace("y[i] = scale * v", f"y[i] = 2.0f * scale * v /* {uuid.uuid4().hex} */")
    result = build(edited(candidate, kernel, text), "cpu", cache_dir=cache_dir)
    assert result.ok, result.log
    assert compiled(result) == [kernel]
    assert {u["unit"] for u in result.units if u["reused"]} == {"binding.cpp", "kernels/scaled_swish_binding.cpp"}
    spec = importlib.util.spec_from_file_location("cuda_extension", result.modules["cuda_extension"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.randn(1000)
    torch.testing.assert_close(module.scaled_swish(x, 0.5), 2.0 * 0.5 * x * torch.sigmoid(x))


@pytest.mark.slow
def test_prepare_builds_what_every_workspace_candidate_shares(examples, cache_dir):
    from cuda_agent.build import prepare

    prepared = prepare("cpu", cache_dir=cache_dir)
    assert prepared.ok, prepared.log
    renamed_op = edited(load_candidate(examples / "cpu_swish" / "solution"), "kernels/scaled_swish.cpp",
                        f"// {uuid.uuid4().hex}\n" + load_candidate(examples / "cpu_swish" / "solution").extensions[0].sources["kernels/scaled_swish.cpp"])
    result = build(renamed_op, "cpu", cache_dir=cache_dir)
    assert result.ok, result.log
    assert [u["reused"] for u in result.units if u["unit"] == "binding.cpp"] == [True]
    assert all(u["pch"] for u in result.units if u["glue"])
