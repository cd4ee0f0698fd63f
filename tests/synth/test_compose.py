"""The programmatic composer: reproducible, valid KernelBench programs with resolved shapes."""

from __future__ import annotations

from collections import Counter

import pytest

from cuda_agent.synth.catalog import build_catalog
from cuda_agent.synth.compose import ProgramComposer, SizeProfile, rescale
from cuda_agent.tasks.task import Task, check_task_source, exec_task_module


@pytest.fixture(scope="module")
def composer() -> ProgramComposer:
    return ProgramComposer(build_catalog(transformers=False), SizeProfile.for_device("cpu"), seed=3)


def _run(code: str):
    import torch

    module = exec_task_module(Task("t", code, "t"))
    model = module.Model(*module.get_init_inputs())
    with torch.no_grad():
        return module, model(*module.get_inputs())


def test_a_seed_and_index_fix_the_program(composer):
    again = ProgramComposer(composer.catalog, composer.profile, seed=3)
    assert composer.compose(5).code == again.compose(5).code
    assert composer.compose(5).code != composer.compose(6).code
    other_seed = ProgramComposer(composer.catalog, composer.profile, seed=4)
    assert other_seed.compose(5).id != composer.compose(5).id


def test_programs_are_valid_tasks_whose_shapes_match_the_resolution(composer):
    for index in range(12):
        program = composer.compose(index)
        check_task_source(program.code, program.id)
        module, out = _run(program.code)
        assert list(out.shape) == program.steps[-1]["out_shape"], program.code
        assert [list(t.shape) for t in module.get_inputs()] == program.input_shapes
        assert program.ops == [s["op"] for s in program.steps]
        assert program.data_source == f"torch#{len(program.ops)}"


def test_operator_counts_follow_the_papers_mix(composer):
    counts = Counter(composer.compose(i).data_source for i in range(200))
    assert counts["torch#2"] > 130  # 83.77% in CUDA-Agent-Ops-6K
    assert set(counts) <= {"torch#1", "torch#2", "torch#3", "torch#4", "torch#5"}


def test_rescale_changes_the_batch_everywhere(composer):
    program = next(p for p in map(composer.compose, range(50)) if len(p.input_shapes[0]) >= 2)
    bigger = rescale(program, program.input_shapes[0][0] + 3)
    module, _ = _run(bigger.code)
    assert module.get_inputs()[0].shape[0] == program.input_shapes[0][0] + 3
    assert bigger.input_shapes[0][0] == program.input_shapes[0][0] + 3


def test_no_weight_exceeds_the_size_profile():
    """Seed 2 drew nn.Bilinear on rank-1 inputs at indices 83 and 99: weights of 5e11 and 1e11 elements."""
    import torch

    from cuda_agent.synth.arguments import instantiate

    composer = ProgramComposer(build_catalog(transformers=False), SizeProfile.for_device("cpu"), seed=2)
    for index in range(100):
        for step in composer.compose(index).steps:
            op = composer.catalog.get(step["op"])
            if op.kind != "module":
                continue
            with torch.device("meta"):
                module, _ = instantiate(op, step["kwargs"], tuple(step["in_shape"]))
            sizes = [t.numel() for t in (*module.parameters(), *module.buffers())]
            assert max(sizes, default=0) <= composer.profile.max_elements, (index, step)
