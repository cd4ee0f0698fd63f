from cuda_agent.build.diagnostics import MAX_DIAGNOSTICS, MAX_MESSAGE, parse_diagnostics

ROOT = "/tmp/build/src/cuda_extension/"


def test_gcc_and_nvcc_formats():
    output = "\n".join([
        f"{ROOT}kernels/add.cpp:12:5: error: expected ';' before 'return'",
        f"{ROOT}kernels/add.cpp:3:1: warning: unused variable 'x' [-Wunused-variable]",
        f"{ROOT}kernels/add.cu(7): error: identifier \"blockIdxx\" is undefined",
        f"{ROOT}kernels/../binding_registry.h:5:2: note: in expansion of macro",
        "ptxas error   : Entry function uses too much shared data",
        "/usr/bin/ld: add.o: undefined reference to `launch_add'",
        "1 error detected in the compilation of \"add.cu\".",
    ])
    diags = parse_diagnostics(output, ROOT)
    errors = [d for d in diags if d.severity == "error"]
    assert (errors[0].file, errors[0].line, errors[0].column) == ("kernels/add.cpp", 12, 5)
    assert ("kernels/add.cu", 7) in [(d.file, d.line) for d in errors]
    assert any("too much shared data" in d.message for d in errors)
    assert any("undefined reference to `launch_add'" in d.message for d in errors)
    # errors come first, then warnings, then notes; the header path is normalised
    assert [d.severity for d in diags] == sorted([d.severity for d in diags], key=["error", "warning", "note"].index)
    assert any(d.file == "binding_registry.h" for d in diags)


def test_deduplicated_and_truncated():
    line = f"{ROOT}a.cu(1): error: " + "x" * 2000
    repeated = "\n".join([line] * 5 + [f"{ROOT}a.cu({i}): error: e{i}" for i in range(2, 100)])
    diags = parse_diagnostics(repeated, ROOT)
    assert len(diags) == MAX_DIAGNOSTICS
    assert len(diags[0].message) == MAX_MESSAGE and diags[0].message.endswith("...")
    assert len({(d.line, d.message) for d in diags}) == len(diags)
