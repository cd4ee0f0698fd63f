"""The typed request protocol: every request survives its JSON line, parse errors name the op and
the field, and an ill-typed reply from the candidate process is a forged reply."""

from __future__ import annotations

import json

import pytest

from cuda_agent.evaluate.protocol import messages as p
from cuda_agent.evaluate.protocol.policy import Policy

TOL = Policy.preset("fair").tolerance()
TIMING = {"warmup": 3}

EXAMPLES = [
    p.LoadRequest(task_file="t.py", task_name="t", task_source="src", device="cpu", tf32="on", init_seed=5,
                  state_dict_path="sd.pt", allowed_aten=["aten::add"],
                  warm=p.ExpectRequest(seed=1, strict=True, slack=2.0, **TOL)),
    p.LoadRequest(task_file="t.py", task_name="t", task_source="src", device="cuda", tf32="off", init_seed=5,
                  state_dict_path="sd.pt", model_new_file="model_new.py", modules={"ext": "/x/ext.so"}),
    p.ReadyRequest(),
    p.WeightsRequest(state_dict_path="sd.pt"),
    p.AttachRequest(bytes=4096),
    p.RunRequest(seed=7, dir="out", profile=True),
    p.RunRequest(seed=8, dir="out", outside=True),
    p.CalibrateRequest(seed=7, timing=TIMING),
    p.CalibrateRequest(seed=7, timing=TIMING, side="eager"),
    p.TimeRequest(seed=1, first=0, trials=3, calls=2, timing=TIMING, probe=7),
    p.TimeRequest(seed=1, first=6, trials=3, calls=2, timing=TIMING, side="compile"),
    p.TimedRequest(),
    p.OutputRequest(index=3, dir="out"),
    p.ExpectRequest(seed=9, **TOL),
    p.ReleaseRequest(ended=True),
    p.CompareRequest(dir="out", manifest={"kind": "tensor"}, **TOL),
    p.DegenerateRequest(seeds=[1, 2, 3], **TOL),
    p.CompileRequest(seed=11),
    p.RecordsRequest(checks=[p.RecordCheck(seed=5, probe=6, record=p.CallRecord(
        index=2, outputs=[p.LeafSample(shape=[2, 3], dtype="float32", values=[0.5, -1.0])],
        inputs=[p.LeafSample(shape=[2, 3], dtype="float32", values=[2.0])]))], **TOL),
    p.SampleRequest(dir="out", manifest={"kind": "tensor"}, probe=6),
    p.ReadGpuRequest(held=p.GpuHeld(ids=[7], new=[0]), sizes=[2 << 20], reads=[[0, 4096, 4]], apart_s=0.001),
    p.DrawRequest(seeds=[3, 4], leaves=[[["float32", [2, 3], [3, 1]]], [["float32", [2, 3], [3, 1]]]], send=True),
    p.WriteGpuRequest(held=p.GpuHeld(ids=[7, 9], new=[1], drop=[3]), sizes=[2 << 20, 2 << 20], offsets=[0, 2 << 20],
                      seeds=[5], leaves=[[["float32", [2, 3], [3, 1], 4096]]], flush_bytes=1 << 20),
    p.KeepGpuRequest(held=p.GpuHeld(ids=[7], new=[0]), sizes=[2 << 20], offsets=[0],
                     leaves=[["float32", [2, 3], [3, 1], 4096]], call=24),
    p.QuietRequest(within_s=2.0),
    p.AfterDoneRequest(region=3, within_s=2.0, page=True),
    p.ScreenCheckRequest(path="program.py", name="p", seeds=[1, 2, 3], stochastic_ops=["torch.dropout"], **TOL),
    p.ScreenTimeRequest(compiled=True, tf32="torch"),
    p.ScreenCompileRequest(),
]


def test_every_request_kind_has_an_example():
    kinds = {type(e) for e in EXAMPLES}
    assert set(p.REQUESTS.values()) | set(p.SCREEN_REQUESTS.values()) == kinds
    assert all(cls.op == op for op, cls in p.REQUESTS.items())
    assert set(p.REQUESTS) == {"ready", "load", "weights", "attach", "run", "calibrate", "time", "timed", "output", "expect",
                               "release", "compare", "degenerate", "compile", "records", "sample",
                               "read_gpu", "draw", "write_gpu", "keep_gpu", "quiet", "after_done"}
    assert set(p.SCREEN_REQUESTS) == {"check", "time", "compile"}


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda r: type(r).__name__)
def test_requests_round_trip_through_a_json_line(request_):
    message = json.loads(json.dumps(request_.to_message()))
    assert message["op"] == request_.op
    assert type(request_).from_message(message) == request_
    registry = p.SCREEN_REQUESTS if type(request_).__name__.startswith("Screen") else p.REQUESTS
    op = message.pop("op")
    assert p.parse_request(op, message, registry) == request_


def test_optional_fields_left_unset_are_left_out():
    assert p.CalibrateRequest(seed=1, timing={}).to_message() == {"op": "calibrate", "seed": 1, "timing": {}}
    assert p.TimedRequest().to_message() == {"op": "timed"}


def test_parse_errors_name_the_op_and_the_field():
    with pytest.raises(ValueError, match=r"'run' request: missing field 'dir'"):
        p.RunRequest.from_message({"seed": 1})
    with pytest.raises(ValueError, match=r"'run' request: unexpected field 'secret'"):
        p.RunRequest.from_message({"seed": 1, "dir": "d", "secret": 2})
    with pytest.raises(ValueError, match=r"'run' request: field 'seed' must be an integer"):
        p.RunRequest.from_message({"seed": "1", "dir": "d"})
    with pytest.raises(ValueError, match=r"'load' request: field 'warm': missing field 'seed'"):
        p.LoadRequest.from_message(EXAMPLES[0].to_message() | {"warm": {"op": "expect", **TOL}})
    with pytest.raises(ValueError, match=r"op is 'run', not 'output'"):
        p.OutputRequest.from_message({"op": "run", "index": 1, "dir": "d"})
    with pytest.raises(ValueError, match=r"unknown request 'fly'"):
        p.parse_request("fly", {})


def test_replies_are_type_checked():
    reply = p.TimedReply.from_reply({"ok": True, "seconds": 0.1, "checked": [{"index": 2, "fingerprint": [[1], "x"]}]})
    assert reply.checked == [p.TimedCall(index=2, fingerprint=[[1], "x"])]
    assert p.LoadReply.from_reply({"ok": True}) == p.LoadReply()
    assert p.LoadReply.from_reply({"parameters": 3, "share": {"shared": True, "bytes": 8, "pinned": False}}).share.bytes == 8
    for cls, bad, field in [
        (p.TimeReply, {"samples": "fast"}, "samples"),
        (p.TimeReply, {"samples": [1.0, True]}, r"samples'\[1\]"),
        (p.CalibrateReply, {"estimate_ms": None}, "estimate_ms"),
        (p.CalibrateReply, {"estimate_ms": 1.0, "call_ms": "short"}, "call_ms"),
        (p.TimedReply, {"checked": [{"index": "0", "fingerprint": []}]}, "index"),
        (p.RunReply, {"fingerprint": [], "manifest": []}, "manifest"),
        (p.RunReply, {"fingerprint": [], "manifest": {}, "described": [1]}, "described"),
        (p.ExpectReply, {"fingerprint": []}, "output_bytes"),
        (p.OutputReply, {"manifest": {}, "extra": 1}, "extra"),
    ]:
        with pytest.raises(ValueError, match=field):
            cls.from_reply(bad)


def test_policy_tolerance():
    policy = Policy.preset("paper")
    assert policy.tolerance() == {"atol": policy.atol, "rtol": policy.rtol, "scale": policy.scale_tolerance}


def test_serve_answers_a_request_that_does_not_parse_with_an_error(monkeypatch):
    import os
    import threading

    from cuda_agent.evaluate.worker.loop import ReferenceSide, serve

    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    monkeypatch.setenv("CUDA_AGENT_REQUEST_FD", str(req_r))
    monkeypatch.setenv("CUDA_AGENT_RESPONSE_FD", str(resp_w))
    monkeypatch.delenv("CUDA_AGENT_FD_SOCKET", raising=False)
    thread = threading.Thread(target=serve, args=(ReferenceSide(),), daemon=True)
    thread.start()
    lines = [{"op": "fly", "nonce": "a"}, {"op": "compare", "dir": "d", "nonce": "b"}, {"op": "exit", "nonce": "c"}]
    os.write(req_w, "".join(json.dumps(line) + "\n" for line in lines).encode())
    thread.join(30)
    os.close(req_w)
    with os.fdopen(resp_r, "rb") as replies:
        unknown, missing, done = [json.loads(line) for line in replies.read().splitlines()]
    assert not unknown["ok"] and unknown["nonce"] == "a" and "unknown request 'fly'" in unknown["error"]
    assert not missing["ok"] and "'compare' request: missing field 'manifest', 'atol', 'rtol'" in missing["error"]
    assert done == {"ok": True, "nonce": "c"}


class FakeWorker:
    """Answers every request with ``reply``; records what was sent and whether it was killed."""

    def __init__(self, reply):
        self.reply, self.sent, self.killed = reply, [], False

    def send(self, message):
        self.sent.append(message)

    def receive(self, timeout_s):
        return dict(self.reply)

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("reply", [
    {"ok": True, "samples": "fast"},
    {"ok": True, "samples": [1.0, "2"]},
    {"ok": True},
    {"ok": True, "samples": [1.0], "verdict": "accept"},
])
def test_an_ill_typed_candidate_reply_is_a_forged_reply(reply):
    from cuda_agent.evaluate.protocol.channel import Channel, Stop

    request = p.TimeRequest(seed=1, first=0, trials=1, calls=1, timing=TIMING, probe=3)
    worker = FakeWorker(reply)
    with pytest.raises(Stop) as stop:
        Channel(worker, "candidate").ask_typed("profile", request, p.TimeReply, 5)
    assert (stop.value.status, stop.value.stage, stop.value.rule) == ("failed", "profile", "forged-reply")
    assert "ill-formed reply" in stop.value.reason
    assert worker.sent == [request.to_message()] and worker.killed

    worker = FakeWorker(reply)
    with pytest.raises(Stop) as stop:
        Channel(worker, "reference").ask_typed("baseline", request, p.TimeReply, 5)
    assert (stop.value.status, stop.value.rule) == ("error", None)


def test_a_well_typed_reply_is_parsed():
    from cuda_agent.evaluate.protocol.channel import Channel

    worker = FakeWorker({"ok": True, "seconds": 0.5, "samples": [1.0, 2]})
    reply = Channel(worker, "candidate").ask_typed("profile", p.TimedRequest(), p.TimeReply, 5)
    assert reply == p.TimeReply(samples=[1.0, 2]) and not worker.killed
    assert worker.sent == [{"op": "timed"}]


def test_a_time_reply_carries_typed_records_and_refuses_ill_typed_ones():
    record = {"index": 4, "outputs": [{"shape": [3], "dtype": "float32", "values": [1.0, float("nan")]}], "inputs": []}
    reply = p.TimeReply.from_reply({"ok": True, "samples": [1.0], "records": [record]})
    assert reply.records[0].index == 4 and reply.records[0].outputs[0].values[0] == 1.0
    with pytest.raises(ValueError, match=r"records.*values.*must be a number"):
        p.TimeReply.from_reply({"ok": True, "samples": [1.0], "records": [record | {
            "outputs": [{"shape": [3], "dtype": "float32", "values": ["1.0"]}]}]})


def test_stop_keeps_the_workers_own_words():
    from cuda_agent.evaluate.protocol.channel import Channel, Stop

    worker = FakeWorker({"ok": False, "kind": "exception", "error": "ValueError: no"})
    with pytest.raises(Stop) as stop:
        Channel(worker, "screening").ask("screen", p.ScreenCompileRequest(), 5)
    assert stop.value.answered and stop.value.detail == "ValueError: no"
    assert stop.value.reason == "screening: exception: ValueError: no"
