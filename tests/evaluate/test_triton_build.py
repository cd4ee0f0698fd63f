"""What the build stage of a Triton candidate keeps of the compile process's cache (``evaluate.triton_build``):
kernel files only, group files renamed to where the copy lies, nothing that points elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cuda_agent.evaluate.protocol.channel import Stop
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
    from cuda_agent.evaluate.worker.triton_runtime import _read_only_cache
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


KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1.0, mask=offsets < n)
'''

COMPILE = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import triton, kernel
from triton.backends.compiler import GPUTarget
if sys.argv[2] == "refuse":
    from triton import knobs
    from cuda_agent.evaluate.worker.triton_runtime import _read_only_cache, _refuse_compiles
    knobs.cache.manager_class = _read_only_cache()
    _refuse_compiles()
found = {}
for block in json.loads(sys.argv[3]):
    source = triton.compiler.ASTSource(fn=kernel.add_one, constexprs={"BLOCK": block},
                                       signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))  # no GPU needed: ptxas runs here
        found[block] = len(compiled.asm["cubin"])
    except Exception as exc:
        found[block] = getattr(exc, "rule", type(exc).__name__)
print(json.dumps(found))
'''


@pytest.mark.slow
def test_kernels_compiled_in_one_process_load_from_the_kept_copy_in_another(tmp_path):
    """The build stage's compile, kept and copied as for an evaluation, then the evaluated process's lookups: the
    kernel compiled is found (its group names the copy), another specialisation is refused as triton-compile."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    (tmp_path / "kernel.py").write_text(KERNEL)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TRITON_")}
    env |= {"PYTHONPATH": str(root / "src"), "TRITON_CACHE_DIR": str(tmp_path / "job" / "kernels")}

    def run(mode: str, blocks: list[int]) -> dict:
        ran = subprocess.run([sys.executable, "-c", COMPILE, str(tmp_path), mode, json.dumps(blocks)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        return json.loads(ran.stdout.strip().splitlines()[-1])

    built = run("compile", [1024])
    assert built["1024"] > 0
    home = tmp_path / "cache" / "key"
    home.parent.mkdir()
    _keep(tmp_path / "job" / "kernels", home)
    copy = copy_kernels(home, tmp_path / "eval-job")
    env["TRITON_CACHE_DIR"] = str(copy)
    assert run("refuse", [1024, 2048]) == {"1024": built["1024"], "2048": "triton-compile"}
