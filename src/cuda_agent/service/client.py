"""``RemoteEvaluator``: the evaluator interface (``EvaluatorLike``) over the service's HTTP front, so
``agent``, ``bench``, ``synth`` and ``train`` take a pool of GPUs where they took an ``Evaluator``."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import fields
from typing import Any

from cuda_agent.build import BuildResult
from cuda_agent.evaluate import Policy, TimingConfig
from cuda_agent.evaluate.counters import CounterReport
from cuda_agent.evaluate.protocol.degenerate import DegenerateReport
from cuda_agent.evaluate.result import EvalResult
from cuda_agent.service.messages import TOKEN_ENV, Job, Reply, ServiceError


class RemoteEvaluator:
    """An evaluator at ``url`` (``cuda-agent serve``). Its device, policy and timing are the service's;
    a full queue is waited out (the service answers 503), up to ``timeout_s`` per job. ``token``: the
    service's bearer token (default ``$CUDA_AGENT_SERVICE_TOKEN``), needed where it serves beyond the loopback."""

    def __init__(self, url: str, timeout_s: float = 3600.0, token: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        info = self._get("/info")
        self.device: str = info["device"]
        self.policy = Policy(**{k: tuple(v) if isinstance(v, list) else v for k, v in info["policy"].items()})
        self.timing = TimingConfig.from_dict(info["timing"])
        self.info = info

    def _get(self, path: str) -> Any:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=self._headers),
                                        timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise ServiceError(f"the evaluation service at {self.url} needs its token: set {TOKEN_ENV} (or pass "
                                   "token=) to the value it was started with", "input") from None
            raise ServiceError(f"the evaluation service at {self.url} answered HTTP {exc.code} to {path}", "internal") from None
        except urllib.error.URLError as exc:
            raise ServiceError(f"no evaluation service at {self.url} ({getattr(exc, 'reason', exc)}); start one with "
                               "`cuda-agent serve --port P` and pass --remote http://HOST:P", "lost") from None

    def require_policy(self, wanted: Policy, how: str) -> None:
        """Refuse a client that asks for another policy than the service's (its slots evaluate under the
        one it was started with): ``how`` names where the client asked, for the fix."""
        if self.policy != wanted:
            differ = sorted(k for k, v in wanted.to_dict().items() if self.policy.to_dict().get(k) != v)
            raise ValueError(f"the service at {self.url} evaluates under policy {self.policy.name!r}, which differs from "
                             f"the one {how} asks for in {', '.join(differ)}; start a service with `cuda-agent serve "
                             f"--policy {wanted.name}` or change {how}.")

    def stats(self) -> dict[str, Any]:
        return self._get("/stats")

    def run(self, job: Job) -> Any:
        """Send ``job`` and return its result (JSON); a failed reply raises ``ServiceError``."""
        body = json.dumps(job.to_dict()).encode()
        deadline = time.monotonic() + self.timeout_s
        wait = 0.5
        while True:
            request = urllib.request.Request(self.url + "/jobs", data=body,
                                             headers={"Content-Type": "application/json"} | self._headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    reply = Reply.from_dict(json.loads(response.read()))
            except urllib.error.HTTPError as exc:
                try:
                    data = json.loads(exc.read() or b"{}")
                except ValueError:
                    data = {}
                reply = Reply.from_dict({"id": job.id, "error": f"HTTP {exc.code}", "kind": "internal"}
                                        | (data if isinstance(data, dict) else {}) | {"ok": False})
                if exc.code == 503 and time.monotonic() + wait < deadline:
                    time.sleep(wait)
                    wait = min(wait * 2, 10.0)
                    continue
            except urllib.error.URLError as exc:
                raise ServiceError(f"the evaluation service at {self.url} did not answer: {exc.reason}", "lost") from None
            if not reply.ok:
                raise ServiceError(f"{job.describe()}: {reply.error}", reply.kind or "internal")
            return reply.result

    # -- EvaluatorLike ---------------------------------------------------------------------
    def evaluate(self, task: Any, candidate: Any, build_result: BuildResult | None = None, *,
                 timed: bool = True) -> EvalResult:
        return EvalResult.from_dict(self.run(Job("evaluate", task, candidate, timed=timed)))

    def verify(self, task: Any, candidate: Any, build_result: BuildResult | None = None) -> EvalResult:
        return EvalResult.from_dict(self.run(Job("verify", task, candidate)))

    def build(self, candidate: Any) -> BuildResult:
        return BuildResult.from_dict(self.run(Job("build", candidate=candidate)))

    def baseline(self, task: Any, refresh: bool = False, degenerate: bool = False) -> dict[str, Any]:
        return self.run(Job("baseline", task, refresh=refresh, degenerate=degenerate))

    def check_degenerate(self, task: Any, draws: int = 3) -> DegenerateReport:
        data = self.run(Job("degenerate", task, draws=draws))
        return DegenerateReport(**{f.name: data[f.name] for f in fields(DegenerateReport)})

    def counters(self, task: Any, candidate: Any, times: dict[str, float] | None = None) -> CounterReport:
        return CounterReport.from_dict(self.run(Job("counters", task, candidate, times=times)))

    def close(self) -> None:
        """Nothing to stop here: the service's slots are its own."""

    def __enter__(self) -> "RemoteEvaluator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
