"""The LLM composer against a local server speaking the OpenAI chat-completions protocol."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("openai")

from cuda_agent.synth.catalog import build_catalog  # noqa: E402
from cuda_agent.synth.compose import ComposeError, SizeProfile  # noqa: E402
from cuda_agent.synth.llm import LLMComposer, extract_code, ops_in_code  # noqa: E402
from tests.openai_server import OpenAIServer  # noqa: E402

PROGRAM = '''import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.norm = torch.nn.LayerNorm(features)

    def forward(self, x):
        return torch.tanh(F.gelu(self.norm(x)))


batch_size = 32
features = 256


def get_inputs():
    return [torch.randn(batch_size, features)]


def get_init_inputs():
    return [features]
'''


@pytest.fixture(scope="module")
def catalog():
    return build_catalog(transformers=False)


def test_extract_code_and_ops(catalog):
    answer = f"Here it is:\n```python\n{PROGRAM}```\nDone."
    assert extract_code(answer) == PROGRAM
    assert ops_in_code(PROGRAM, catalog) == ["nn.LayerNorm", "torch.tanh", "F.gelu"]  # source order
    with pytest.raises(ComposeError, match="no ```python code block"):
        extract_code("I cannot do that.")


def test_composer_asks_for_the_sampled_operators_and_parses_the_answer(catalog, monkeypatch):
    monkeypatch.setenv("TEST_LLM_KEY", "sk-test")
    with OpenAIServer(lambda request: f"```python\n{PROGRAM}```") as server:
        composer = LLMComposer(catalog, SizeProfile.for_device("cpu"), seed=1, model="composer-test",
                               base_url=server.url, api_key_env="TEST_LLM_KEY", window_ms=(0.2, 200.0))
        programs = [composer.compose(i) for i in range(6)]
    llm_rows = [(p, r) for p, r in zip(programs, server.requests)]
    assert all(r["_auth"] == "Bearer sk-test" and r["model"] == "composer-test" for _, r in llm_rows)
    for program, request in llm_rows:
        prompt = request["messages"][-1]["content"]
        asked = re.findall(r"^- `([^`]+)`", prompt, flags=re.M)
        assert 1 <= len(asked) <= 5 and program.data_source == f"torch#{len(asked)}"
        assert all(catalog.get(name).usable and not catalog.get(name).stochastic for name in asked)
        assert program.code == PROGRAM and program.composer == "llm" and program.id.startswith("llm-1-")
        assert set(program.ops) == {"torch.tanh", "F.gelu", "nn.LayerNorm"}
    assert composer.usage["requests"] == 6 and composer.usage["completion_tokens"] > 0


def test_server_errors_are_retried_then_reported(catalog):
    calls = []

    def flaky(request):
        calls.append(1)
        return (500, {"error": {"message": "overloaded"}}) if len(calls) == 1 else f"```python\n{PROGRAM}```"

    with OpenAIServer(flaky) as server:
        composer = LLMComposer(catalog, SizeProfile.for_device("cpu"), model="m", base_url=server.url, max_retries=2)
        index = next(i for i in range(50) if composer.compose(i) is not None)
        assert len(calls) == 2 and index == 0
    with OpenAIServer(lambda request: (400, {"error": {"message": "bad request"}})) as server:
        composer = LLMComposer(catalog, SizeProfile.for_device("cpu"), model="m", base_url=server.url, max_retries=0)
        with pytest.raises(ComposeError, match="LLM request failed"):
            for i in range(10):  # index 0..9: the first non-transformers row asks the server
                composer.compose(i)
