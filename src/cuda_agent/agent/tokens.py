"""Token-level model backends, for training: prompt token ids in; token ids and logprobs out.

``TokenBackend.generate`` is the whole contract; ``TransformersBackend`` runs a
local Hugging Face model. ``TokenChat`` turns any token backend into a
``ChatBackend``, so training rolls out with the same loop, tools and
trajectory format as ``cuda-agent optimize``: the history is rendered as a
hermes-style conversation (tool schemas in the system message, calls as
``<tool_call>`` text, results as ``<tool_response>`` turns) through the
tokenizer's chat template, and each reply carries its prompt ids, its ids and
their logprobs.

``token_trace(turns)`` joins an episode's turns into one sequence with a mask
(1: tokens the model sampled, whose logprobs training uses; 0: prompt, tool
results and template tokens), where each turn's prompt extends the previous
turn's prompt and reply; where it does not (a truncated context, or a
template that re-renders earlier turns differently), a new segment starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from cuda_agent.agent.llm import Reply, Usage, hermes_messages, parse_hermes


@dataclass
class TokenOutput:
    ids: list[int]
    logprobs: list[float]  # of each sampled token under the sampling distribution
    finish_reason: str  # "stop" (an end-of-turn token) or "length"


class TokenBackend(Protocol):
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput: ...


class TransformersBackend:
    """A local transformers causal LM (``from_pretrained`` or a model and tokenizer already loaded)."""

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float = 1.0, top_p: float = 1.0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p

    @classmethod
    def from_pretrained(cls, name: str, *, device: str | None = None, dtype: str = "auto", **options: Any) -> "TransformersBackend":
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise ImportError("the transformers backend needs `pip install transformers`") from None
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        if device:
            model = model.to(device)
        return cls(model, tokenizer, **options)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput:
        return self.generate_batch([prompt_ids], max_new_tokens)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[TokenOutput]:
        """Several prompts in one ``generate`` (left-padded): on a GPU, decoding is bound by the per-step
        overhead far more than by the batch, so independent episodes (single-turn) sample together."""
        import torch

        self.model.eval()  # a trainer may have put it in training mode since
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        inputs = torch.tensor([[pad or 0] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sample = self.temperature > 0
        options = {"do_sample": sample, "max_new_tokens": max_new_tokens, "return_dict_in_generate": True,
                   "output_scores": True, "pad_token_id": pad}
        if sample:
            # top_k=0 explicitly: transformers otherwise samples from the top 50 tokens (its default), and
            # the logprobs recorded would be of that truncated distribution, not the policy's.
            options.update(temperature=self.temperature, top_p=self.top_p, top_k=0)
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=attention, **options)
            new = out.sequences[:, width:]
            # The scores are the processed logits the sampler drew from (temperature, top-p applied).
            logprobs = torch.stack([torch.log_softmax(score.float(), dim=-1).gather(-1, new[:, t, None]).squeeze(-1)
                                    for t, score in enumerate(out.scores)], dim=1).cpu()
        eos = _eos_ids(self.model, self.tokenizer)
        outputs = []
        for row, ids in enumerate(new.tolist()):
            end = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
            ids = ids[:end] if end else ids  # after its end-of-sequence a row holds padding
            outputs.append(TokenOutput(ids, logprobs[row, :len(ids)].tolist(), "stop" if end else "length"))
        return outputs


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TokenChat:
    """A ``ChatBackend`` over a ``TokenBackend`` and the model's tokenizer (hermes tool calls).

    Each prompt continues the last one where it can: the last prompt, the ids the model sampled,
    then the new turns (tool results) as the chat template renders them after an assistant turn.
    Re-rendering the whole history instead would re-tokenize the model's own reply (its text
    re-serialised, its end-of-turn token followed by template text), so the ids training sees
    would not be the ids the model sampled. Where the history is not an extension of the last
    prompt (the loop dropped turns for the context budget), the prompt is rendered afresh.
    """

    def __init__(self, backend: TokenBackend, tokenizer: Any, *, max_new_tokens: int = 4096):
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self._last: tuple[list[dict], list[int], bool] | None = None  # rendered history, prompt + ids, ended

    def _render(self, rendered: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(rendered, add_generation_prompt=generation, tokenize=False)

    def _prompt(self, rendered: list[dict]) -> list[int]:
        if self._last is not None:
            before, sequence, ended = self._last
            n = len(before)
            if ended and rendered[:n] == before and len(rendered) > n + 1 and rendered[n]["role"] == "assistant":
                upto = self._render(rendered[:n + 1], False)
                full = self._render(rendered, True)
                eos = self.tokenizer.eos_token
                cut = upto.rfind(eos) + len(eos) if eos and eos in upto else -1
                if cut > 0 and full.startswith(upto[:cut]):
                    return sequence + self.tokenizer.encode(full[cut:], add_special_tokens=False)
        return list(self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))

    def complete(self, messages: list[dict], tools: list[dict]) -> Reply:
        clock = time.monotonic()
        rendered = hermes_messages(messages, tools)
        prompt_ids = self._prompt(rendered)
        out = self.backend.generate(prompt_ids, self.max_new_tokens)
        self._last = (rendered, prompt_ids + out.ids, out.finish_reason == "stop")
        text = self.tokenizer.decode(out.ids, skip_special_tokens=True)
        earlier = sum(len(m.get("tool_calls") or []) for m in messages)
        content, calls = parse_hermes(text, start=earlier)
        return Reply(content, calls, Usage(len(prompt_ids), len(out.ids)),
                     finish_reason="tool_calls" if calls else out.finish_reason, seconds=time.monotonic() - clock,
                     tokens={"prompt_ids": prompt_ids, "ids": out.ids, "logprobs": out.logprobs})


def token_trace(turns: list[dict[str, list]]) -> list[dict[str, list]]:
    """Segments ``{"ids", "mask", "logprobs"}`` of an episode's turns (``Reply.tokens`` each); logprobs
    are 0.0 where the mask is 0."""
    segments: list[dict[str, list]] = []
    for turn in turns:
        prompt, ids, logprobs = turn["prompt_ids"], turn["ids"], turn["logprobs"]
        current = segments[-1] if segments else None
        if current is not None and prompt[:len(current["ids"])] == current["ids"]:
            new = prompt[len(current["ids"]):]
        else:
            current = {"ids": [], "mask": [], "logprobs": []}
            segments.append(current)
            new = prompt
        current["ids"] += new + ids
        current["mask"] += [0] * len(new) + [1] * len(ids)
        current["logprobs"] += [0.0] * len(new) + list(logprobs)
    return segments
