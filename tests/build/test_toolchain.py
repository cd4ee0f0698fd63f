from cuda_agent.build.toolchain import Toolchain, cuda_arch_list


def test_arch_list_from_environment(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 9.0+PTX")
    assert cuda_arch_list() == ("8.0", "9.0a", "9.0+PTX")


def test_gencode_flags():
    toolchain = Toolchain(
        backend="cuda", cxx="g++", cxx_version="", torch_version="", torch_include=(), torch_lib=(),
        python_include="", cxx11_abi=True, nvcc="nvcc", arch=("9.0", "9.0a", "8.9+PTX"),
    )
    assert toolchain.gencode() == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_89,code=compute_89",
    ]
