"""DeviceLock: evaluations share a device, and timing has it alone."""

from __future__ import annotations

import threading
import time

import pytest

from cuda_agent.evaluate.device_lock import DeviceLock, shared_use


def overlapping(holds):
    """Pairs of holds by different threads that overlap in time where one of them is exclusive."""
    return [(a, b) for i, a in enumerate(holds) for b in holds[i + 1:]
            if a[0] != b[0] and "exclusive" in (a[1], b[1]) and a[2] < b[3] and b[2] < a[3]]


def run_together(*functions) -> bool:
    """Each function in a thread named after it, all started, then joined; whether every one ended."""
    threads = [threading.Thread(target=f, name=f.__name__) for f in functions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return not any(t.is_alive() for t in threads)


def test_shares_overlap_and_timing_has_the_device_alone():
    lock = DeviceLock(trace=True)
    both_in = threading.Barrier(2, timeout=5)

    def evaluation():
        with lock.shared():
            both_in.wait()  # two shares at once, or this times out
            time.sleep(0.02)
            with lock:  # the timing: gives the share up, takes it back after
                time.sleep(0.05)
            time.sleep(0.02)

    threads = [threading.Thread(target=evaluation, name=f"eval-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "deadlock: two evaluations both waiting to time"
    assert [h[1] for h in lock.holds].count("exclusive") == 2
    assert overlapping(lock.holds) == []


def test_crowded_says_whether_another_evaluation_shared_the_device():
    lock = DeviceLock()
    with lock.shared():
        pass
    assert not lock.crowded  # alone from start to end

    other_in, mine_in, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def other():
        mine_in.wait(5)
        with lock.shared():
            other_in.set()
            done.wait(5)

    def mine():
        with lock.shared():
            mine_in.set()
            other_in.wait(5)  # another share comes while ours is held
        seen["mine"] = lock.crowded
        done.set()

    threads = [threading.Thread(target=other), threading.Thread(target=mine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"mine": True}
    with lock.shared():
        pass
    assert not lock.crowded  # each hold is judged afresh


def test_alone_holds_the_device_for_a_whole_evaluation():
    lock = DeviceLock(trace=True)
    inside, order = threading.Event(), []

    def evaluation_alone():
        with lock.alone():
            inside.set()
            with lock.shared():  # already its own: neither waits nor lets anyone in
                time.sleep(0.05)
                with lock:
                    time.sleep(0.02)
            time.sleep(0.05)
            order.append("alone done")

    def another():
        inside.wait(5)
        with lock.shared():
            order.append("another")

    threads = [threading.Thread(target=evaluation_alone, name="alone"), threading.Thread(target=another, name="other")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "deadlock: the evaluation alone waited for itself"
    assert order == ["alone done", "another"]
    assert overlapping(lock.holds) == []


def test_alone_first_lets_evaluations_in_progress_finish_even_while_they_time():
    """An evaluation that gave its share up to time still holds device memory: ``alone`` (the rerun of one
    that ran out of memory beside others) waits for it to end, and a new evaluation waits for ``alone``."""
    lock = DeviceLock(trace=True)
    order = []
    timing, asked = threading.Event(), threading.Event()

    def in_progress():
        with lock.shared():
            with lock:  # its timing: the share is given up here, the memory is not
                timing.set()
                asked.wait(5)
                time.sleep(0.1)
            time.sleep(0.05)
            order.append("in progress done")

    def rerun_alone():
        timing.wait(5)
        asked.set()
        with lock.alone():
            order.append("alone")

    def newcomer():
        asked.wait(5)
        time.sleep(0.05)  # the rerun is draining by now
        with lock.shared():
            order.append("newcomer")

    assert run_together(in_progress, rerun_alone, newcomer), "deadlock"
    assert order == ["in progress done", "alone", "newcomer"]
    assert overlapping(lock.holds) == []


def test_a_compile_holds_off_timing_but_not_an_evaluation_alone():
    """A compile (``occupy=False``) puts nothing on the device: timing waits for it (it would slow the timed
    process's host side), ``alone`` does not drain it; the shares of several locks are taken together."""
    locks = [DeviceLock(trace=True), DeviceLock(trace=True)]
    compiling, order = threading.Event(), []

    def compile_():
        with shared_use(locks, occupy=False):
            compiling.set()
            time.sleep(0.15)
            order.append("compiled")

    def timer():
        compiling.wait(5)
        with locks[1]:
            order.append("timed")

    def drained():
        compiling.wait(5)
        with locks[0]._cond:
            order.append(f"occupants {locks[0]._occupants}")

    assert run_together(compile_, timer, drained), "deadlock"
    assert order == ["occupants 0", "compiled", "timed"]
    assert [h[1] for h in locks[0].holds] == ["shared"] and overlapping(locks[1].holds) == []


def test_a_waiting_timing_round_goes_before_new_shares():
    lock = DeviceLock(trace=True)
    order = []
    holding = threading.Event()

    def long_share():
        with lock.shared():
            holding.set()
            time.sleep(0.2)
        order.append("long share done")

    def timer():
        holding.wait()
        with lock:
            order.append("timed")

    def late_share():
        holding.wait()
        time.sleep(0.05)  # the timer is waiting by now
        with lock.shared():
            order.append("late share")

    assert run_together(long_share, timer, late_share), "deadlock"
    assert order.index("timed") < order.index("late share")
    assert overlapping(lock.holds) == []


def test_nested_shares_do_not_wait_behind_a_writer_and_other_locks_are_untouched():
    lock = DeviceLock()
    with lock.shared():
        waiting = threading.Thread(target=lambda: lock.__enter__() or lock.__exit__())
        waiting.start()
        time.sleep(0.05)
        with shared_use(lock):  # would deadlock if it queued behind the waiting writer
            pass
    waiting.join(5)
    assert not waiting.is_alive()
    plain = threading.Lock()
    with shared_use(plain):
        assert not plain.locked()


@pytest.mark.slow
def test_two_cpu_slots_of_the_service_never_time_beside_each_others_work(cache_dir, examples):
    """Two slots of ``local_service`` on the CPU, one traced DeviceLock, two evaluations at once: both correct,
    and no slot's timing (or the brackets' calibration) overlaps anything the other slot did with the device."""
    from cuda_agent import load_candidate, load_task
    from cuda_agent.evaluate import Timeouts
    from cuda_agent.service import Job, local_service

    lock = DeviceLock(trace=True)
    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    service = local_service("cpu", slots=2, cache_dir=cache_dir, timing_lock=lock,
                            timeouts=Timeouts(check_s=60, load_s=180))
    try:
        futures = [service.submit(Job("evaluate", task=task, candidate=candidate)) for _ in range(2)]
        replies = [f.result(600) for f in futures]
    finally:
        service.close()
    assert all(r.ok and r.result["status"] == "correct" for r in replies), [r.error or r.result for r in replies]
    assert {r.slot for r in replies} == {"local-0", "local-1"}
    threads = {h[0] for h in lock.holds}
    assert len(threads) == 2 and {h[0] for h in lock.holds if h[1] == "exclusive"} == threads
    assert overlapping(lock.holds) == []
    # Side by side where they may be: some of one slot's shared use overlapped the other's.
    shared = [h for h in lock.holds if h[1] == "shared"]
    assert any(a[0] != b[0] and a[2] < b[3] and b[2] < a[3] for a in shared for b in shared)


def test_a_cpu_build_uses_the_device_its_evaluators_time_on(cache_dir, examples):
    """An agent's compile (``Evaluator.build``) on the CPU backend takes the shared side: another episode's
    timing waits for it, not runs beside it (which the CPU pressure check would refuse)."""
    from cuda_agent import Evaluator, load_candidate

    lock = DeviceLock(trace=True)
    evaluator = Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock)
    assert evaluator.build(load_candidate(examples / "cpu_swish" / "solution")).ok
    assert [mode for _, mode, _, _ in lock.holds] == ["shared"]
