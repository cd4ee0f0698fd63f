import pytest
from samples import INLINE_ADD_ONE

from cuda_agent.candidates import CandidateError, fixed_file, load_candidate


def test_workspace_layout(examples, tmp_path):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    (ext,) = candidate.extensions
    assert ext.name == "cuda_extension" and candidate.kind == "workspace"
    assert ext.compile_units == ["binding.cpp", "kernels/scaled_swish.cpp", "kernels/scaled_swish_binding.cpp"]
    assert ext.sources["binding_registry.h"] == fixed_file("binding_registry.h")
    assert not ext.uses_cuda


def test_edited_fixed_files_are_replaced(tmp_path, examples):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "model_new.py").write_text("class ModelNew:\n    pass\n")
    (root / "kernels" / "a.cu").write_text("// kernel\n")
    (root / "binding_registry.h").write_text("#define REGISTER_BINDING(a, b) /* hacked */\n")
    candidate = load_candidate(root)
    ext = candidate.extensions[0]
    assert ext.sources["binding_registry.h"] == fixed_file("binding_registry.h")
    assert any("binding_registry.h differs" in note for note in candidate.notes)
    assert ext.uses_cuda and "kernels/a.cu" in ext.compile_units


def test_digest_changes_with_sources(tmp_path):
    root = tmp_path / "ws"
    (root / "kernels").mkdir(parents=True)
    (root / "model_new.py").write_text("class ModelNew:\n    pass\n")
    (root / "kernels" / "a.cpp").write_text("int a;\n")
    first = load_candidate(root).digest
    (root / "kernels" / "a.cpp").write_text("int b;\n")
    assert load_candidate(root).digest != first


@pytest.mark.parametrize(
    "files, message",
    [
        ({}, "missing model_new.py"),
        ({"model_new.py": "class ModelNew(:\n"}, "syntax error at line 1"),
        ({"model_new.py": "class Model:\n    pass\n"}, "no `class ModelNew`"),
    ],
)
def test_bad_workspace(tmp_path, files, message):
    root = tmp_path / "ws"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    with pytest.raises(CandidateError, match=message):
        load_candidate(root)


def test_inline_sources_are_recovered(tmp_path):
    path = tmp_path / "gen.py"
    path.write_text(INLINE_ADD_ONE)
    candidate = load_candidate(path)
    assert candidate.kind == "inline"
    (ext,) = candidate.extensions
    assert ext.name == "add_one" and ext.uses_cuda
    assert ext.cuda_cflags == ("-O3",)
    main = ext.sources["add_one/main.cpp"]
    assert main.startswith("#include <torch/extension.h>")
    assert 'm.def("add_one", &add_one, "add_one");' in main
    assert "__global__ void k" in ext.sources["add_one/cuda.cu"]


def test_inline_with_dynamic_sources_is_rejected(tmp_path):
    path = tmp_path / "gen.py"
    path.write_text(INLINE_ADD_ONE.replace('cpp_sources=cpp_source', 'cpp_sources=open("x.cpp").read()'))
    with pytest.raises(CandidateError, match=r"gen.py:\d+: cannot read load_inline's `cpp_sources` statically"):
        load_candidate(path)


def test_python_only_candidate(tmp_path):
    path = tmp_path / "gen.py"
    path.write_text("class ModelNew:\n    pass\n")
    candidate = load_candidate(path)
    assert candidate.kind == "python" and candidate.extensions == ()


def test_binary_model_new_names_the_file(tmp_path):
    (tmp_path / "ws" / "kernels").mkdir(parents=True)
    (tmp_path / "ws" / "model_new.py").write_bytes(b"\xff\xfeclass ModelNew: pass\n")
    with pytest.raises(CandidateError, match=r"ws/model_new.py: not UTF-8 text"):
        load_candidate(tmp_path / "ws")
    (tmp_path / "gen.py").write_bytes(b"class ModelNew: pass\n\xc3")
    with pytest.raises(CandidateError, match=r"gen.py: not UTF-8 text"):
        load_candidate(tmp_path / "gen.py")


# What the CUDA Agent release's binding_registry.h provides (pybind11 and a REGISTER_BINDING macro,
# no torch): a binding file must bring in torch::Tensor and its casters itself to build against it.
RELEASE_LIKE_REGISTRY = """#pragma once
#include <functional>
#include <string>
#include <vector>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
inline std::vector<std::function<void(pybind11::module&)>>& registry() {
  static std::vector<std::function<void(pybind11::module&)>> fns;
  return fns;
}
struct Registrar {
  Registrar(const char*, std::function<void(pybind11::module&)> fn) { registry().push_back(fn); }
};
#define REGISTER_BINDING(name, func) static Registrar registrar_##name(#name, [](pybind11::module& m) { func(m); });
"""


def _binding_files():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return sorted((root / "examples").glob("*/solution/**/*_binding.cpp"))


def test_binding_files_include_the_torch_headers_they_use():
    from cuda_agent.agent.workspace import render_skill
    from cuda_agent.build.probe import probe_candidate
    from cuda_agent.evaluate.protocol.policy import Policy

    texts = {str(p): p.read_text() for p in _binding_files()}
    assert len(texts) >= 4
    for backend in ("cpu", "cuda"):
        for name, text in probe_candidate(backend).extensions[0].sources.items():
            if name.endswith("_binding.cpp"):
                texts[f"probe {backend} {name}"] = text
    texts["SKILL.md"] = render_skill(Policy(), "cuda")
    for name, text in texts.items():
        registry = text.index('#include "../binding_registry.h"')
        assert "#include <torch/types.h>" in text[:registry] or "#include <torch/extension.h>" in text[:registry], name
        assert "#include <torch/csrc/utils/pybind.h>" in text or "#include <torch/extension.h>" in text, name


@pytest.mark.slow
def test_example_binding_builds_against_a_registry_without_torch(tmp_path):
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    source = next(p for p in _binding_files() if p.parent.parent.parent.name == "cpu_swish")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "binding_registry.h").write_text(RELEASE_LIKE_REGISTRY)
    shutil.copy(source, tmp_path / "kernels" / source.name)
    includes = [f"-I{path}" for path in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    run = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *includes, str(tmp_path / "kernels" / source.name)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
