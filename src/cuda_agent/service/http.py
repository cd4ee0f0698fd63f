"""The service's HTTP front, for clients outside Ray (``cuda-agent eval --remote``, ``RemoteEvaluator``).

JSON over HTTP/1.1 from the standard library (the core install stays light):

- ``POST /jobs``: a ``Job`` (``service.messages``); answers its ``Reply`` when the job is done: 200 when
  it ran (``result`` is the evaluator's record, the JSON of ``eval --json``), 400 for a job that does
  not parse, 503 with ``Retry-After`` when the queue is full (back-pressure: the client waits and
  sends again), 500 when the service could not answer it.
- ``GET /info``: device, backend, slots and the policy and timing every slot evaluates under.
- ``GET /stats``: live counters (queue depth, in flight, evaluations per second, busy share).

With a ``token`` every request but ``GET /health`` must carry ``Authorization: Bearer <token>`` (401
otherwise). A server bound beyond the loopback must have one: a job runs code on the evaluator's
machines and its answers are rewards.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cuda_agent.service.messages import TOKEN_ENV, Job, Reply, ServiceError
from cuda_agent.service.pool import EvalService

__all__ = ["MAX_BODY", "is_loopback", "make_server"]

MAX_BODY = 64 * 1024 * 1024  # a job carries sources, never tensors


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def make_server(service: EvalService, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None) -> ThreadingHTTPServer:
    """An HTTP server for ``service`` (call ``serve_forever``); port 0 picks a free one
    (``server.server_address`` has it). ``token``: required of every request but /health; a ``host``
    beyond the loopback without one is refused."""
    if not token and not is_loopback(host):
        raise ValueError(f"serving on {host} reaches beyond this machine, so it needs a token: pass --token TOKEN or set "
                         f"{TOKEN_ENV} (clients set {TOKEN_ENV} to the same value), or bind 127.0.0.1")
    expected = f"Bearer {token}".encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # one line per job comes from the service's on_reply instead

        def _send(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if expected is None:
                return True
            given = (self.headers.get("Authorization") or "").encode()
            if hmac.compare_digest(given, expected):
                return True
            self._send(401, {"ok": False, "kind": "input", "error": f"this service needs its token: send 'Authorization: "
                                                                    f"Bearer TOKEN' (RemoteEvaluator: set {TOKEN_ENV})"})
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/health" and not self._authorised():
                return
            if self.path == "/info":
                self._send(200, service.info)
            elif self.path == "/stats":
                self._send(200, service.stats())
            elif self.path == "/health":
                self._send(200, {"ok": True})
            else:
                self._send(404, {"ok": False, "kind": "input", "error": f"no {self.path}; use /info, /stats or POST /jobs"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorised():
                self.close_connection = True  # its body is not read
                return
            if self.path != "/jobs":
                self._send(404, {"ok": False, "kind": "input", "error": f"no POST {self.path}; POST a job to /jobs"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._send(400, {"ok": False, "kind": "input", "error": f"a job body of {length} bytes (1 to {MAX_BODY})"})
                return
            try:
                job = Job.from_dict(json.loads(self.rfile.read(length)))
            except (ValueError, TypeError, KeyError) as exc:
                self._send(400, Reply("", False, error=f"not a job: {exc}", kind="input").to_dict())
                return
            try:
                reply = service.submit(job, block=False).result()
            except ServiceError as exc:
                self._send(503 if exc.kind == "overloaded" else 500,
                           Reply(job.id, False, error=str(exc), kind=exc.kind).to_dict(),
                           {"Retry-After": "1"} if exc.kind == "overloaded" else None)
                return
            self._send(200 if reply.ok else 500, reply.to_dict())

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise OSError(exc.errno, f"port {port} on {host} is already in use (another `cuda-agent serve`?): stop that "
                                 "server, or give another --port (--port 0 picks a free one)") from None
