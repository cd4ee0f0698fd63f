"""Tiny causal LMs and a tokenizer trained in the test, saved as Hugging Face directories (the real loading
path of the training stages with no download), and a scripted token-level policy (a test double)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROOT = Path(__file__).resolve().parents[1]

from cuda_agent.agent.tokens import TokenOutput  # noqa: E402


def train_tokenizer(vocab_size: int = 700):
    """A byte-level BPE with ChatML special tokens, trained on the project's own texts."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [(ROOT / "src/cuda_agent/agent/SKILL.md").read_text(),
              (ROOT / "src/cuda_agent/train/single_turn.py").read_text()]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size,
                                                        special_tokens=["<|im_start|>", "<|im_end|>", "<|pad|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                                chat_template=CHATML)


def save_tiny_model(path: Path, tokenizer, seed: int = 0, positions: int = 16384) -> Path:
    """A randomly initialised two-layer Qwen2 with ``tokenizer``, saved at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=positions, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class ScriptedSampler:
    """A token-level policy double: per assistant turn of the prompt, a fixed text (then ``done``)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.sampled = tokenizer, turns, []
        self.lock = threading.Lock()

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> TokenOutput:
        turn = self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        text = self.turns[turn] if turn < len(self.turns) else "done"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        with self.lock:
            self.sampled.append(ids)
        return TokenOutput(ids, [-0.25] * len(ids), "stop")


def tool_calls_text(calls: list) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)


def solution_reply(solution: Path) -> str:
    parts = ["The solution:"]
    for path in sorted(p for p in solution.rglob("*") if p.is_file()):
        parts.append(f"### {path.relative_to(solution).as_posix()}\n```\n{path.read_text().rstrip()}\n```")
    return "\n".join(parts)


def torchrun(ranks: int, *args: str, cwd: Path) -> str:
    """``torchrun --standalone --nproc_per_node RANKS -m cuda_agent.cli train ARGS``, as a user launches it; its
    stderr (the run's report)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               "-m", "cuda_agent.cli", "train", *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def save_replying_model(path: Path, prompt: list[dict], reply: str, steps: int = 200) -> Path:
    """A tiny Qwen2 (random, then fitted in a few dozen steps) that answers ``prompt`` with ``reply`` when
    sampled at temperature 1: ``reply`` is one added token of the tokenizer, so the model only has to learn two
    tokens (the reply, then end of turn). For a trainer's own command line, which takes no scripted rollouts."""
    import torch
    import transformers
    from tokenizers import AddedToken

    tokenizer = train_tokenizer()
    tokenizer.add_tokens([AddedToken(reply, normalized=False, special=False)])
    save_tiny_model(path, tokenizer, positions=4096)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    target = [tokenizer.convert_tokens_to_ids(reply), tokenizer.eos_token_id]
    ids = torch.tensor([prompt_ids + target])
    labels = torch.full_like(ids, -100)
    labels[0, -len(target):] = ids[0, -len(target):]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.1:  # the reply is the likeliest answer; sharpening below makes it certain
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # Sharpen: the output layer, untied from the input embeddings and scaled, keeps its choice and makes it certain.
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 20)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss
    assert loss.item() < 1e-6, f"the tiny model did not learn its reply (loss {loss.item():.3g})"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
