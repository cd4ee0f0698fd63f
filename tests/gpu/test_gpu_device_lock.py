"""A GPU shared by several evaluations (``DeviceLock``): a candidate that runs out of memory because
another evaluation holds the device's memory is evaluated again with the GPU alone, and earns what it
earns alone."""

from __future__ import annotations

import shutil
import threading

import pytest

from cuda_agent import Evaluator, load_candidate, load_task
from cuda_agent.evaluate.device_lock import DeviceLock

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The candidate keeps a third of the card for itself; the neighbour below holds 75% of it.
BALLAST = '''
    def __init__(self):
        super().__init__()
        self.ballast = torch.empty(torch.cuda.mem_get_info()[1] // 3, dtype=torch.uint8, device="cuda")
'''


def test_out_of_memory_beside_another_evaluation_is_evaluated_again_alone(examples, cache_dir, tmp_path):
    task = load_task(examples / "cuda_gelu" / "model.py")
    folder = tmp_path / "ballast"
    shutil.copytree(examples / "cuda_gelu" / "solution", folder)
    source = (folder / "model_new.py").read_text()
    (folder / "model_new.py").write_text(source.replace('''
    def __init__(self):
        super().__init__()
''', BALLAST))
    candidate = load_candidate(folder)
    lock = DeviceLock()
    evaluator = Evaluator("cuda", cache_dir=cache_dir, timing_lock=lock)

    alone = evaluator.evaluate(task, candidate)
    assert alone.status == "correct", alone.summary()
    assert not any("GPU alone" in note for note in alone.notes), alone.notes

    # A neighbour evaluation: it shares the device and holds 75% of its memory until the evaluator says
    # it will take the GPU alone.
    neighbour_in, neighbour_out = threading.Event(), threading.Event()
    held = {}

    def neighbour():
        with lock.shared():
            held["memory"] = torch.empty(int(torch.cuda.mem_get_info()[1] * 0.75), dtype=torch.uint8, device="cuda")
            neighbour_in.set()
            # Sharing ends when the evaluation has its share (its reference starts); the memory stays.
            neighbour_out.wait(120)

    stages = []

    def on_stage(stage, detail):
        stages.append((stage, detail))
        if stage == "reference":
            neighbour_out.set()
        if "GPU alone" in detail:
            held.pop("memory", None)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    thread = threading.Thread(target=neighbour)
    thread.start()
    assert neighbour_in.wait(60)
    evaluator.on_stage = on_stage
    try:
        beside = evaluator.evaluate(task, candidate)
    finally:
        neighbour_out.set()
        thread.join(60)
        held.clear()
        torch.cuda.empty_cache()
    assert any("GPU alone" in detail for _, detail in stages), stages
    # Apart from other memory-hungry evaluations first (the neighbour's memory still held), then alone.
    assert any("evaluated again apart" in detail for _, detail in stages), stages
    assert any("evaluated again with the GPU alone" in note and "out of memory" in note for note in beside.notes), \
        beside.notes
    assert (beside.status, beside.reward) == (alone.status, alone.reward), beside.summary()


def test_with_pause_a_slot_times_while_another_slots_reference_starts(examples, cache_dir, tmp_path):
    """``DeviceLock(pause=True)`` on the GPU: an evaluation whose reference is kept times while another's
    reference is still starting (its task's import sleeps 20 s: the kept one's own candidate process starts
    first, 5-8 s on the H200 without prestart), by stopping that evaluation's processes and
    waiting for a quiet GPU (``quiet_after_stops``); both are correct and the first earns what it earned alone."""
    import time

    source = (examples / "cuda_gelu" / "model.py").read_text()
    (tmp_path / "model.py").write_text("import time\ntime.sleep(20)  # a slow start\n" + source)
    task, sleepy = load_task(examples / "cuda_gelu" / "model.py"), load_task(tmp_path / "model.py")
    candidate = load_candidate(examples / "cuda_gelu" / "solution")
    lock = DeviceLock(pause=True)
    options = dict(cache_dir=cache_dir, timing_lock=lock, references=1)
    with Evaluator("cuda", **options) as first, Evaluator("cuda", **options) as second:
        alone = first.evaluate(task, candidate)
        results = {}

        def starting():
            results["sleepy"] = second.evaluate(sleepy, candidate)

        def timing():
            deadline = time.monotonic() + 120
            while not lock._windows and time.monotonic() < deadline:
                time.sleep(0.05)
            results["kept"] = first.evaluate(task, candidate)

        threads = [threading.Thread(target=f) for f in (starting, timing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    assert alone.status == "correct" and results["sleepy"].status == "correct", results["sleepy"].reason
    assert results["kept"].status == "correct", results["kept"].reason
    assert results["kept"].reward == alone.reward and lock.stops >= 1
