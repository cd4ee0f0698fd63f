"""The reference pool (evaluate.references) as evaluators sharing a GPU use it: one reference per task, handed
from one evaluation to the next, a second evaluation of the task waiting for it rather than starting its own."""

from __future__ import annotations

import threading
import time

import pytest

from cuda_agent.evaluate.references import ReferencePool


class _Reference:
    """What the pool touches of a LiveReference: its key, whether it lives, closing it, its memory, its load reply."""

    def __init__(self, key: str):
        self.key, self.closed, self.reserved, self.loaded = key, False, 0, None

    def alive(self) -> bool:
        return not self.closed

    def close(self) -> None:
        self.closed = True


def _take_in_thread(pool: ReferencePool, key: str) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def run() -> None:
        started = time.monotonic()
        got["reference"] = pool.take(key)
        got["waited_s"] = time.monotonic() - started
    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_a_second_evaluation_of_a_task_waits_for_its_reference_and_gets_that_one():
    pool = ReferencePool(4, wait_s=30)
    assert pool.take("gelu") is None  # nothing idle: the first evaluation starts it
    thread, got = _take_in_thread(pool, "gelu")
    time.sleep(0.3)
    assert thread.is_alive()  # waiting, not starting a second one
    started = _Reference("gelu")
    pool.give_back(started, healthy=True)
    thread.join(5)
    assert got["reference"] is started and got["waited_s"] >= 0.3
    assert not started.closed


def test_other_tasks_do_not_wait_and_a_failed_start_lets_the_waiter_start_its_own():
    pool = ReferencePool(4, wait_s=30)
    assert pool.take("gelu") is None
    started = time.monotonic()
    assert pool.take("softmax") is None
    assert time.monotonic() - started < 0.2
    thread, got = _take_in_thread(pool, "gelu")
    time.sleep(0.2)
    pool.forfeit("gelu")  # the first evaluation's reference never came up
    thread.join(5)
    assert got["reference"] is None and not thread.is_alive()


def test_the_wait_is_bounded_and_a_private_pool_does_not_wait():
    pool = ReferencePool(4, wait_s=0.3)
    assert pool.take("gelu") is None
    started = time.monotonic()
    assert pool.take("gelu") is None  # the other still has it: this one starts a second reference
    assert 0.3 <= time.monotonic() - started < 3
    private = ReferencePool(4)
    assert private.take("gelu") is None
    started = time.monotonic()
    assert private.take("gelu") is None and time.monotonic() - started < 0.2
    keeps_none = ReferencePool(0, wait_s=30)  # what it would wait for is closed when given back
    assert keeps_none.take("gelu") is None
    started = time.monotonic()
    assert keeps_none.take("gelu") is None and time.monotonic() - started < 0.2


def test_an_unhealthy_reference_is_closed_and_one_back_after_close_is_closed_too():
    pool = ReferencePool(4, wait_s=30)
    pool.take("gelu")
    thread, got = _take_in_thread(pool, "gelu")
    broken = _Reference("gelu")
    pool.give_back(broken, healthy=False)
    thread.join(5)
    assert broken.closed and got["reference"] is None
    pool.take("softmax")
    pool.close()
    late = _Reference("softmax")
    pool.give_back(late, healthy=True)
    assert late.closed and len(pool) == 0


def test_an_evaluation_alone_gets_the_memory_of_other_tasks_idle_references():
    pool = ReferencePool(4)
    kept = {key: _Reference(key) for key in ("gelu", "softmax", "conv")}
    for key, reference in kept.items():
        assert pool.take(key) is None
        pool.give_back(reference, healthy=True)
    assert pool.drop_idle(keep="softmax") == 2
    assert [key for key, r in kept.items() if r.closed] == ["gelu", "conv"]
    assert pool.take("softmax") is kept["softmax"] and pool.take("gelu") is None


def test_idle_references_stay_within_the_memory_bound_and_one_over_it_alone_pushes_nobody_out():
    pool = ReferencePool(4, memory=10)
    small, medium, huge = _Reference("gelu"), _Reference("softmax"), _Reference("leaky_relu")
    small.reserved, medium.reserved, huge.reserved = 3, 6, 11
    for reference in (small, medium):
        assert pool.take(reference.key) is None
        assert pool.give_back(reference, healthy=True)
    assert pool.take("leaky_relu") is None
    assert not pool.give_back(huge, healthy=True)
    assert huge.closed and not small.closed and not medium.closed and len(pool) == 2
    bigger = _Reference("conv")
    bigger.reserved = 4  # 3 + 6 + 4 > 10: the least recently used goes
    assert pool.take("conv") is None and pool.give_back(bigger, healthy=True)
    assert small.closed and not medium.closed and len(pool) == 2


def test_the_memory_bound_is_a_large_cards_memory_less_the_headroom_of_evaluations_in_flight():
    from types import SimpleNamespace

    gib = 1024**3
    h200, h100 = 150_031_155_200, 85_017_362_432  # total_memory as torch reports them
    pool = ReferencePool(4, memory=16 * gib)
    big = _Reference("leaky_relu")
    big.reserved = 25 * gib
    big.loaded = SimpleNamespace(device_bytes=h200)
    assert pool.take("leaky_relu") is None and pool.give_back(big, healthy=True)
    assert pool.bound == h200 - 64 * gib and 75 * gib < pool.bound < 76 * gib
    small = ReferencePool(4, memory=16 * gib)
    small.card_bytes = h100  # less than the headroom beyond the default bound: the default stands
    assert small.bound == 16 * gib and ReferencePool(4, memory=16 * gib).bound == 16 * gib
    assert ReferencePool(4).bound is None


def test_over_the_memory_bound_the_references_that_free_it_go_not_the_small_ones():
    pool = ReferencePool(8, memory=30)
    sizes = {"gelu": 1, "leaky_relu": 12, "softmax": 2, "tanh": 12}
    kept = {}
    for key, size in sizes.items():
        kept[key] = _Reference(key)
        kept[key].reserved = size
        assert pool.take(key) is None and pool.give_back(kept[key], healthy=True)
    sigmoid = _Reference("sigmoid")
    sigmoid.reserved = 10  # 37 > 30: 7 to free; the older of the two 12s frees it alone
    assert pool.take("sigmoid") is None and pool.give_back(sigmoid, healthy=True)
    assert [key for key, r in kept.items() if r.closed] == ["leaky_relu"]
    relu = _Reference("relu")
    relu.reserved = 25  # 50 > 30: 20 to free; no other frees it alone, so the largest go: tanh, then sigmoid
    assert pool.take("relu") is None and pool.give_back(relu, healthy=True)
    assert kept["tanh"].closed and sigmoid.closed and not kept["gelu"].closed and not kept["softmax"].closed
    assert len(pool) == 3


def test_torch_compile_out_of_memory_beside_others_goes_the_ladder_and_is_kept_only_alone():
    """Kept beside other evaluations, an out-of-memory compile error would drop the torch.compile baseline from the
    task's rewards (and its cached record) for good, although the memory it lacked may have been theirs."""
    from types import SimpleNamespace

    from cuda_agent.evaluate.protocol.channel import Stop
    from cuda_agent.evaluate.device_lock import DeviceLock
    from cuda_agent.evaluate.protocol.messages import CompileReply
    from cuda_agent.evaluate.reference_process import _baseline_sides

    class Channel:
        def __init__(self, error: str):
            self.error, self.asked = error, 0

        def ask_typed(self, stage, request, reply_type, timeout):
            self.asked += 1
            return CompileReply(compile_error=self.error)

    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB"
    lock = DeviceLock()
    setup = SimpleNamespace(time_compile=True, on_stage=lambda *_: None, timing_lock=lock,
                            timeouts=SimpleNamespace(baseline_s=60))
    reference = SimpleNamespace(compiled=None, channel=Channel(oom))
    with pytest.raises(Stop) as stopped:
        _baseline_sides(setup, reference)
    assert "out of memory" in stopped.value.reason and stopped.value.stage == "baseline"
    assert reference.compiled is None  # asked again on the next try
    with lock.apart(), pytest.raises(Stop):
        _baseline_sides(setup, reference)
    with lock.alone():  # nothing else on the GPU: the task's own error, eager alone is timed
        assert _baseline_sides(setup, reference) == ["eager"]
    assert "out of memory" in reference.compiled["compile_error"] and reference.channel.asked == 3
    assert _baseline_sides(setup, reference) == ["eager"] and reference.channel.asked == 3  # once per process
    # Another error beside others, or out of memory without a shared lock, is kept at once.
    for lock_, error in ((lock, "BackendCompilerFailed: inductor"), (threading.Lock(), oom)):
        other = SimpleNamespace(compiled=None, channel=Channel(error))
        assert _baseline_sides(SimpleNamespace(**{**vars(setup), "timing_lock": lock_}), other) == ["eager"]
        assert other.compiled["compile_error"] == error


def test_an_evaluator_collected_unclosed_leaves_a_shared_pool_open_and_closes_its_own():
    import gc

    from cuda_agent import Evaluator

    shared = ReferencePool(4)
    kept = _Reference("task")
    shared.give_back(shared.take("task") or kept, healthy=True)
    Evaluator("cpu", references=shared)  # a short-lived evaluator over a pool its owner keeps (a test's, a trainer's)
    gc.collect()
    assert not kept.closed and shared.take("task") is kept
    own = Evaluator("cpu", references=2)
    theirs = _Reference("other")
    own.references.give_back(own.references.take("other") or theirs, healthy=True)
    del own
    gc.collect()
    assert theirs.closed


def test_a_gpu_evaluation_out_of_memory_beside_idle_references_of_other_tasks_runs_again_without_them(monkeypatch):
    """Alone on its GPU, an evaluator's own idle references of other tasks must not decide a reward: an evaluation
    that runs out of memory beside them is evaluated again with them closed (its own task's kept)."""
    from cuda_agent import Evaluator
    from cuda_agent.evaluate import evaluator as evaluator_module
    from cuda_agent.evaluate.result import EvalResult

    evaluator = Evaluator("cpu", references=4)
    monkeypatch.setattr(evaluator, "device", "cuda")  # the retry is a GPU's: CPU memory is not shared this way
    monkeypatch.setattr(evaluator_module.ref, "reference_key", lambda setup, task: "this task")
    mine, other = _Reference("this task"), _Reference("other task")
    for reference in (mine, other):
        evaluator.references.give_back(evaluator.references.take(reference.key) or reference, healthy=True)
    attempts = []

    def attempt(task, candidate, build_result, timed):
        attempts.append(other.closed)
        result = EvalResult(task={}, candidate={}, device="cuda", policy={}, timing={})
        if len(attempts) == 1:
            # This task's reference, given back as the attempt ends, evicts the other task's (the pool's bound).
            evaluator.references.drop_idle(keep="this task")
            result.status, result.stage, result.rule = "failed", "verify", "memory"
            result.reason = "candidate: out of memory: OutOfMemoryError: CUDA out of memory"
        else:
            result.status = "correct"
        return result

    monkeypatch.setattr(evaluator, "_attempt", attempt)
    result = evaluator._evaluate_once(None, None, None, True)
    # Counted before the attempt: evicted while it ran, the other task's reference still counts.
    assert attempts == [False, True] and result.status == "correct" and not mine.closed
    assert any("idle references of other tasks closed" in note for note in result.notes)
    # With nothing idle to close, an out-of-memory result stands (the candidate's own memory ran out).
    attempts.clear()
    evaluator.references.drop_idle()
    assert evaluator._evaluate_once(None, None, None, True).rule == "memory" and len(attempts) == 1
