"""The torch-compute verdict of the profiled check: the operator tree a profile records, read the
way the dispatch mode reads a watched call."""

from __future__ import annotations

import pytest

from cuda_agent.guard.runtime import ALLOWED_ATEN, CallGuard, RuleBroken, composite_only, unlisted_aten

torch = pytest.importorskip("torch")


def leaf(name):
    return (name, ())


def test_allowed_subtrees_and_composites_are_not_computation():
    tree = (
        ("aten::zeros_like", (leaf("aten::empty_like"), ("aten::zero_", (leaf("aten::fill_"),)))),  # allowed: its fill too
        ("aten::reshape", (leaf("aten::view"),)),  # a composite of views
        leaf("aten::contiguous"),  # a composite that ran nothing below it
        ("cuda_extension::op", (leaf("aten::empty"),)),  # a custom op is looked through
        leaf("cudaLaunchKernel"),  # runtime calls are not operators
    )
    composite = {"aten::reshape", "aten::contiguous"}.__contains__
    assert unlisted_aten(tree, ALLOWED_ATEN, composite) == {}


def test_operators_with_kernels_of_their_own_are_computation_wherever_they_sit():
    tree = (
        ("aten::add", (("aten::to", (leaf("aten::_to_copy"),)),)),  # counted itself, not only what it called
        ("aten::softmax", (leaf("aten::_softmax"),)),  # composite: what it ran counts
        ("my_ext::op", (leaf("aten::gelu"), leaf("aten::gelu"))),  # torch inside a custom op
    )
    composite = {"aten::softmax", "aten::to"}.__contains__
    assert unlisted_aten(tree, ALLOWED_ATEN, composite) == {"aten::add": 1, "aten::_softmax": 1, "aten::gelu": 2}
    # The policy's extra operators, by short or namespaced name.
    assert unlisted_aten(tree, ALLOWED_ATEN | {"add", "aten._softmax", "gelu"}, composite) == {}


def test_composites_are_read_from_the_dispatcher():
    assert composite_only("aten::reshape") and composite_only("aten::contiguous")
    assert not composite_only("aten::gelu") and not composite_only("aten::add")
    assert not composite_only("aten::no_such_operator")


def test_the_profiled_check_sees_torch_reached_from_anywhere():
    """No dispatch mode on the profiled call (it must look like a timed one); its profile catches torch
    operators, and lets through what a solution does around its own kernels."""
    from cuda_agent.evaluate.worker.profiling import profile_call

    # The first uses of the profiler and of torch's thread pool start their threads (the worker's warm-up).
    profile_call(lambda: torch.nn.functional.gelu(torch.randn(1 << 18)), "cpu")
    guard = CallGuard()
    x = torch.randn(64, 64)

    def honest():
        y = torch.empty_like(x.contiguous().reshape(-1))
        return y.view(64, 64)

    output, profile = profile_call(lambda: guard.watch(honest, lambda: None, monitor=False), "cpu",
                                   on_start=guard.trust_new_threads)  # the profiler's own threads
    assert output.shape == (64, 64) and profile.kernels == []
    guard.check_profiled_ops(profile.ops)
    # The same call under the dispatch mode agrees.
    guard.watch(honest, lambda: None)

    def fallback():
        return torch.ops.aten.gelu.default(x) * 2  # an operator reached without its Python name

    _, profile = profile_call(lambda: guard.watch(fallback, lambda: None, monitor=False), "cpu",
                              on_start=guard.trust_new_threads)
    with pytest.raises(RuleBroken) as broken:
        guard.check_profiled_ops(profile.ops)
    assert broken.value.rule == "torch-compute" and "seen by the profiler" in str(broken.value)
    assert "aten::gelu x1" in str(broken.value) and "aten::mul x1" in str(broken.value)


def test_an_output_torch_did_not_allocate_fails_and_views_of_one_it_did_pass():
    import numpy as np

    guard = CallGuard()
    model = torch.nn.Linear(2, 2)
    x = torch.randn(4, 8)
    guard.check_output_memory((torch.empty_like(x), torch.empty(8, 4).t()[1:]), [x], model)
    external = torch.from_numpy(np.zeros((4, 8), dtype=np.float32))  # torch::from_blob over memory of its own
    with pytest.raises(RuleBroken) as broken:
        guard.check_output_memory((torch.empty_like(x), external), [x], model)
    assert broken.value.rule == "output-memory" and "torch::empty_like" in str(broken.value)
