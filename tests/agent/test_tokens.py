"""The token-level backend: prompt ids in, ids and logprobs out; the same loop, tools and trajectory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cuda_agent.agent.loop import run_episode
from cuda_agent.agent.tokens import TokenChat, TokenOutput, TransformersBackend, token_trace
from cuda_agent.evaluate.evaluator import Evaluator
from cuda_agent.tasks import load_task

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SANDBOX = "auto" if shutil.which("bwrap") else "none"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE with ChatML special tokens, trained here: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    corpus = [Path(__file__).read_text(), (Path(__file__).resolve().parents[2] / "src/cuda_agent/agent/SKILL.md").read_text()]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                                chat_template=CHATML)


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=8192, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    return transformers.LlamaForCausalLM(config)


def test_transformers_backend_logprobs_are_the_models(tokenizer, tiny_model):
    import torch

    backend = TransformersBackend(tiny_model, tokenizer, temperature=0.0)  # greedy: scores are the logits
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "write a kernel"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    out = backend.generate(list(prompt), max_new_tokens=8)
    assert 1 <= len(out.ids) <= 8 and len(out.logprobs) == len(out.ids)
    with torch.no_grad():
        logits = tiny_model(torch.tensor([list(prompt) + out.ids])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
    for i, token in enumerate(out.ids):
        assert out.logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-4)
        assert token == int(expected[i].argmax())  # greedy picked the top token
    sampled = TransformersBackend(tiny_model, tokenizer, temperature=1.0).generate(list(prompt), max_new_tokens=5)
    assert all(lp <= 0.0 for lp in sampled.logprobs) and sampled.finish_reason in ("stop", "length")


def test_a_batch_of_prompts_samples_what_each_alone_would(tokenizer, tiny_model):
    import torch

    backend = TransformersBackend(tiny_model, tokenizer, temperature=0.0)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
               for text in ("write a kernel", "a much longer request for a fused softmax kernel, please")]
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    together = backend.generate_batch(prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, together):
        alone = backend.generate(prompt, max_new_tokens=6)
        assert out.ids == alone.ids and out.finish_reason == alone.finish_reason
        with torch.no_grad():
            logits = tiny_model(torch.tensor([prompt + out.ids])).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
        assert out.logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(out.ids)], abs=1e-4)


class ScriptedTokens:
    """A token backend that answers with fixed texts (a test double for a policy being trained)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.prompts = tokenizer, iter(texts), []

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput:
        self.prompts.append(prompt_ids)
        ids = self.tokenizer.encode(next(self.texts, "done"), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return TokenOutput(ids, [-0.5] * len(ids), "stop")


@pytest.mark.slow
def test_token_backend_drives_an_episode_and_the_trajectory_carries_tokens(tmp_path, tokenizer, examples, cache_dir):
    texts = ['Looking first.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls kernels utils"}}\n</tool_call>',
             '<tool_call>\n{"name": "read", "arguments": {"path": "model.py", "limit": 3}}\n</tool_call>'
             '<tool_call>\n{"name": "write", "arguments": {"path": "../escape.txt", "content": "x"}}\n</tool_call>',
             "Nothing more to do."]
    scripted = ScriptedTokens(tokenizer, texts)
    task = load_task(examples / "cpu_swish" / "model.py")
    evaluator = Evaluator("cpu", cache_dir=cache_dir, sandbox=SANDBOX, time_compile=False)
    episode = run_episode(task, TokenChat(scripted, tokenizer), evaluator, tmp_path / "ep", sandbox=SANDBOX)
    record = episode.record
    assert episode.end_reason == "done" and len(record["turns"]) == 3
    calls = [c for t in record["turns"] for c in t["tool_calls"]]
    assert [c["name"] for c in calls] == ["bash", "read", "write"] and [c["error"] for c in calls] == [False, False, True]
    tool_results = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert "compile.py" in tool_results[0]
    # The tool results reach the model as <tool_response> turns of its own prompt.
    assert "<tool_response>" in tokenizer.decode(scripted.prompts[1]) and "compile.py" in tokenizer.decode(scripted.prompts[1])
    segments = record["tokens"]
    assert len(segments) == 1  # each prompt extends the last: one sequence for the whole episode
    ids, mask, logprobs = segments[0]["ids"], segments[0]["mask"], segments[0]["logprobs"]
    assert len(ids) == len(mask) == len(logprobs)
    sampled = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == "".join(texts)
    assert all(lp == -0.5 for lp, m in zip(logprobs, mask) if m) and all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
    assert ids[:len(scripted.prompts[-1])] == scripted.prompts[-1]
    assert json.loads(json.dumps(record))["tokens"] == segments  # JSON as it is written


def test_token_trace_starts_a_segment_where_a_prompt_does_not_extend_the_last():
    turns = [{"prompt_ids": [1, 2], "ids": [3], "logprobs": [-1.0]},
             {"prompt_ids": [1, 2, 3, 4], "ids": [5, 6], "logprobs": [-0.1, -0.2]},
             {"prompt_ids": [1, 9], "ids": [7], "logprobs": [-0.3]}]  # the context was cut
    first, second = token_trace(turns)
    assert first == {"ids": [1, 2, 3, 4, 5, 6], "mask": [0, 0, 1, 0, 1, 1], "logprobs": [0.0, 0.0, -1.0, 0.0, -0.1, -0.2]}
    assert second == {"ids": [1, 9, 7], "mask": [0, 0, 1], "logprobs": [0.0, 0.0, -0.3]}
