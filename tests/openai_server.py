"""A local server speaking the OpenAI chat-completions protocol, for tests (a test double: the
"model" is a Python function of the request)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Reply = Callable[[dict[str, Any]], "str | dict[str, Any] | tuple[int, dict[str, Any]]"]


class OpenAIServer:
    """``with OpenAIServer(reply) as server: OpenAI(base_url=server.url, ...)``.

    ``reply(request)`` returns the assistant's text, or the assistant message as a dict (e.g.
    ``{"content": None, "tool_calls": [...]}``, answered with finish_reason "tool_calls" when it
    has any), or ``(status, body)`` to answer with an HTTP error. Every request body is kept in
    ``requests``.
    """

    def __init__(self, reply: Reply):
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.requests.append(body | {"_path": self.path, "_auth": self.headers.get("Authorization")})
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                answer = server.reply(body)
                if isinstance(answer, tuple):
                    return self._send(*answer)
                message = {"role": "assistant"} | (answer if isinstance(answer, dict) else {"content": answer})
                prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
                completion_tokens = len(str(message.get("content") or "").split()) + sum(
                    len(json.dumps(call).split()) for call in message.get("tool_calls") or [])
                self._send(200, {
                    "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "test"),
                    "choices": [{"index": 0, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                                 "message": message}],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens},
                })

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test): nothing to answer

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> "OpenAIServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
