"""The wire format, the HTTP front and ``RemoteEvaluator``, against a real HTTP server whose slots
hold a scripted evaluator (the real one is in test_serve.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from cuda_agent import load_candidate, load_task
from cuda_agent.build import BuildResult
from cuda_agent.evaluate import Policy, TimingConfig
from cuda_agent.evaluate.protocol.degenerate import DegenerateReport
from cuda_agent.evaluate.interface import EvaluatorLike
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.evaluate.counters import CounterReport
from cuda_agent.service import EvalService, Job, LocalSlot, RemoteEvaluator, ServiceError, make_server
from cuda_agent.service.messages import candidate_from_wire, candidate_to_wire, task_from_wire, task_to_wire


class EchoEvaluator:
    """Answers from what it was sent, so a test sees that task and candidate arrived whole."""

    def __init__(self, gate: threading.Event | None = None):
        self.gate = gate

    def evaluate(self, task, candidate, build_result=None, *, timed=True):
        if self.gate is not None:
            self.gate.wait(10)
        return EvalResult(task=task.to_dict(), candidate=candidate.to_dict(), device="cpu", policy={}, timing={},
                          status="correct", reward=3.0 if timed else None, correct=True,
                          notes=[f"{len(candidate.model_new)} chars of model_new", task.code[:40]])

    def verify(self, task, candidate, build_result=None):
        return self.evaluate(task, candidate, timed=False)

    def build(self, candidate):
        return BuildResult(ok=True, backend="cpu", key=candidate.digest[:16], modules={}, diagnostics=[])

    def baseline(self, task, refresh=False, degenerate=False):
        return {"task": task.name, "refresh": refresh}

    def check_degenerate(self, task, draws=3):
        return DegenerateReport(task=task.name, policy="fair", passing=["zeros"] * draws)

    def counters(self, task, candidate, times=None):
        return CounterReport(available=False, reason=f"echo {task.name}", times_ms=dict(times or {}))

    def close(self):
        pass


@pytest.fixture
def served():
    """(url, service, gate): a service of one echo slot behind a real HTTP server on a free port."""
    gate = threading.Event()
    gate.set()
    info = {"device": "cpu", "backend": "test", "slots_total": 1, "policy": Policy.preset("strict").to_dict(),
            "timing": TimingConfig().resolved("cpu").to_dict()}
    service = EvalService(lambda i: LocalSlot(f"echo-{i}", EchoEvaluator(gate)), 1, queue_size=1, info=info)
    server = make_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", service, gate
    server.shutdown()
    server.server_close()
    service.close()


def test_tasks_and_candidates_cross_the_wire_whole(examples):
    task = load_task(examples / "cpu_swish" / "model.py")
    for candidate in (load_candidate(examples / "cpu_swish" / "solution"),):
        back = candidate_from_wire(json.loads(json.dumps(candidate_to_wire(candidate))))
        assert back == candidate and back.digest == candidate.digest
    assert task_from_wire(json.loads(json.dumps(task_to_wire(task)))) == task
    job = Job("evaluate", task, candidate, timed=False)
    again = Job.from_dict(json.loads(json.dumps(job.to_dict())))
    assert (again.id, again.op, again.timed, again.task, again.candidate) == (job.id, "evaluate", False, task, candidate)


def test_remote_evaluator_is_an_evaluator_with_the_services_policy(served, examples):
    url, service, _ = served
    remote = RemoteEvaluator(url)
    assert isinstance(remote, EvaluatorLike)
    assert remote.device == "cpu" and remote.policy == Policy.preset("strict")
    assert remote.timing == TimingConfig().resolved("cpu")
    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    result = remote.evaluate(task, candidate)
    assert isinstance(result, EvalResult) and result.reward == 3.0
    assert result.candidate["digest"] == candidate.digest and result.task["digest"] == task.digest
    assert result.notes == [f"{len(candidate.model_new)} chars of model_new", task.code[:40]]
    assert remote.verify(task, candidate).reward is None
    assert remote.build(candidate).key == candidate.digest[:16]
    assert remote.baseline(task, refresh=True) == {"task": task.name, "refresh": True}
    assert remote.check_degenerate(task, draws=2).passing == ["zeros", "zeros"]
    report = remote.counters(task, candidate, {"candidate": 1.5})
    assert isinstance(report, CounterReport) and report.reason == f"echo {task.name}"
    assert report.times_ms == {"candidate": 1.5}
    assert remote.stats()["counts"]["done"] == 6


def test_the_front_answers_a_plain_http_client_and_refuses_what_is_not_a_job(served):
    url, _, _ = served
    with urllib.request.urlopen(url + "/stats") as response:
        assert json.loads(response.read())["slots_total"] == 1
    for body, code in ((b"{not json", 400), (json.dumps({"op": "evaluate"}).encode(), 400)):
        request = urllib.request.Request(url + "/jobs", data=body)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == code
        assert json.loads(refused.value.read())["kind"] == "input"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(url + "/nothing")
    assert missing.value.code == 404


def test_a_full_service_answers_503_and_the_client_waits_its_turn(served, examples):
    url, service, gate = served
    gate.clear()
    task = load_task(examples / "cpu_swish" / "model.py")
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    remote = RemoteEvaluator(url)
    results = []
    threads = [threading.Thread(target=lambda: results.append(remote.evaluate(task, candidate))) for _ in range(3)]
    for thread in threads:
        thread.start()
    # One job runs, one waits (queue_size=1): the third is told to come back.
    deadline = time.monotonic() + 10
    while service.stats()["counts"].get("refused", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.stats()["counts"]["refused"] >= 1
    gate.set()
    for thread in threads:
        thread.join(30)
    assert len(results) == 3 and all(r.reward == 3.0 for r in results)
    assert service.stats()["counts"]["done"] == 3


def test_no_service_is_a_clear_error():
    with pytest.raises(ServiceError, match="cuda-agent serve"):
        RemoteEvaluator("http://127.0.0.1:9")


def test_remote_evaluator_offers_the_client_interface_with_the_same_signatures():
    import inspect

    for name, member in vars(EvaluatorLike).items():
        if callable(member) and not name.startswith("_"):
            wanted, offered = inspect.signature(member), inspect.signature(getattr(RemoteEvaluator, name))
            assert list(wanted.parameters) == list(offered.parameters)[:len(wanted.parameters)], name
            assert all(offered.parameters[p].default == wanted.parameters[p].default for p in wanted.parameters), name


def test_training_stages_take_the_service_as_their_evaluator(served):
    import threading as _threading

    from cuda_agent.train.config import EvaluatorConfig, StageConfig
    from cuda_agent.train.stages import make_evaluator_factory

    url, _, _ = served
    make = make_evaluator_factory(StageConfig(evaluator=EvaluatorConfig(policy="strict", remote=url)))
    first, second = make(_threading.Lock()), make(_threading.Lock())
    assert isinstance(first, RemoteEvaluator) and first is second and first.policy.name == "strict"
    with pytest.raises(ValueError, match="evaluates under policy 'strict'"):
        make_evaluator_factory(StageConfig(evaluator=EvaluatorConfig(policy="fair", remote=url)))


def test_a_busy_port_is_named_with_the_remedy(served):
    url, service, _gate = served
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is already in use .*--port 0 picks a free one"):
        make_server(service, "127.0.0.1", port)


def test_remote_eval_shows_progress_while_the_service_works(served, examples, capsys, monkeypatch):
    from cuda_agent import cli
    from cuda_agent.cli import evaluation

    url, _service, gate = served
    monkeypatch.setattr(evaluation, "REMOTE_PROGRESS_S", 0.2)
    gate.clear()  # the slot holds the job until released
    threading.Timer(1.5, gate.set).start()
    cli.main(["eval", str(examples / "cpu_swish" / "model.py"), str(examples / "cpu_swish" / "solution"),
              "--remote", url, "--policy", "strict"])
    err = capsys.readouterr().err
    assert f"sent      to {url} (1 cpu slot(s))" in err, err
    assert "waiting   on the service: queue 0, building 0, in flight 1" in err, err
