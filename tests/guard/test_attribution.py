"""Kernel attribution: the extension's kernels read from a real nvcc object, and the
split of profiled kernels into the candidate's and the rest."""

from __future__ import annotations

import pytest
from test_symbols import nvcc_object

from cuda_agent.guard.attribution import (
    Attribution, AttributionError, attribute, base_name, coverage_reason, decoy_reason, extension_kernels,
    parse_kernel_report, stream_reason,
)

KERNELS = r"""
namespace ns {
template <typename T> __global__ void scale(const T* x, T* y, int n) { int i = threadIdx.x; if (i < n) y[i] = 2 * x[i]; }
}
namespace { __global__ void hidden(float* y) { y[0] = 1.0f; } }
__global__ void plain(const float* x, float* y, int n) { int i = threadIdx.x; if (i < n) y[i] = x[i]; }
extern "C" __global__ void c_kernel(float* y) { y[0] = 0.0f; }
__device__ float helper(float v) { return v; }
float host_only(float v) { return v; }
extern "C" void launch(const float* x, float* y, int n) {
  plain<<<1, 32>>>(x, y, n);
  ns::scale<float><<<1, 32>>>(x, y, n);
  ns::scale<double><<<1, 32>>>((const double*)x, (double*)y, n);
  hidden<<<1, 1>>>(y);
  c_kernel<<<1, 1>>>(y);
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return extension_kernels([nvcc_object(tmp_path_factory.mktemp("attr"), "k", KERNELS)])


def test_extension_kernels_are_the_global_functions(kernels):
    assert kernels == {
        "plain(float const*, float*, int)",
        "void ns::scale<float>(float const*, float*, int)",
        "void ns::scale<double>(double const*, double*, int)",
        "(anonymous namespace)::hidden(float*)",
        "c_kernel(float*)",  # extern "C": the profiler says "c_kernel", matched by base name
    }


def test_a_host_object_defines_no_kernels(tmp_path):
    from test_symbols import gxx_object

    assert extension_kernels([gxx_object(tmp_path, "host", "float f(float v) { return v; }\n")]) == frozenset()


def test_unreadable_object_is_an_error(tmp_path):
    bogus = tmp_path / "x.so"
    bogus.write_text("not an object")
    with pytest.raises(AttributionError, match="nm"):
        extension_kernels([bogus])


def test_base_name():
    assert base_name("void ns::scale<float>(float const*, float*, int)") == "ns::scale"
    assert base_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)") \
        == "at::native::vectorized_elementwise_kernel"
    assert base_name("c_kernel") == "c_kernel"
    assert base_name("(anonymous namespace)::hidden(float*)") == "{anonymous}::hidden"


def test_attribute_splits_own_and_other_time(kernels):
    profiled = [
        ("plain(float const*, float*, int)", 2, 3.0),
        ("void ns::scale<float>(float const *, float *, int)", 1, 1.0),  # other spacing, same kernel
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)", 1, 1.0),
        ("Memset (Device)", 1, 0.5),
        ("c_kernel", 1, 0.0),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32_cublas", 1, 4.5),
    ]
    a = attribute(profiled, kernels)
    assert (a.own_ms, a.other_ms, a.own_launches, a.defined) == (4.0, 6.0, 4, 5)
    assert a.coverage == pytest.approx(0.4)
    assert [k.own for k in a.kernels] == [True, True, False, False, True, False]
    assert decoy_reason(a) is None
    assert coverage_reason(a, 0.0) is None and coverage_reason(a, 0.3) is None
    assert "40.0%" in coverage_reason(a, 0.5)
    d = a.to_dict()
    assert d["kernels"][0]["name"].startswith("sm90_xmma")  # longest first
    assert d["coverage"] == pytest.approx(0.4)


def test_decoy_when_no_own_kernel_ran(kernels):
    a = attribute([("void at::native::gelu_kernel_impl<float>(float*)", 1, 2.0)], kernels)
    reason = decoy_reason(a)
    assert reason and "none of the 5 kernel(s)" in reason and "gelu_kernel_impl" in reason
    # An extension with no kernels of its own (a pure cuBLAS call, allowed by policy) is not a decoy.
    assert decoy_reason(attribute([("cublas_gemm", 1, 2.0)], frozenset())) is None


def test_no_gpu_time_gives_no_coverage():
    a = Attribution(defined=1, own_ms=0.0, other_ms=0.0, own_launches=1)
    assert a.coverage is None and coverage_reason(a, 0.9) is None


@pytest.mark.parametrize("raw", [
    "kernels", [["k", 1, 1.0]], [[1, 1, 1.0, 0]], [["k", -1, 1.0, 0]], [["k", 1, -2.0, 0]], [["k", 1.5, 1.0, 0]],
    [["k", 1, 1.0, 0]] * 300, [["x" * 5000, 1, 1.0, 0]], [["k", 1, 1.0, 2]], [["k", 1, 1.0, -1]],
    [["k", True, 1.0, 0]],
])
def test_malformed_kernel_reports_are_refused(raw):
    with pytest.raises(ValueError):
        parse_kernel_report(raw)


def test_kernel_report_parses():
    assert parse_kernel_report([["k", 2, 1, 1]]) == [("k", 2, 1.0, 1)]


def test_own_kernels_off_the_harness_stream_fail_as_stream(kernels):
    """Launches of the candidate's own kernels on another stream, whatever the source called it; other
    kernels (a library's) on other streams are not the candidate's launches."""
    on_stream = attribute([("plain(float const*, float*, int)", 3, 1.0, 0), ("cublas_gemm", 1, 2.0, 1)], kernels)
    assert on_stream.own_side_launches == 0 and stream_reason(on_stream) is None
    side = attribute([("plain(float const*, float*, int)", 3, 1.0, 2), ("c_kernel", 1, 0.5, 0)], kernels)
    assert side.own_side_launches == 2 and side.to_dict()["own_side_launches"] == 2
    reason = stream_reason(side)
    assert reason and "2 launch(es)" in reason and "plain" in reason and "c_kernel" not in reason
