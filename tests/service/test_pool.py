"""The service's scheduler with scripted slots (test doubles for evaluators): back-pressure, retry
when a slot dies, exactly-once answers, timeouts and counters."""

from __future__ import annotations

import threading
import time

import pytest

from cuda_agent.service import EvalService, Job, ServiceError, SlotLost
from cuda_agent.tasks import Task

TASK = Task(name="t", code="class Model: pass", source="t.py")


class ScriptedSlot:
    """Answers ``{"job": id, "slot": name}``; ``script[n]`` (by the slot's creation order) may say what
    its jobs do instead: "die" (SlotLost), "hang" (never answers until closed), "raise", or an Event
    to wait for."""

    def __init__(self, name: str, behaviour=None, log=None):
        self.name = name
        self.behaviour = behaviour
        self.log = log if log is not None else []
        self.closed = threading.Event()

    def run(self, job: Job, built=None):
        self.log.append((self.name, job.id))
        if isinstance(self.behaviour, threading.Event):
            self.behaviour.wait(10)
        elif self.behaviour == "die":
            raise SlotLost(f"{self.name} died")
        elif self.behaviour == "hang":
            self.closed.wait(10)
            return {"job": job.id, "slot": self.name, "late": True}
        elif self.behaviour == "raise":
            raise RuntimeError("the harness broke")
        return {"job": job.id, "slot": self.name}

    def close(self):
        self.closed.set()


def factory(behaviours, log):
    """make_slot: the n-th slot created gets ``behaviours[n]`` (None once they run out)."""
    made = []

    def make_slot(index):
        behaviour = behaviours[len(made)] if len(made) < len(behaviours) else None
        slot = ScriptedSlot(f"s{index}-{len(made)}", behaviour, log)
        made.append(slot)
        return slot
    return make_slot, made


def baseline_job():
    return Job("baseline", TASK)


def test_every_job_is_answered_once_with_its_own_result():
    log = []
    make_slot, made = factory([], log)
    with EvalService(make_slot, 2) as service:
        jobs = [baseline_job() for _ in range(20)]
        replies = [f.result(10) for f in [service.submit(j) for j in jobs]]
    assert [r.result["job"] for r in replies] == [j.id for j in jobs]
    assert all(r.ok and r.attempts == 1 for r in replies)
    assert sorted(job for _, job in log) == sorted(j.id for j in jobs)  # each ran exactly once
    assert {r.slot for r in replies} == {"s0-0", "s1-1"}  # both slots worked


def test_a_full_queue_refuses_or_waits():
    gate = threading.Event()
    make_slot, _ = factory([gate], [])
    service = EvalService(make_slot, 1, queue_size=2)
    try:
        first = service.submit(baseline_job())
        deadline = time.monotonic() + 5
        while service.stats()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = [service.submit(baseline_job()) for _ in range(2)]
        with pytest.raises(ServiceError) as refused:
            service.submit(baseline_job(), block=False)
        assert refused.value.kind == "overloaded"
        with pytest.raises(ServiceError):
            service.submit(baseline_job(), timeout=0.2)
        assert service.stats()["queue"] == 2 and service.stats()["counts"]["refused"] == 2
        gate.set()
        assert all(f.result(10).ok for f in [first, *queued])
    finally:
        service.close()


def test_a_job_whose_slot_dies_runs_again_on_a_fresh_slot_and_is_answered_once():
    log = []
    make_slot, made = factory(["die"], log)
    with EvalService(make_slot, 1, retries=2) as service:
        job = baseline_job()
        reply = service.run(job, timeout=10)
        stats = service.stats()
    assert reply.ok and reply.attempts == 2 and reply.result["job"] == job.id
    assert [name for name, _ in log] == ["s0-0", "s0-1"]  # ran on the dead slot, then on its replacement
    assert made[0].closed.is_set()
    assert stats["counts"]["retried"] == 1 and stats["counts"]["done"] == 1 and stats["counts"]["slot_lost"] == 1
    assert stats["slots"][0]["lost"] == 1


def test_a_job_that_kills_every_slot_fails_as_lost_after_its_retries():
    make_slot, made = factory(["die", "die", "die", "die"], [])
    with EvalService(make_slot, 1, retries=2) as service:
        reply = service.run(baseline_job(), timeout=10)
        follow = service.run(baseline_job(), timeout=10)  # the slot after that serves again
    assert not reply.ok and reply.kind == "lost" and reply.attempts == 3
    assert follow.ok and len(made) == 5


def test_a_timed_out_job_fails_once_and_its_late_answer_is_dropped():
    make_slot, made = factory(["hang"], [])
    with EvalService(make_slot, 1, job_timeout_s=0.3) as service:
        hung = service.submit(baseline_job())
        reply = hung.result(10)
        after = service.run(baseline_job(), timeout=10)
        time.sleep(0.2)  # the hung call returns once its slot is closed; nothing may change
        stats = service.stats()
    assert not reply.ok and reply.kind == "timeout"
    assert hung.result() is reply
    assert after.ok and after.slot == "s0-1"
    assert stats["counts"].get("done") == 1 and stats["counts"]["failed_timeout"] == 1


def test_an_exception_in_a_slot_is_the_jobs_answer_and_the_slot_stays():
    make_slot, made = factory(["raise"], [])
    with EvalService(make_slot, 1) as service:
        reply = service.run(baseline_job(), timeout=10)
    assert not reply.ok and reply.kind == "internal" and "the harness broke" in reply.error
    assert len(made) == 1


def test_counters_show_rate_and_busy_share():
    gate = threading.Event()
    make_slot, _ = factory([gate], [])
    with EvalService(make_slot, 1, info={"device": "cpu"}) as service:
        blocked = service.submit(baseline_job())
        time.sleep(0.2)
        busy = service.stats()
        gate.set()
        blocked.result(10)
        for _ in range(5):
            service.run(baseline_job(), timeout=10)
        stats = service.stats()
    assert busy["in_flight"] == 1 and busy["slots"][0]["busy"] and busy["device"] == "cpu"
    assert stats["counts"]["done"] == 6 and stats["per_second"] > 0
    assert 0 < stats["busy_share"] <= 1


def test_close_answers_what_is_still_waiting():
    gate = threading.Event()
    make_slot, _ = factory([gate], [])
    service = EvalService(make_slot, 1)
    running = service.submit(baseline_job())
    time.sleep(0.1)
    waiting = service.submit(baseline_job())
    gate.set()
    service.close()
    assert waiting.result(5).kind == "lost" or waiting.result(5).ok
    assert running.result(5).ok
    with pytest.raises(ServiceError):
        service.submit(baseline_job())


def test_bad_jobs_are_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="unknown job op"):
        Job("train", TASK)
    with pytest.raises(ValueError, match="needs a candidate"):
        Job("evaluate", TASK)
    with pytest.raises(ValueError, match="lacks code"):
        Job.from_dict({"op": "baseline", "task": {"name": "x", "source": "x.py"}})


def test_a_free_slot_prefers_jobs_of_the_tasks_it_served():
    log = []

    class Slow(ScriptedSlot):
        def run(self, job, built=None):
            time.sleep(0.02)
            log.append((self.name, job.task.name))
            return {}

    tasks = [Task(name=n, code=f"# {n}\nclass Model: pass", source=f"{n}.py") for n in ("a", "b")]
    service = EvalService(lambda i: Slow(f"s{i}"), 2)
    try:
        futures = [service.submit(Job("baseline", tasks[i % 2])) for i in range(12)]
        assert all(f.result(10).ok for f in futures)
        stats = service.stats()
    finally:
        service.close()
    served = {name: {task for slot, task in log if slot == name} for name in ("s0", "s1")}
    assert sorted(map(sorted, served.values())) == [["a"], ["b"]], log  # each slot kept to one task
    assert stats["counts"]["affine"] >= 8


def test_affinity_never_starves_the_head_of_the_queue(monkeypatch):
    import cuda_agent.service.pool as pool

    monkeypatch.setattr(pool, "AFFINITY_WAIT_S", 0.0)  # the head has always waited long enough
    log = []
    make_slot, _ = factory([], log)
    tasks = [Task(name=n, code=f"# {n}", source=f"{n}.py") for n in ("a", "b")]
    with EvalService(make_slot, 1) as service:
        jobs = [Job("baseline", tasks[i % 2]) for i in range(6)]
        gate = threading.Event()
        service._slots[0].slot.behaviour = gate  # hold the first job so the rest queue up in order
        futures = [service.submit(job) for job in jobs]
        time.sleep(0.1)
        service._slots[0].slot.behaviour = None
        gate.set()
        assert all(f.result(10).ok for f in futures)
    assert [job for _, job in log] == [j.id for j in jobs]  # strict order: no job skipped


def test_jobs_being_built_when_the_service_closes_are_answered():
    started, release = threading.Event(), threading.Event()

    def builder(candidate):
        started.set()
        release.wait(10)
        return None

    from cuda_agent.candidates import Candidate

    candidate = Candidate(model_new="class ModelNew: pass", extensions=(), kind="python", origin="x")
    make_slot, _ = factory([], [])
    service = EvalService(make_slot, 1, builder=builder, build_workers=1)
    future = service.submit(Job("evaluate", TASK, candidate))
    assert started.wait(5) and service.stats()["building"] == 1
    closer = threading.Thread(target=service.close)
    closer.start()
    time.sleep(0.1)
    release.set()
    closer.join(10)
    reply = future.result(5)
    assert not reply.ok and reply.kind == "lost"


def test_slots_on_one_device_share_one_reference_pool():
    """A task's reference is started once for the slots of a device (local_service): as many kept as the
    slots would keep apart (on the CPU, long_lived keeps one each)."""
    from cuda_agent.service import local_service

    with local_service("cpu", slots=2, references=2, sandbox="none") as service:
        pools = [state.slot.evaluator.references for state in service._slots]
        assert pools[0] is pools[1] and pools[0].capacity == 4 and pools[0].wait_s > 0
    with local_service("cpu", slots=2, sandbox="none") as service:
        pools = [state.slot.evaluator.references for state in service._slots]
        assert pools[0] is pools[1] and pools[0].capacity == 2


@pytest.mark.parametrize("one_per_task", [True, False])
def test_slots_sharing_references_take_one_job_of_a_task_at_a_time(one_per_task):
    """With ``one_per_task`` a free slot passes over a job of a task another slot is evaluating (it would wait
    there for the task's one reference) and takes a later job of another task; without it, the first job."""
    log, gate = [], threading.Event()

    class Gated(ScriptedSlot):
        def run(self, job, built=None):
            log.append((self.name, job.task.name, "start"))
            if job.task.name == "a" and not gate.is_set():
                gate.wait(5)
            else:
                time.sleep(0.05)
            log.append((self.name, job.task.name, "end"))
            return {}

    a, b = (Task(name=n, code=f"# {n}\nclass Model: pass", source=f"{n}.py") for n in ("a", "b"))
    service = EvalService(lambda i: Gated(f"s{i}"), 2, one_per_task=one_per_task)
    try:
        first = service.submit(Job("baseline", a))
        time.sleep(0.1)  # a's first job is running
        later = [service.submit(Job("baseline", task)) for task in (a, b)]
        time.sleep(0.3)
        started_while_a_ran = [task for _, task, what in log[1:] if what == "start"]
        gate.set()
        assert all(f.result(10).ok for f in [first, *later])
    finally:
        service.close()
    # Without it the free slot took the queue's first job, a's second, which then waited (here on the gate).
    assert started_while_a_ran == (["b"] if one_per_task else ["a"]), log
    if one_per_task:
        starts = [(task, i) for i, (_, task, what) in enumerate(log) if what == "start"]
        ends = [i for i, (_, task, what) in enumerate(log) if what == "end" and task == "a"]
        assert starts[-1][0] == "a" and starts[-1][1] > ends[0]  # a's second job after its first ended


BUSY_REASON = "the host was busy with other work while the baselines were timed: evaluate again when the host is quieter"


class UndecidedOnce(ScriptedSlot):
    """An evaluation slot: the first evaluation of all has no verdict for a busy host, every other is correct."""

    first = [True]

    def run(self, job, built=None):
        self.log.append((self.name, job.id))
        if self.first[0]:
            self.first[0] = False
            return {"status": "error", "reason": BUSY_REASON, "reward": None, "attempts": 1}
        return {"status": "correct", "reward": 1.0, "attempts": 1, "slot": self.name}


def evaluate_job():
    from cuda_agent.candidates import Candidate

    return Job("evaluate", TASK, Candidate(model_new="class ModelNew: pass", extensions=(), kind="python", origin="x"))


def test_a_no_verdict_goes_back_to_the_queue_for_another_slot_and_counts_its_attempts():
    log = []
    UndecidedOnce.first = [True]
    with EvalService(lambda i: UndecidedOnce(f"s{i}", None, log), 2, verdict_backoff_s=0.05) as service:
        reply = service.run(evaluate_job(), timeout=20)
        counts = service.stats()["counts"]
    assert reply.ok and reply.result["status"] == "correct" and reply.result["reward"] == 1.0
    names = [name for name, _ in log]
    assert reply.result["attempts"] == 2 and len(names) == 2 and names[0] != names[1]  # the other slot took it
    assert counts["no_verdict_retried"] == 1


def test_a_no_verdict_that_stays_is_answered_as_one_after_the_budget():
    class Busy(ScriptedSlot):
        def run(self, job, built=None):
            self.log.append(self.name)
            return {"status": "error", "reason": BUSY_REASON, "reward": None, "attempts": 1}

    log = []
    with EvalService(lambda i: Busy(f"s{i}", None, log), 1, verdict_retries=2, verdict_backoff_s=0.01) as service:
        reply = service.run(evaluate_job(), timeout=20)
    assert reply.ok and reply.result["status"] == "error" and reply.result["reward"] is None
    assert reply.result["attempts"] == 3 and len(log) == 3


def test_a_failure_or_a_harness_error_is_answered_at_once():
    class Harness(ScriptedSlot):
        def run(self, job, built=None):
            self.log.append(self.name)
            return {"status": "error", "reason": "the toolchain probe extension does not build", "reward": None}

    log = []
    with EvalService(lambda i: Harness(f"s{i}", None, log), 2, verdict_backoff_s=0.01) as service:
        reply = service.run(evaluate_job(), timeout=20)
    assert reply.result["status"] == "error" and len(log) == 1
