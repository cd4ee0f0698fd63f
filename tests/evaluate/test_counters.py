"""The counters' report (issue 16): ncu's raw CSV parsed, kernels named and judged, the speed of light, the
text an agent reads. The fixtures are ncu output captured on the H200 (tests/gpu/test_gpu_counters.py with
CUDA_AGENT_COUNTERS_FIXTURES) for the gelu example and our KernelBench solutions of level 1 / 19 (ReLU) and
level 2 / 76 (GEMM + bias + ReLU)."""

import json
from pathlib import Path

import pytest

from cuda_agent.candidates import load_candidate
from cuda_agent.evaluate import Evaluator
from cuda_agent.evaluate.counters import (
    METRICS, CounterReport, CountersError, KernelCounters, build_report, classify, parse_ncu_raw, render, speed_of_light,
)
from cuda_agent.guard.attribution import own_matcher
from cuda_agent.tasks import load_task

FIXTURES = Path(__file__).parent / "fixtures" / "ncu"
GELU_OWN = frozenset({"(anonymous namespace)::gelu_vec4_kernel(float4 const*, float4*, long)",
                      "(anonymous namespace)::gelu_scalar_kernel(float const*, float*, long)"})


def fixture(name):
    return (FIXTURES / name / "ncu.csv").read_text(), json.loads((FIXTURES / name / "facts.json").read_text())


def test_the_raw_page_parses_to_one_row_per_launch_with_numbers():
    text, _ = fixture("cuda_gelu")
    rows = parse_ncu_raw(text)
    assert len(rows) == 1  # the profiled call launched one kernel; the warm-up calls were outside the range
    row = rows[0]
    assert row["Kernel Name"].startswith("<unnamed>::gelu_vec4_kernel")
    assert row["device__attribute_display_name"] == "NVIDIA H200"
    for metric in METRICS:
        assert isinstance(row[metric], float), metric  # every metric we ask for came back, thousands separators gone
    assert row["gpu__time_duration.sum"] > 100_000  # ns: 2 GiB through DRAM takes ~0.5 ms


def test_a_memory_bound_elementwise_kernel_is_named_so_and_is_the_candidates():
    text, facts = fixture("cuda_gelu")
    report = build_report(text, facts, own_matcher(GELU_OWN), {"candidate": 0.518, "eager": 0.507})
    (kernel,) = report.kernels
    assert kernel.origin == "own" and report.share("own") == 1.0
    assert kernel.bound == "memory" and kernel.dram_pct > 80 and "near it" in kernel.why
    assert kernel.registers == 32 and kernel.block == 256
    sol = report.speed_of_light
    assert sol.limit == "memory" and sol.bytes == 2 * 2**30 and sol.bandwidth_gbs == 4800.0
    assert sol.time_us == pytest.approx(2 * 2**30 / 4.8e12 * 1e6)
    text = report.text()
    assert "speed of light: 0.4474 ms" in text and "candidate 0.5180 ms = 1.2x" in text
    assert "gelu_vec4_kernel" in text and "own 100%" in text


def test_a_gemm_on_cuda_cores_is_compute_bound_against_a_tf32_speed_of_light():
    text, facts = fixture("level2_76")  # KernelBench 2/76: our fp32 GEMM + bias + ReLU, on CUDA cores
    report = build_report(text, facts, own_matcher(frozenset({"(anonymous namespace)::sgemm_nt_kernel<1, "
                                                               "(anonymous namespace)::BiasRelu>(float const*, float "
                                                               "const*, float*, int, int, int, (anonymous namespace)::BiasRelu)"})),
                          {"candidate": 3.47, "eager": 0.374})
    (kernel,) = report.kernels
    assert kernel.origin == "own" and kernel.bound == "compute" and kernel.tensor_pct == 0
    assert "tensor cores" in kernel.why
    sol = report.speed_of_light
    assert sol.limit == "compute" and facts["tf32"] and "TF32" in sol.flop_unit
    assert "candidate 3.4700 ms = 13.5x" in report.text()


def test_a_call_below_one_launch_is_held_against_the_launch():
    report = CounterReport(available=True, gpu="G", kernels=[kernel(duration_us=2.0)], times_ms={"candidate": 0.0023},
                           speed_of_light=speed_of_light({"bytes": 2048, "flops": 0, "dtype": "float32"},
                                                         {"gpu": "NVIDIA H200", "cc": (9, 0)}))
    text = report.text()
    assert "speed of light: 0.00 us" in text and "candidate 0.0023 ms = 1.1x one kernel launch" in text


def test_kernels_of_another_origin_are_not_the_candidates():
    text, facts = fixture("level1_19")
    report = build_report(text, facts, own_matcher(GELU_OWN), {})
    assert [k.origin for k in report.kernels] == ["other"]
    assert "own kernels hold 0%" in report.verdict


def test_the_anonymous_namespace_matches_however_it_is_spelled():
    is_own = own_matcher(frozenset({"(anonymous namespace)::k(float const*, int)"}))
    assert is_own("<unnamed>::k(const float *, int)")
    assert not is_own("<unnamed>::other(const float *, int)")


def kernel(**values):
    base = {"name": "k", "origin": "own", "launches": 1, "duration_us": 100.0}
    return KernelCounters(**(base | values))


@pytest.mark.parametrize("values,longest_us,bound,words", [
    ({"memory_pct": 10, "sm_pct": 5}, 2.0, "launch", "tiny"),
    ({"memory_pct": 90, "sm_pct": 30, "dram_pct": 88}, 100.0, "memory", "near it"),
    ({"memory_pct": 70, "sm_pct": 30, "dram_pct": 65}, 100.0, "memory", "wider loads"),
    ({"memory_pct": 92, "sm_pct": 60, "dram_pct": 8}, 100.0, "memory", "L1/L2/shared"),
    ({"memory_pct": 40, "sm_pct": 85, "fma_pct": 80, "tensor_pct": 0}, 100.0, "compute", "tensor cores"),
    ({"memory_pct": 20, "sm_pct": 15, "waves": 0.1, "grid": 13, "achieved_occupancy_pct": 6,
      "theoretical_occupancy_pct": 50, "occupancy_limiter": "registers"}, 100.0, "latency", "grid too small"),
])
def test_each_bottleneck_is_named_with_the_counters_behind_it(values, longest_us, bound, words):
    got, why = classify(kernel(**values), longest_us)
    assert got == bound and words in why


def test_the_speed_of_light_holds_each_dtype_against_its_own_peak():
    peaks = {"gpu": "NVIDIA H200", "cc": (9, 0), "sms": 132, "sm_hz": 1.98e9, "dram_gbs": 4000.0, "fp32_tflops": 67.0}
    tensor = 4096 * 132 * 1.98e9 / 1e12
    flops = 2 * 4096**3
    assert speed_of_light({"bytes": 1, "flops": flops, "dtype": "bfloat16"}, peaks).peak_tflops == pytest.approx(tensor)
    tf32 = speed_of_light({"bytes": 1, "flops": flops, "dtype": "float32", "tf32": True}, peaks)
    assert tf32.peak_tflops == pytest.approx(tensor / 2) and tf32.limit == "compute"
    fp32 = speed_of_light({"bytes": 1, "flops": flops, "dtype": "float32", "tf32": False}, peaks)
    assert fp32.peak_tflops == 67.0 and fp32.time_us == pytest.approx(flops / 67e12 * 1e6)
    # A GPU the data sheet table does not know: ncu's own sustained DRAM peak.
    unknown = speed_of_light({"bytes": 4 * 10**9, "flops": 0, "dtype": "float32"}, peaks | {"gpu": "Some GPU"})
    assert unknown.bandwidth_gbs == 4000.0 and unknown.time_us == pytest.approx(1000.0)
    assert speed_of_light({"flops": 1}, peaks) is None


def test_the_text_stays_within_its_lines_however_many_kernels_ran():
    report = CounterReport(available=True, gpu="G", kernels=[kernel(name=f"k{i}", duration_us=100 - i) for i in range(60)],
                           times_ms={"candidate": 10.0})
    text = render(report, max_lines=40)
    assert len(text.splitlines()) <= 40 and "more kernel(s)" in text
    again = CounterReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.kernels == report.kernels and again.times_ms == report.times_ms


def test_output_without_a_kernel_table_is_a_clear_error():
    with pytest.raises(CountersError, match="no kernel table"):
        parse_ncu_raw("==PROF== Connected to process 1\n==ERROR== something went wrong\n")


def test_output_written_by_candidate_code_is_refused_or_read_never_crashes():
    text, _ = fixture("cuda_gelu")
    with pytest.raises(CountersError, match="malformed"):
        parse_ncu_raw(text.replace("gelu_vec4_kernel", "gelu" * 50_000))  # a field past csv's limit
    with pytest.raises(CountersError, match="more than"):
        parse_ncu_raw("x" * (64 * 2**20 + 1))
    # Facts of the wrong shape: no speed of light, the counters still stand.
    report = build_report(text, ["not", "a", "dict"], own_matcher(GELU_OWN), {})
    assert report.speed_of_light is None and report.kernels[0].bound == "memory"
    # A launch without a grid size still reads.
    assert classify(kernel(memory_pct=10, sm_pct=10, waves=0.2, grid=None), 100.0)[0] == "latency"


def test_a_mostly_idle_gpu_is_called_launch_bound():
    text, facts = fixture("cuda_gelu")
    report = build_report(text, facts, own_matcher(GELU_OWN), {"candidate": 5.0})  # kernels 0.5 ms of a 5 ms call
    assert report.verdict.startswith("launch-bound call")


def test_the_cpu_backend_says_what_it_has_instead_of_failing(examples):
    evaluator = Evaluator("cpu", sandbox="none")
    task = load_task(examples / "cpu_swish" / "model.py")
    report = evaluator.counters(task, load_candidate(examples / "cpu_swish" / "solution"), {"candidate": 2.0})
    assert not report.available and "CPU backend reports times only" in report.reason
    assert "candidate: 2.0000 ms" in report.text()
