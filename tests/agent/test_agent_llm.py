"""The agent's model backends against a local server speaking the OpenAI chat-completions protocol."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("openai")

from cuda_agent.agent.llm import (  # noqa: E402
    BackendError, OpenAIChat, Reply, Usage, assistant_message, hermes_messages, parse_hermes, tool_message)
from tests.openai_server import OpenAIServer  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a shell command in the workspace.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]

# A history after one tool call and its result, as the loop keeps it (OpenAI format).
HISTORY = [
    {"role": "system", "content": "You write CUDA kernels."},
    {"role": "user", "content": "Make model.py fast."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
    tool_message("call_0", "kernel.cu\nmodel.py"),
]


def test_native_tool_calls_round_trip():
    answer = {"content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": '{"command": "nvcc --version"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "kernel.cu"'}},
    ]}
    with OpenAIServer(lambda request: answer) as server:
        backend = OpenAIChat("agent-test", base_url=server.url, temperature=0.6, max_tokens=512,
                             extra_body={"top_k": 20})
        reply = backend.complete(HISTORY, TOOLS)
    [request] = server.requests
    assert request["tools"] == TOOLS and request["messages"] == HISTORY
    assert request["model"] == "agent-test" and request["temperature"] == 0.6 and request["max_tokens"] == 512
    assert request["top_k"] == 20
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        ("call_a", "bash", '{"command": "nvcc --version"}'),
        ("call_b", "read_file", '{"path": "kernel.cu"'),  # malformed as written: the tool layer reports it
    ]
    assert reply.content == "" and reply.finish_reason == "tool_calls" and reply.seconds > 0
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    total = Usage()
    total.add(reply.usage)
    total.add(reply.usage)
    assert total.completion_tokens == 2 * reply.usage.completion_tokens
    assert assistant_message(reply) == {"role": "assistant", "content": "", "tool_calls": answer["tool_calls"]}


def test_native_text_reply_has_no_calls():
    with OpenAIServer(lambda request: "All done: 3.1x faster.") as server:
        reply = OpenAIChat("m", base_url=server.url).complete(HISTORY, [])
    assert "tools" not in server.requests[0]
    assert reply.content == "All done: 3.1x faster." and reply.tool_calls == [] and reply.finish_reason == "stop"
    assert assistant_message(reply) == {"role": "assistant", "content": "All done: 3.1x faster."}


def test_hermes_renders_history_and_parses_calls():
    answer = ("I'll check the compiler and read the kernel.\n"
              '<tool_call>\n{"name": "bash", "arguments": {"command": "nvcc --version"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "read_file", "arguments": {"path": "kernel.cu"}}\n</tool_call>')
    with OpenAIServer(lambda request: answer) as server:
        reply = OpenAIChat("qwen", base_url=server.url, tool_format="hermes").complete(HISTORY, TOOLS)
    [request] = server.requests
    assert "tools" not in request
    system, user, assistant, result = request["messages"]
    assert system["role"] == "system" and system["content"].startswith("You write CUDA kernels.\n\n# Tools")
    tools_json = system["content"].split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in tools_json.splitlines()] == TOOLS
    assert "<tool_call>" in system["content"] and user == HISTORY[1]
    assert assistant == {"role": "assistant", "content":
                         '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'}
    assert result == {"role": "user", "content": "<tool_response>\nkernel.cu\nmodel.py\n</tool_response>"}
    assert reply.content == "I'll check the compiler and read the kernel."
    # Numbered on from the history's one call, arguments re-serialised to JSON text.
    assert [(c.id, c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("call_1", "bash", {"command": "nvcc --version"}), ("call_2", "read_file", {"path": "kernel.cu"})]
    assert all(isinstance(c.arguments, str) for c in reply.tool_calls)


def test_hermes_merges_consecutive_results_and_adds_a_system_message():
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": "Two at once.", "tool_calls": [
                   {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "a"}'}},
                   {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "b"}'}}]},
               tool_message("call_0", "A"), tool_message("call_1", "B")]
    system, user, assistant, results = hermes_messages(history, TOOLS)
    assert system["role"] == "system" and system["content"].startswith("# Tools") and user == history[0]
    assert assistant["content"].startswith("Two at once.\n<tool_call>") and assistant["content"].count("<tool_call>") == 2
    assert results == {"role": "user",
                       "content": "<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response>"}
    assert hermes_messages(history, [])[0] == history[0]  # no tools, no tools prompt


def test_malformed_hermes_block_is_kept_raw():
    text = ('Let me try.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}\n</tool_call>\n'
            "<tool_call>\nnot json at all\n</tool_call>\n"
            '<tool_call>\n{"name": "read_file", "arguments": "{\\"path\\": \\"a.cu\\"}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "bash", "arguments": {"command": "make"}}')  # unclosed: generation stopped
    content, calls = parse_hermes(text)
    assert content == "Let me try."
    assert [(c.id, c.name) for c in calls] == [("call_0", "bash"), ("call_1", ""), ("call_2", "read_file"),
                                               ("call_3", "bash")]
    assert calls[0].arguments == '{"name": "bash", "arguments": {"command": "ls -la"}'
    assert calls[1].arguments == "not json at all"
    assert json.loads(calls[2].arguments) == {"path": "a.cu"} and json.loads(calls[3].arguments) == {"command": "make"}
    # Rendered back for the next turn, the broken block reads as the model wrote it.
    message = assistant_message(Reply(content, calls[:2]))
    rendered = hermes_messages([message], [])[0]["content"]
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}\n</tool_call>' in rendered
    assert "<tool_call>\nnot json at all\n</tool_call>" in rendered
    assert parse_hermes("no calls here \n") == ("no calls here \n", [])


@pytest.mark.parametrize("status", [500, 429])
def test_server_and_rate_limit_errors_are_retried(status):
    def flaky(request):
        return (status, {"error": {"message": "busy"}}) if len(server.requests) == 1 else "ok"

    with OpenAIServer(flaky) as server:
        reply = OpenAIChat("m", base_url=server.url, max_retries=2).complete(HISTORY, TOOLS)
    assert len(server.requests) == 2 and reply.content == "ok"


def test_client_error_fails_at_once():
    with OpenAIServer(lambda request: (400, {"error": {"message": "bad request: unknown field"}})) as server:
        backend = OpenAIChat("m", base_url=server.url, max_retries=5)
        with pytest.raises(BackendError, match="HTTP 400: .*unknown field") as info:
            backend.complete(HISTORY, TOOLS)
    assert len(server.requests) == 1 and info.value.status == 400


def test_tool_parser_missing_names_the_fix():
    message = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    with OpenAIServer(lambda request: (400, {"error": {"message": message}})) as server:
        with pytest.raises(BackendError, match="tool_format='hermes'"):
            OpenAIChat("m", base_url=server.url).complete(HISTORY, TOOLS)


def test_request_time_limit():
    def slow(request):
        time.sleep(1.5)
        return "late"

    with OpenAIServer(slow) as server:
        backend = OpenAIChat("m", base_url=server.url, timeout_s=0.3, max_retries=0)
        with pytest.raises(BackendError, match="no answer within 0.3 s"):
            backend.complete(HISTORY, TOOLS)


def test_missing_api_key_for_a_remote_endpoint(monkeypatch):
    monkeypatch.delenv("AGENT_TEST_KEY", raising=False)
    with pytest.raises(BackendError, match="AGENT_TEST_KEY"):
        OpenAIChat("m", base_url="https://api.example.com/v1", api_key_env="AGENT_TEST_KEY")
    with pytest.raises(BackendError, match="AGENT_TEST_KEY"):
        OpenAIChat("m", api_key_env="AGENT_TEST_KEY")  # the OpenAI API itself
    OpenAIChat("m", base_url="http://localhost:8000/v1", api_key_env="AGENT_TEST_KEY")  # vLLM needs none


def test_auth_header_carries_the_named_key(monkeypatch):
    monkeypatch.setenv("AGENT_TEST_KEY", "sk-agent")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong")
    with OpenAIServer(lambda request: "ok") as server:
        OpenAIChat("m", base_url=server.url, api_key_env="AGENT_TEST_KEY").complete(HISTORY, [])
    assert server.requests[0]["_auth"] == "Bearer sk-agent"


def test_unreachable_endpoint_fails_the_check_at_once():
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = OpenAIChat("m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=5)
    started = time.monotonic()
    with pytest.raises(BackendError, match=rf"m at http://127.0.0.1:{port}/v1/: cannot connect \(checked before starting\)"):
        backend.check_reachable()
    assert time.monotonic() - started < 5  # no retries with backoff


def test_reachable_endpoint_passes_the_check_even_without_a_model_list(monkeypatch):
    # The test server answers no GET (501): a server is there, so the episode may start.
    with OpenAIServer(lambda request: "ok") as server:
        OpenAIChat("m", base_url=server.url).check_reachable()
    monkeypatch.setenv("AGENT_TEST_KEY", "sk-wrong")
    with OpenAIServer(lambda request: "ok") as server:
        server._httpd.RequestHandlerClass.do_GET = lambda handler: handler._send(401, {"error": {"message": "bad key"}})
        with pytest.raises(BackendError, match="HTTP 401.*check the API key in AGENT_TEST_KEY"):
            OpenAIChat("m", base_url=server.url, api_key_env="AGENT_TEST_KEY").check_reachable()
