import os

from cuda_agent.build.toolchain import Toolchain, cuda_arch_list, default_build_workers, usable_cpus


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


def test_build_workers_follow_the_cpus_this_process_may_use_not_the_hosts(monkeypatch):
    """A container's cpuset (or ``taskset``) is the affinity mask; ``os.cpu_count()`` counts the host's cores, which
    gave a pod with 8 CPUs of a 128-core host 64 concurrent builds."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert usable_cpus() == 8 and default_build_workers() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert usable_cpus() == 1 and default_build_workers() == 1  # never none
    monkeypatch.delattr(os, "sched_getaffinity")  # a platform without it: the count is what there is
    assert usable_cpus() == 128 and default_build_workers() == 64
