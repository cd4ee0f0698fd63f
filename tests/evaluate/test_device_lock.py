"""DeviceLock: evaluations share a device, and timing has it alone."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from cuda_agent.evaluate.device_lock import MEMORY_HUNGRY, DeviceLock, shared_use


def overlapping(holds):
    """Pairs of holds by different threads that overlap in time where one of them is exclusive."""
    return [(a, b) for i, a in enumerate(holds) for b in holds[i + 1:]
            if a[0] != b[0] and "exclusive" in (a[1], b[1]) and a[2] < b[3] and b[2] < a[3]]


def run_together(*functions, timeout: float = 10) -> bool:
    """Each function in a thread named after it, all started, then joined; whether every one ended."""
    threads = [threading.Thread(target=f, name=f.__name__) for f in functions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def eventually(condition, timeout: float = 5) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (another thread gets there meanwhile)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def exclusive_holder(lock: DeviceLock) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """A started thread holding ``lock``'s exclusive side from ``holding`` until ``release`` is set."""
    holding, release = threading.Event(), threading.Event()

    def holder():
        with lock:
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=holder, name="holder")
    thread.start()
    return thread, holding, release


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


def test_an_evaluation_apart_times_before_the_timings_waiting_beside_it():
    """The memory-hungry tasks wait for the apart turn to end, so its timing is the stream's critical path: it
    goes before timings that were waiting first (three of them here; any order among them)."""
    lock = DeviceLock(trace=True)
    order: list[str] = []
    held, holding, release = exclusive_holder(lock)

    def timer(name: str, apart: bool):
        holding.wait()
        with lock.apart() if apart else contextlib.nullcontext():
            with lock:
                order.append(name)

    def waiting(count: int) -> bool:
        return eventually(lambda: len(lock._timing_tickets) >= count)

    threads = [threading.Thread(target=timer, args=(f"beside {i}", False)) for i in range(3)]
    for thread in threads:
        thread.start()
    threads.append(held)
    assert holding.wait(5) and waiting(3)
    threads.append(threading.Thread(target=timer, args=("apart", True)))
    threads[-1].start()
    assert waiting(4)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order[0] == "apart" and sorted(order[1:]) == ["beside 0", "beside 1", "beside 2"], order
    assert overlapping(lock.holds) == [] and lock._apart_waiting == 0


def test_an_evaluation_apart_takes_its_share_after_the_timings_waiting_before_it_not_after_later_ones():
    """Waiting timings go before new shares, but an evaluation apart (the memory-hungry chain) waits only for those
    that asked before it: a timing asking after it waits for its share to end, and a plain share asking after that
    timing still waits for the timing."""
    lock = DeviceLock(trace=True)
    order: list[str] = []
    held, holding, release = exclusive_holder(lock)

    def timer(name: str):
        with lock:
            order.append(name)

    def apart_share():
        with lock.apart():
            with lock.shared():
                order.append("apart share")
                time.sleep(0.2)
            order.append("apart share done")

    def plain_share():
        with lock.shared():
            order.append("plain share")

    def started(target, *args, until) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=target.__name__ + "".join(args))
        thread.start()
        assert eventually(until), f"{thread.name} is not waiting"
        return thread

    threads = [held]
    assert holding.wait(5)
    threads.append(started(timer, "timed before", until=lambda: len(lock._timing_tickets) == 1))
    threads.append(started(apart_share, until=lambda: len(lock._apart_share_tickets) == 1))
    threads.append(started(timer, "timed after", until=lambda: len(lock._timing_tickets) == 2))
    threads.append(threading.Thread(target=plain_share))
    threads[-1].start()
    time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads), "deadlock"
    assert order.index("timed before") < order.index("apart share") < order.index("apart share done") \
        < order.index("timed after") < order.index("plain share"), order
    assert overlapping(lock.holds) == []
    assert (lock._timing_tickets, lock._apart_share_tickets, lock._apart_waiting) == (set(), set(), 0)


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
    and no slot's timing (or the brackets' calibration) overlaps anything the other slot did with the device.
    Pause off: with it a timing overlaps a neighbour's share, whose processes it stopped (the pause tests below)."""
    from cuda_agent import load_candidate, load_task
    from cuda_agent.evaluate import Timeouts
    from cuda_agent.service import Job, local_service

    lock = DeviceLock(trace=True, pause=False)
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


@pytest.mark.slow  # two real builds (the probe and the example): a minute on 2 cores with an empty cache
def test_a_cpu_build_uses_the_device_its_evaluators_time_on(cache_dir, examples):
    """An agent's compile (``Evaluator.build``) on the CPU backend takes the shared side: another episode's
    timing waits for it, not runs beside it (which the CPU pressure check would refuse). So does the symbol audit's
    probe, built before the evaluator's first candidate."""
    from cuda_agent import Evaluator, load_candidate

    lock = DeviceLock(trace=True)
    evaluator = Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock)
    assert evaluator.build(load_candidate(examples / "cpu_swish" / "solution")).ok
    assert [mode for _, mode, _, _ in lock.holds] == ["shared", "shared"]  # the probe, then the candidate
    assert evaluator.build(load_candidate(examples / "cpu_swish" / "solution")).ok
    assert [mode for _, mode, _, _ in lock.holds] == ["shared"] * 3  # the probe once per evaluator


def test_evaluations_apart_take_turns_beside_shared_ones():
    """``apart``: two memory-hungry evaluations never overlap each other, and a plain one runs beside both."""
    lock = DeviceLock()
    spans: dict[str, tuple[float, float]] = {}
    started = threading.Event()

    def hungry(name):
        def evaluation():
            with lock.apart():
                with lock.shared():
                    began = time.monotonic()
                    started.set()
                    time.sleep(0.15)
                    spans[name] = (began, time.monotonic())
        evaluation.__name__ = name
        return evaluation

    def plain():
        started.wait(5)
        with lock.shared():
            began = time.monotonic()
            time.sleep(0.05)
            spans["plain"] = (began, time.monotonic())

    assert run_together(hungry("a"), hungry("b"), plain), "deadlock"
    (a0, a1), (b0, b1), (p0, p1) = spans["a"], spans["b"], spans["plain"]
    assert a1 <= b0 or b1 <= a0, "two evaluations apart overlapped"
    assert any(s0 < p1 and p0 < s1 for s0, s1 in (spans["a"], spans["b"])), "the plain one waited for those apart"


def test_apart_lets_as_many_hungry_evaluations_run_at_once_as_it_is_given():
    """``DeviceLock(apart=2)``: two evaluations apart overlap, never three; below 1 is refused by name."""
    lock = DeviceLock(apart=2)
    inside, most = [0], [0]
    guard = threading.Lock()

    def hungry():
        with lock.apart():
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.15)
            with guard:
                inside[0] -= 1

    assert run_together(hungry, hungry, hungry, hungry), "deadlock"
    assert most[0] == 2
    with pytest.raises(ValueError, match="apart"):
        DeviceLock(apart=0)


class _ScriptedAttempts:
    """``Evaluator._attempt`` as a test double: each attempt runs out of GPU memory or not as scripted, holding
    the lock's shared side as an evaluation does while a neighbour (another thread) holds it too."""

    def __init__(self, lock, script):
        self.lock, self.script, self.calls = lock, list(script), []
        self.neighbour_in, self.neighbour_out = threading.Event(), threading.Event()

    def neighbour(self):
        with self.lock.shared():
            self.neighbour_in.set()
            self.neighbour_out.wait(10)

    def __call__(self, task, candidate, build_result, timed):
        from cuda_agent.evaluate.result import EvalResult

        mode = self.lock.step
        with self.lock.shared():
            time.sleep(0.02)
        self.calls.append(mode)
        result = EvalResult(task={}, candidate={}, device="cuda", policy={}, timing={})
        step = self.script.pop(0)
        if step == "hungry":
            result.status, result.stage, result.rule = "error", "reference", MEMORY_HUNGRY
            result.reason = "its output (6.0 GiB) is at least 1/64 of the GPU's memory"
        elif step:
            result.stage, result.reason = "verify", "CUDA out of memory. Tried to allocate 6.00 GiB"
        else:
            result.status, result.reward = "correct", 1.0
        return result


@pytest.mark.parametrize("script, steps, kept_as", [
    ([True, False, False], ["shared", "apart", "apart"], "apart"),
    ([True, True, False, False], ["shared", "apart", "alone", "alone"], "alone"),
    (["hungry", False, False], ["shared", "apart", "apart"], "apart"),  # told by its output's size, not by running out
    (["hungry", True, False, False], ["shared", "apart", "alone", "alone"], "alone"),
])
def test_out_of_memory_beside_others_is_tried_apart_then_alone_and_the_task_remembered(
        cache_dir, script, steps, kept_as, monkeypatch):
    """The rerun's order: beside others (ran out) -> apart -> alone only if apart ran out too; the task's next
    candidate starts at the step that served it. The reward is never the crowded attempt's."""
    from types import SimpleNamespace

    from cuda_agent import Evaluator

    lock = DeviceLock()
    evaluator = Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock)
    evaluator.device = "cuda"  # the memory reruns are the GPU's; the attempts are scripted
    attempts = _ScriptedAttempts(lock, script)
    monkeypatch.setattr(evaluator, "_attempt", attempts)
    task = SimpleNamespace(digest="big-task")
    neighbour = threading.Thread(target=attempts.neighbour)
    neighbour.start()
    assert attempts.neighbour_in.wait(5)
    # The neighbour leaves once the first attempt has run beside it (an alone rerun waits for it to end).
    threading.Timer(0.3, attempts.neighbour_out.set).start()
    try:
        first = evaluator.evaluate(task, None)
        second = evaluator.evaluate(task, None)
    finally:
        attempts.neighbour_out.set()
        neighbour.join(10)
    assert attempts.calls == steps
    assert first.status == second.status == "correct" and first.reward == 1.0
    assert any(("apart" if kept_as == "apart" else "GPU alone") in note for note in first.notes), first.notes
    assert (task.digest in lock.apart_keys) and ((task.digest in lock.alone_keys) == (kept_as == "alone"))
    # Each record says why it left the step beside others: its output's size, or running out there.
    why = "1/64 of the GPU's memory" if script[0] == "hungry" else "ran out of memory"
    assert any(why in note for note in first.notes), first.notes
    assert kept_as == "alone" or any(why in note for note in second.notes), second.notes


def test_a_task_whose_output_is_a_64th_of_the_gpu_goes_apart_before_its_candidate_loads(cache_dir):
    """Told by the reference's load, not by running out: only beside another evaluator on the GPU, only for an
    attempt beside any (not one already apart or alone), and only from 1/64 of the GPU's memory on."""
    from cuda_agent import Evaluator
    from cuda_agent.evaluate.protocol.channel import Stop
    from cuda_agent.evaluate.protocol.messages import LoadReply

    gib = 1024**3
    lock = DeviceLock()
    first = Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock)
    big, small = LoadReply(device_bytes=64 * gib, output_bytes=gib), LoadReply(device_bytes=64 * gib,
                                                                                   output_bytes=gib - 1)
    first._stop_if_hungry(big)  # alone on the GPU: nothing to run out beside
    Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock)  # a second slot on the same GPU
    ahead: list[str] = []
    with pytest.raises(Stop) as stopped:
        first._stop_if_hungry(big, lambda: ahead.append("compiled"))
    assert ahead == ["compiled"]  # what the apart turn would otherwise do, done before it stops
    assert stopped.value.rule == MEMORY_HUNGRY and stopped.value.status == "error"
    assert "1.0 GiB" in stopped.value.reason and "1/64" in stopped.value.reason
    first._stop_if_hungry(small, lambda: ahead.append("small"))
    first._stop_if_hungry(LoadReply(output_bytes=gib))  # the CPU backend: no device memory to share
    with lock.apart():
        assert lock.step == "apart"
        first._stop_if_hungry(big)
    with lock.alone():
        assert lock.step == "alone"
        first._stop_if_hungry(big)
    assert lock.step == "shared" and ahead == ["compiled"]


class Stoppable:
    """A stand-in for a reference process's worker: records when it was stopped and let go."""

    def __init__(self, events: list[tuple[str, float]]):
        self.events = events
        self.stopped = False

    def pause(self) -> bool:
        self.stopped = True
        self.events.append(("stopped", time.monotonic()))
        return True

    def resume(self) -> None:
        self.stopped = False
        self.events.append(("let go", time.monotonic()))


def _slot_in_window_and_a_timing(lock: DeviceLock, window_s: float):
    """One thread holds its share inside ``pausable`` for ``window_s``; another times (0.1 s) once the first is
    in its window. Returns the events, the worker and the timing's (start, end, paused) as it saw them."""
    events: list[tuple[str, float]] = []
    worker = Stoppable(events)
    in_window = threading.Event()
    timing: dict[str, float] = {}

    def evaluation():
        with lock.shared():
            with lock.pausable(worker):
                in_window.set()
                time.sleep(window_s)
            events.append(("left window", time.monotonic()))

    def timer():
        assert in_window.wait(5)
        with lock.shared():
            with lock:
                timing.update(start=time.monotonic(), paused=lock.paused, stopped=worker.stopped)
                time.sleep(0.1)
                timing["end"] = time.monotonic()

    assert run_together(evaluation, timer)
    return events, worker, timing


def test_with_pause_a_timing_stops_a_neighbour_in_its_window_instead_of_waiting_for_it():
    lock = DeviceLock(pause=True)
    events, worker, timing = _slot_in_window_and_a_timing(lock, window_s=1.0)
    left = dict(events)["left window"]
    # It timed while the neighbour was still in its window (1 s), with the neighbour's process stopped first.
    assert timing["end"] < left and timing["paused"] == 1 and timing["stopped"]
    assert [e for e, _ in events] == ["stopped", "let go", "left window"]
    assert dict(events)["let go"] >= timing["end"] and not worker.stopped and lock.stops == 1


def test_leaving_a_window_while_stopped_waits_for_the_timing_to_end():
    lock = DeviceLock(pause=True)
    # The window (0.02 s) ends while the timing (0.1 s) still runs: the thread must not go on meanwhile.
    events, _, timing = _slot_in_window_and_a_timing(lock, window_s=0.02)
    assert [e for e, _ in events] == ["stopped", "let go", "left window"]
    assert dict(events)["left window"] >= timing["end"]


def test_without_pause_a_window_still_holds_timing_off():
    lock = DeviceLock(pause=False)
    events, worker, timing = _slot_in_window_and_a_timing(lock, window_s=0.3)
    assert [e for e, _ in events] == ["left window"] and timing["paused"] == 0
    assert timing["start"] >= dict(events)["left window"] and lock.stops == 0


def test_a_share_outside_any_window_holds_timing_off_and_timing_inside_a_window_is_refused():
    lock = DeviceLock(pause=True, trace=True)
    worker, other_in = Stoppable([]), threading.Event()

    def evaluation():
        with lock.shared():
            with lock.pausable(worker):
                with shared_use(lock):  # a nested share in a window is not stopped for: it may start processes
                    other_in.set()
                    time.sleep(0.2)

    def timer():
        assert other_in.wait(5)
        with lock.shared():
            with lock:
                time.sleep(0.05)

    assert run_together(evaluation, timer)
    assert overlapping(lock.holds) == [] and lock.stops == 0
    with lock.shared(), lock.pausable(worker), pytest.raises(RuntimeError, match="inside a pausable window"):
        with lock:
            pass
    with lock.shared():  # the refusal gave nothing up: the lock still serves shares and timing
        with lock:
            pass
    assert lock._readers == 0 and not lock._writer and not lock._windows


@pytest.mark.slow
def test_a_cpu_slot_times_while_another_slots_reference_starts_and_both_rewards_hold(cache_dir, examples, tmp_path):
    """``pause`` with two evaluators on one lock: one whose reference is kept times while the other's reference
    is still starting (its task's import sleeps 6 s) by stopping that reference, not waiting for it; both are
    correct, and the first's reward is the one it got with the device to itself."""
    from cuda_agent import Evaluator, load_candidate, load_task
    from cuda_agent.evaluate import Timeouts

    source = (examples / "cpu_swish" / "model.py").read_text()
    (tmp_path / "model.py").write_text("import time\ntime.sleep(6)  # a slow start\n" + source)
    task, sleepy = load_task(examples / "cpu_swish" / "model.py"), load_task(tmp_path / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    lock = DeviceLock(pause=True)
    options = dict(cache_dir=cache_dir, timing_lock=lock, references=1, timeouts=Timeouts(check_s=60, load_s=180))
    with Evaluator("cpu", **options) as first, Evaluator("cpu", **options) as second:
        alone = first.evaluate(task, candidate)  # its reference is kept for the next one
        results = {}

        def starting():
            results["sleepy"] = second.evaluate(sleepy, candidate)

        def timing():
            eventually(lambda: lock._windows, timeout=60)  # the other's reference is starting
            results["kept"] = first.evaluate(task, candidate)

        assert run_together(starting, timing, timeout=300)
    assert alone.status == "correct" and results["sleepy"].status == "correct", results["sleepy"].reason
    assert results["kept"].status == "correct" and results["kept"].reward == alone.reward
    assert lock.stops >= 1  # the kept one timed while the other's reference was stopped in its start
    # Each evaluation says what it waited for: its neighbours on the device, a candidate process to be ready.
    assert all(r.durations["wait_timing"] >= 0 and r.durations["wait_ready"] >= 0 for r in results.values())
    assert results["sleepy"].durations["wait_idle"] >= 0  # its baselines were timed to be cached: first of its task
    assert "reference process kept" in " ".join(results["kept"].notes)


@pytest.mark.slow
def test_a_timing_does_not_wait_for_an_evaluation_whose_candidate_process_is_still_starting(cache_dir, examples,
                                                                                            monkeypatch):
    """An evaluation without a spare ready waits for its candidate's process to start (16-18 s beside an H200
    stream's second wave): in a pausable stretch, so another slot's timing stops its processes rather than waiting
    for it, and the evaluation is still correct (here the start is held 4 s longer, and a timing asks meanwhile)."""
    from cuda_agent import Evaluator, load_candidate, load_task
    from cuda_agent.evaluate import Timeouts
    from cuda_agent.evaluate.protocol.channel import Channel
    from cuda_agent.evaluate.protocol.messages import ReadyRequest

    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    lock = DeviceLock(pause=True)
    starting, timed = threading.Event(), {}
    ask_typed = Channel.ask_typed

    def slow_start(self, stage, request, reply_type, timeout_s):
        if isinstance(request, ReadyRequest):
            starting.set()
            time.sleep(4)  # the process still starting
        return ask_typed(self, stage, request, reply_type, timeout_s)

    monkeypatch.setattr(Channel, "ask_typed", slow_start)
    results = {}
    with Evaluator("cpu", cache_dir=cache_dir, timing_lock=lock, references=1,
                   timeouts=Timeouts(check_s=60, load_s=180)) as evaluator:

        def evaluation():
            results["starting"] = evaluator.evaluate(task, candidate)

        def timer():
            assert starting.wait(120)
            time.sleep(0.5)
            asked = time.monotonic()
            with lock:
                timed["waited"] = time.monotonic() - asked

        assert run_together(evaluation, timer, timeout=300)
    assert results["starting"].status == "correct", results["starting"].reason
    assert timed["waited"] < 2, timed  # not the 3.5 s left of the candidate process's start
    assert lock.stops >= 1  # it stopped the starting evaluation's processes (their share overlaps the timing)


def test_a_timing_says_how_long_it_waited_for_its_neighbours():
    lock = DeviceLock()
    holding = threading.Event()
    waited = {}

    def neighbour():
        with lock.shared():
            holding.set()
            time.sleep(0.3)

    def timer():
        assert holding.wait(5)
        with lock.shared():
            with lock:
                pass
            with lock:  # no one in the way: adds next to nothing
                pass
        waited["first"], waited["again"] = lock.take_waited(), lock.take_waited()

    assert run_together(neighbour, timer)
    assert 0.2 <= waited["first"] < 5 and waited["again"] == 0.0


def test_a_share_says_how_long_it_waited_behind_timings():
    lock = DeviceLock()
    timing = threading.Event()
    waited = {}

    def timer():
        with lock:
            timing.set()
            time.sleep(0.3)

    def evaluation():
        assert timing.wait(5)
        with lock.shared():
            pass
        with lock.shared():  # no timing in the way: adds next to nothing
            pass
        waited["first"], waited["again"] = lock.take_share_waited(), lock.take_share_waited()

    assert run_together(timer, evaluation)
    assert 0.2 <= waited["first"] < 5 and waited["again"] == 0.0


@pytest.mark.slow
def test_a_hungry_stop_leaves_the_untold_candidate_process_to_the_attempt_apart(cache_dir, examples, monkeypatch):
    """Beside another evaluator the hungry check comes as soon as the reference has loaded, before the candidate's
    process is told anything; stopped there, the same process serves the attempt apart (it had started already),
    and so does the reference, with torch.compile done before the apart turn. (The size test is the GPU's: here
    it is scripted to say "hungry" at the step beside others.)"""
    from cuda_agent import Evaluator, load_candidate, load_task
    from cuda_agent.evaluate import Timeouts, evaluator as evaluator_module
    from cuda_agent.evaluate.protocol.channel import Stop

    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    lock = DeviceLock()
    options = dict(cache_dir=cache_dir, timing_lock=lock, references=1, timeouts=Timeouts(check_s=60, load_s=180))
    taken, asked = [], []
    real_take = evaluator_module.take_workers

    def take(spare, setup):
        taken.append(real_take(spare, setup))
        return taken[-1]

    with Evaluator("cpu", **options) as evaluator, Evaluator("cpu", **options):  # a second slot on the device
        def hungry(loaded, ahead=lambda: None):
            asked.append((lock.step, loaded is not None, [w.job.joinpath("task.py").exists() for w in taken]))
            if lock.step == "shared":
                ahead()
                raise Stop("error", "reference", "its output (scripted) is at least 1/64 of the GPU's memory",
                           rule=MEMORY_HUNGRY)

        monkeypatch.setattr(evaluator, "_stop_if_hungry", hungry)
        monkeypatch.setattr(evaluator_module, "take_workers", take)
        result = evaluator.evaluate(task, candidate)
    assert result.status == "correct" and result.reward is not None, result.reason
    assert asked == [("shared", True, [False])]  # once, beside others, the reference loaded, the job still empty
    assert len(taken) == 2 and taken[0] is taken[1]  # the same process, untold, served the attempt apart
    assert "reference process kept" in " ".join(result.notes)  # and the same reference
    assert result.durations["baseline"] < 1.0  # torch.compile was done at the stop, before the apart turn
    assert any("evaluated apart" in note and "1/64" in note for note in result.notes), result.notes
    # What the apart attempt waited for: the turn (nobody else apart: next to nothing), its share, timings.
    assert 0 <= result.durations["wait_apart"] < 1.0
    assert result.durations["wait_share"] >= 0 and result.durations["wait_timing"] >= 0
