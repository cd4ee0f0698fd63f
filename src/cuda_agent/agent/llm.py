"""The agent's model backends: one chat request per turn, tool calls in and out.

Any OpenAI-compatible chat-completions endpoint works (vLLM, SGLang, hosted APIs), through the
``openai`` SDK (``pip install -e '.[llm]'``). Tool calls travel in one of two formats:

- ``"native"``: the request's ``tools=`` and the reply's ``tool_calls`` (hosted APIs, or vLLM and
  SGLang served with a tool-call parser);
- ``"hermes"``: the schemas in the system message and ``<tool_call>{...}</tool_call>`` blocks in the
  text, for models such as Qwen or Hermes served without a tool parser.

The loop keeps its history in OpenAI format either way; the hermes backend renders it anew on
each request, so one history serves both formats.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse

__all__ = ["ToolCall", "Usage", "Reply", "ChatBackend", "BackendError", "assistant_message", "tool_message",
           "HERMES_TOOLS_PROMPT", "parse_hermes", "hermes_messages", "OpenAIChat"]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model wrote (may be malformed: the tool layer reports that)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


@dataclass
class Reply:
    content: str  # text, with any hermes <tool_call> blocks removed
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    seconds: float = 0.0  # wall time of the request, retries included
    # Token-level backends: {"prompt_ids", "ids", "logprobs"} of this turn, for training.
    tokens: dict[str, list] | None = None


class ChatBackend(Protocol):
    def complete(self, messages: list[dict], tools: list[dict]) -> Reply: ...


class BackendError(RuntimeError):
    """A request that failed for good: after the retries, or at once for a client error (4xx)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status, None for timeouts and connection errors


def assistant_message(reply: Reply) -> dict:
    """The OpenAI-format assistant message to append to the history."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in reply.tool_calls]
    return message


def tool_message(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


# The wording of Qwen2.5's chat template, which Qwen and Hermes models were trained on.
HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# An unclosed block at the very end counts: generation often stops before `</tool_call>`.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]+)"')


def parse_hermes(text: str, start: int = 0) -> tuple[str, list[ToolCall]]:
    """The text without its ``<tool_call>`` blocks, and the calls in them, with ids ``call_<start>``,
    ``call_<start+1>``, ... A block that is not a JSON object with a name and JSON arguments becomes
    a call whose arguments are the block's raw text (and name the best guess, or ""), so that the
    tool layer reports the error to the model."""
    text = text or ""
    calls = [_hermes_call(match.group(1).strip(), f"call_{start + i}")
             for i, match in enumerate(_TOOL_CALL.finditer(text))]
    return (_TOOL_CALL.sub("", text).strip() if calls else text), calls


def _hermes_call(body: str, call_id: str) -> ToolCall:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
        # Some models write "parameters", as in the schema, instead of "arguments".
        arguments = parsed.get("arguments", parsed.get("parameters", {}))
        if not isinstance(arguments, str):
            return ToolCall(call_id, parsed["name"], json.dumps(arguments, ensure_ascii=False))
        try:
            json.loads(arguments)
            return ToolCall(call_id, parsed["name"], arguments)
        except json.JSONDecodeError:
            pass
    guess = _NAME.search(body)
    return ToolCall(call_id, guess.group(1) if guess else "", body)


def _hermes_block(call: dict) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            # parse_hermes kept the block's raw text: show the model exactly what it wrote.
            return f"<tool_call>\n{function.get('arguments')}\n</tool_call>"
    payload = json.dumps({"name": function.get("name", ""), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """An OpenAI-format history as a model without a tool parser reads it: the schemas in the
    system message, calls as ``<tool_call>`` text, results as user turns of ``<tool_response>``
    blocks (consecutive results in one turn, as Qwen's template does)."""
    rendered: list[dict] = []
    after_tool = False
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if after_tool:
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and message.get("tool_calls"):
            parts = [message.get("content") or ""] + [_hermes_block(call) for call in message["tool_calls"]]
            rendered.append({"role": "assistant", "content": "\n".join(part for part in parts if part)})
        else:
            rendered.append(dict(message))
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if rendered and rendered[0].get("role") == "system":
            system = rendered[0].get("content") or ""
            rendered[0] = rendered[0] | {"content": f"{system}\n\n{prompt}" if system else prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _calls_so_far(messages: list[dict]) -> int:
    # Numbering on from the history keeps ids unique within a conversation without shared state.
    return sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")


def _is_local(base_url: str | None) -> bool:
    return bool(base_url) and urlparse(base_url).hostname in ("localhost", "127.0.0.1", "::1", "0.0.0.0")


class OpenAIChat:
    """A model behind an OpenAI-compatible chat-completions endpoint."""

    def __init__(self, model: str, *, base_url: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 tool_format: str = "native", temperature: float | None = None, max_tokens: int | None = None,
                 timeout_s: float = 600.0, max_retries: int = 5, extra_body: dict | None = None,
                 api_key: str | None = None):
        if tool_format not in ("native", "hermes"):
            raise ValueError(f"tool_format must be 'native' or 'hermes', not {tool_format!r}")
        try:
            import openai
        except ImportError:
            from cuda_agent.paths import install_hint
            raise BackendError(f"the model backends need the `openai` package: {install_hint('llm')}") from None
        # ``api_key`` is for keys that differ per caller in one process (verifiers' per-rollout token).
        key = api_key or os.environ.get(api_key_env)
        if not key:
            if not _is_local(base_url):
                raise BackendError(f"no API key: set the environment variable {api_key_env} "
                                   f"(for {base_url or 'the OpenAI API'})")
            key = "EMPTY"  # vLLM and SGLang check no key unless started with one
        self.model = model
        self.tool_format = tool_format
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.api_key_env = api_key_env
        self.extra_body = extra_body
        self._openai = openai
        # The SDK retries rate limits (429), server errors (5xx), timeouts and connection errors
        # with exponential backoff (0.5 s doubling to 8 s, honouring Retry-After).
        self.client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout_s, max_retries=max_retries)

    def check_reachable(self, timeout_s: float = 10.0) -> None:
        """One quick request (list the models, no retries) before any episode: an endpoint that is
        down or refuses the key fails now with the reason, not after a minute of retries per turn.
        Any other answer, even an error status, shows a server is there (some list no models)."""
        try:
            self.client.with_options(timeout=timeout_s, max_retries=0).models.list()
        except (self._openai.APITimeoutError, self._openai.APIConnectionError) as exc:
            raise self._error(exc, timeout_s, "checked before starting") from None
        except self._openai.APIStatusError as exc:
            if exc.status_code in (401, 403):
                raise self._error(exc, timeout_s, "checked before starting") from None

    def complete(self, messages: list[dict], tools: list[dict]) -> Reply:
        request: dict[str, Any] = {"model": self.model, "extra_body": self.extra_body}
        if self.tool_format == "hermes":
            request["messages"] = hermes_messages(messages, tools)
        else:
            request["messages"] = messages
            if tools:  # some servers reject an empty list
                request["tools"] = tools
        if self.temperature is not None:
            request["temperature"] = self.temperature
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        started = time.monotonic()
        try:
            response = self.client.chat.completions.create(**request)
        except self._openai.APIError as exc:
            raise self._error(exc) from None
        seconds = time.monotonic() - started
        if not response.choices:
            raise BackendError(f"{self.model} at {self.client.base_url} answered with no choices")
        choice = response.choices[0]
        start = _calls_so_far(messages)
        calls = []
        for i, call in enumerate(choice.message.tool_calls or []):
            function = getattr(call, "function", None)
            if function is None:  # a custom (non-function) tool call: none were offered
                continue
            arguments = function.arguments
            if not isinstance(arguments, str):  # non-conforming servers send an object
                arguments = "{}" if arguments is None else json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(call.id or f"call_{start + i}", function.name or "", arguments))
        content = choice.message.content or ""
        if not calls:
            # Hermes mode, and native mode behind a tool parser that missed a call: it stays in the text.
            content, calls = parse_hermes(content, start)
        usage = getattr(response, "usage", None)
        return Reply(content=content, tool_calls=calls, finish_reason=choice.finish_reason, seconds=seconds,
                     usage=Usage(prompt_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                                 completion_tokens=getattr(usage, "completion_tokens", 0) or 0))

    def _error(self, exc: Exception, timeout_s: float | None = None, retries: str | None = None) -> BackendError:
        openai = self._openai
        where = f"{self.model} at {self.client.base_url}"
        retries = retries or f"{self.max_retries} retries"
        if isinstance(exc, openai.APITimeoutError):
            return BackendError(f"{where}: no answer within {timeout_s or self.timeout_s:g} s ({retries}): "
                                f"raise timeout_s, or check the server")
        if isinstance(exc, openai.APIConnectionError):
            return BackendError(f"{where}: cannot connect ({retries}): is the server up at that address?")
        status = getattr(exc, "status_code", None)
        detail = str(getattr(exc, "message", exc))[:500]
        lower = detail.lower()
        hint = ""
        if status in (401, 403):
            hint = f"check the API key in {self.api_key_env}"
        elif status == 404:
            hint = "check the model name and base_url"
        elif status == 429:
            hint = f"still rate limited after {retries}: lower the concurrency or raise max_retries"
        elif status is not None and status >= 500:
            hint = f"still failing after {retries}"
        elif "tool-call-parser" in lower or "tool choice" in lower or "tool_choice" in lower:
            hint = ("serve the model with a tool parser (vLLM: --enable-auto-tool-choice --tool-call-parser "
                    "hermes) or use tool_format='hermes'")
        elif "context" in lower and ("length" in lower or "window" in lower or "maximum" in lower):
            hint = "the conversation no longer fits the model's context"
        return BackendError(f"{where}: HTTP {status}: {detail}" + (f" ({hint})" if hint else ""), status)
