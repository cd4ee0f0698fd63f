"""The LLM composer, as in the paper: sample up to 5 catalog operators, ask a model to compose them.

Any OpenAI-compatible chat-completions endpoint works (vLLM, SGLang, hosted
APIs), through the ``openai`` SDK (``pip install -e '.[llm]'``). The model
gets the operators with their signatures and the KernelBench format, and answers
with one Python code block; the program then meets the same filters as the
programmatic composer's. transformers layers are standalone tasks, never
composed, so those rows are written programmatically by either composer.
"""

from __future__ import annotations

import ast
import os
import random
import re
from typing import Any

from cuda_agent.synth.catalog import Catalog, Operator
from cuda_agent.synth.decontaminate import dotted_name
from cuda_agent.synth.compose import ComposeError, Program, ProgramComposer, SizeProfile, program_id, sample_op_count

SYSTEM_PROMPT = """You write PyTorch programs in the KernelBench format: a `class Model(nn.Module)` with \
`__init__` and `forward`, module-level size constants, `get_inputs()` returning the forward inputs as \
random tensors (torch.randn, on the default device) and `get_init_inputs()` returning the constructor \
arguments. Answer with exactly one ```python code block and nothing else."""

USER_PROMPT = """Compose these PyTorch operators, in this order, into one `Model` whose forward applies them \
sequentially (each one consumes the previous one's output):

{operators}

Rules:
- Use each operator exactly as named (import torch, torch.nn as nn, torch.nn.functional as F).
- Choose shapes and constructor arguments that are valid for the whole chain; pass sized constructor \
arguments through `get_init_inputs()`.
- Choose sizes so that one eager forward pass takes about {target_ms:g} ms on a {device} (between \
{low_ms:g} and {high_ms:g} ms).
- Deterministic: no dropout or other random operators, no Python randomness in forward.
- The output must depend on the inputs and must not be constant.
"""

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The program in a model's answer: its (last, longest) fenced code block, or the whole
    answer when it is plainly code."""
    blocks = _CODE_BLOCK.findall(text or "")
    if blocks:
        return max(blocks, key=len).strip() + "\n"
    if text and "class Model" in text:
        return text.strip() + "\n"
    raise ComposeError("the model's answer holds no ```python code block")


def ops_in_code(code: str, catalog: Catalog) -> list[str]:
    """The catalog operators a program calls, in order of first appearance, spelled as the catalog
    does (``torch.nn.functional.gelu`` and ``F.gelu`` are both ``F.gelu``)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    names = {op.name for op in catalog.usable()}
    found: list[str] = []
    attributes = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    for node in sorted(attributes, key=lambda n: (n.lineno, n.col_offset)):
        dotted = dotted_name(node)
        if dotted is None:
            continue
        for prefix, short in (("torch.nn.functional.", "F."), ("nn.functional.", "F."), ("torch.nn.", "nn.")):
            if dotted.startswith(prefix):
                dotted = short + dotted[len(prefix):]
                break
        if dotted in names and dotted not in found:
            found.append(dotted)
    return found


def describe(op: Operator) -> str:
    params = ", ".join(p.name + ("" if p.required else f"={p.default!r}") for p in op.params
                       if p.name not in ("device", "dtype", "inplace", "out"))
    kind = "module" if op.kind == "module" else "function"
    return f"- `{op.name}` ({kind}; parameters: {params or 'none'}; input ranks {op.ranks})"


class LLMComposer:
    """Composes with a model behind an OpenAI-compatible endpoint."""

    name = "llm"

    def __init__(self, catalog: Catalog, profile: SizeProfile, seed: int = 0, *, model: str, base_url: str,
                 api_key_env: str = "OPENAI_API_KEY", temperature: float = 0.7, timeout_s: float = 120.0,
                 max_retries: int = 4, window_ms: tuple[float, float] = (1.0, 100.0)):
        try:
            from openai import OpenAI
        except ImportError:
            from cuda_agent.paths import install_hint
            raise ValueError(f"the LLM composer needs the `openai` package: {install_hint('llm')}.") from None
        self.catalog = catalog
        self.seed = seed
        self.model = model
        self.temperature = temperature
        self.window_ms = window_ms
        self.device = "GPU" if profile.name == "cuda" else "CPU"
        # The SDK retries rate limits and server errors with exponential backoff.
        self.client = OpenAI(base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY",
                             timeout=timeout_s, max_retries=max_retries)
        self._pool = [op for op in catalog.usable("torch") if not op.stochastic]
        self._standalone = ProgramComposer(catalog, profile, seed)
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0}

    def compose(self, index: int) -> Program:
        rng = random.Random(f"{self.seed}:{index}:llm")
        count = sample_op_count(rng, bool(self.catalog.usable("transformers")))
        if count == "transformers":
            program = self._standalone.compose(index)
            program.id = program_id(self.name, self.seed, index)
            program.composer = self.name
            return program
        ops = rng.sample(self._pool, min(int(count), len(self._pool)))
        low, high = self.window_ms
        prompt = USER_PROMPT.format(operators="\n".join(describe(op) for op in ops), device=self.device,
                                    target_ms=round((low * high) ** 0.5, 1), low_ms=low, high_ms=high)
        try:
            reply = self.client.chat.completions.create(
                model=self.model, temperature=self.temperature, seed=rng.randrange(1 << 31),
                messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}])
        except Exception as exc:  # noqa: BLE001 - the SDK's errors after its retries
            raise ComposeError(f"LLM request failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        usage: Any = getattr(reply, "usage", None)
        self.usage["requests"] += 1
        if usage is not None:
            self.usage["prompt_tokens"] += usage.prompt_tokens or 0
            self.usage["completion_tokens"] += usage.completion_tokens or 0
        code = extract_code(reply.choices[0].message.content or "")
        used = ops_in_code(code, self.catalog) or [op.name for op in ops]
        return Program(id=program_id(self.name, self.seed, index), code=code, ops=used,
                       data_source=f"torch#{len(ops)}", composer=self.name, seed=self.seed, index=index,
                       input_shapes=[], steps=[])
