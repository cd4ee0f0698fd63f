"""What crosses the service's wire is checked before anything is written, and a service bound beyond the
loopback answers only clients that carry its token."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from cuda_agent import load_candidate, load_task
from cuda_agent.build import build
from cuda_agent.candidates import Extension
from cuda_agent.candidates.candidate import Candidate
from cuda_agent.evaluate import Policy, TimingConfig
from cuda_agent.service import EvalService, Job, LocalSlot, RemoteEvaluator, ServiceError, make_server
from cuda_agent.service.messages import TOKEN_ENV, candidate_from_wire, candidate_to_wire, task_to_wire

from tests.service.test_http import EchoEvaluator

ESCAPES = ["../../../../../x.py", "/etc/x.cpp", "kernels/../../x.cpp", "kernels//x.cpp", "./x.cpp", "x\x00.cpp",
           "kernels\\..\\x.cpp", "~/x.cpp", "a/" * 20 + "x.cpp", "x" * 300 + ".cpp", "kernels/x.py"]


def _wire(examples, sources=None, name="cuda_extension"):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    wire = candidate_to_wire(candidate)
    if sources is not None:
        wire["extensions"][0]["sources"] = sources
    wire["extensions"][0]["name"] = name
    return wire


@pytest.mark.parametrize("path", ESCAPES)
def test_a_source_path_that_leaves_the_layout_is_refused_on_the_wire(path, examples):
    with pytest.raises(ValueError, match="source path|identifier|NUL"):
        candidate_from_wire(_wire(examples, {path: "int x;\n"}))


@pytest.mark.parametrize("name", ["../x", "a/b", "", "1x", "x y", "é" * 3, "x" * 100])
def test_an_extension_name_must_be_an_identifier(name, examples):
    with pytest.raises(ValueError, match="extension name"):
        candidate_from_wire(_wire(examples, name=name))


def test_counts_and_sizes_are_bounded(examples):
    with pytest.raises(ValueError, match="over 256"):
        candidate_from_wire(_wire(examples, {f"kernels/k{i}.cpp": "" for i in range(300)}))
    with pytest.raises(ValueError, match="over"):
        candidate_from_wire(_wire(examples, {"kernels/k.cpp": "x" * (5 * 1024 * 1024)}))
    wire = _wire(examples)
    wire["extensions"][0]["cflags"] = ["-O2"] * 100
    with pytest.raises(ValueError, match="cflags"):
        candidate_from_wire(wire)
    wire = _wire(examples)
    wire["extensions"] = "not a list"
    with pytest.raises(ValueError, match="list"):
        candidate_from_wire(wire)


def test_an_honest_candidate_still_crosses_the_wire(examples):
    candidate = load_candidate(examples / "cpu_swish" / "solution")
    assert candidate_from_wire(json.loads(json.dumps(candidate_to_wire(candidate)))) == candidate


def test_the_builder_refuses_a_path_outside_its_source_root_itself(tmp_path):
    """Defence in depth: a candidate that never crossed the wire (a library caller's) is refused by the
    builder, before anything is written."""
    target = tmp_path / "escaped.cpp"
    rel = "../" * 12 + str(target).lstrip("/")
    candidate = Candidate(model_new="class ModelNew: pass\n", kind="workspace", origin="test",
                          extensions=(Extension(name="cuda_extension", sources={rel: "int escaped;\n"}),))
    result = build(candidate, "cpu", cache_dir=tmp_path / "cache")
    assert not result.ok and "source path" in (result.error or ""), result.error
    assert not target.exists()
    assert not list(tmp_path.rglob("escaped.cpp"))


@pytest.fixture
def echo_service():
    info = {"device": "cpu", "backend": "test", "slots_total": 1, "policy": Policy.preset("strict").to_dict(),
            "timing": TimingConfig().resolved("cpu").to_dict()}
    service = EvalService(lambda i: LocalSlot(f"echo-{i}", EchoEvaluator()), 1, queue_size=2, info=info)
    yield service
    service.close()


def _serve(service, host, token):
    server = make_server(service, host, 0, token=token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_job_with_an_escaping_path_is_answered_400_and_writes_nothing(echo_service, examples, tmp_path):
    server, url = _serve(echo_service, "127.0.0.1", None)
    try:
        task = load_task(examples / "cpu_swish" / "model.py")
        job = {"op": "build", "candidate": _wire(examples, {"../../../../../iso-escape.py": "x = 1\n"}),
               "task": task_to_wire(task)}
        request = urllib.request.Request(url + "/jobs", data=json.dumps(job).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 400
        assert "source path" in json.loads(caught.value.read())["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_serving_beyond_the_loopback_needs_a_token(echo_service):
    with pytest.raises(ValueError, match="needs a token"):
        make_server(echo_service, "0.0.0.0", 0)
    for host in ("127.0.0.1", "localhost", "::1"):
        try:
            server = make_server(echo_service, host, 0)
        except OSError:  # no IPv6 here
            continue
        server.server_close()


def test_a_token_is_required_of_every_request_and_sent_by_the_client(echo_service, examples, monkeypatch):
    token = "s3cret-service-token"
    server, url = _serve(echo_service, "0.0.0.0", token)
    try:
        for path in ("/info", "/stats"):
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(url + path, timeout=30)
            assert caught.value.code == 401
        wrong = urllib.request.Request(url + "/info", headers={"Authorization": "Bearer guess"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(wrong, timeout=30)
        assert caught.value.code == 401
        job = Job("build", candidate=load_candidate(examples / "cpu_swish" / "solution"))
        post = urllib.request.Request(url + "/jobs", data=json.dumps(job.to_dict()).encode())
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(post, timeout=30)
        assert caught.value.code == 401
        with urllib.request.urlopen(url + "/health", timeout=30) as response:  # liveness only
            assert json.loads(response.read()) == {"ok": True}
        with pytest.raises(ServiceError, match="needs its token"):
            RemoteEvaluator(url)
        assert RemoteEvaluator(url, token=token).build(job.candidate).ok
        monkeypatch.setenv(TOKEN_ENV, token)
        assert RemoteEvaluator(url).build(job.candidate).ok
    finally:
        server.shutdown()
        server.server_close()


def test_serve_refuses_a_public_host_without_a_token(monkeypatch, capsys):
    from cuda_agent.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    code = main(["serve", "--device", "cpu", "--host", "0.0.0.0", "--port", "0"])
    assert code != 0
    assert "needs a token" in capsys.readouterr().err
