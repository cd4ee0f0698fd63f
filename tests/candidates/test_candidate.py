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
