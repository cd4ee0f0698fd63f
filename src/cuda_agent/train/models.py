"""Actor and critic: Hugging Face models, both from one base (the paper initialises both from it).

The critic is the base with a scalar head, as ``AutoModelForTokenClassification`` with ``num_labels=1``:
the class verl loads its critic as, so a critic pretrained here (``cuda-agent train value``) hands over
to verl by path. Needs the ``[train]`` extra (transformers).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from cuda_agent.train.algo import token_entropy, token_logprobs


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("training needs transformers: pip install -e '.[train]'") from exc
    return transformers


def critic_from_actor(actor: Any) -> Any:
    """A critic with the actor's architecture and backbone weights and a fresh scalar head."""
    transformers = _transformers()
    config = copy.deepcopy(actor.config)
    config.num_labels = 1
    critic = transformers.AutoModelForTokenClassification.from_config(config)
    prefix = actor.base_model_prefix
    missing, unexpected = getattr(critic, prefix).load_state_dict(getattr(actor, prefix).state_dict(), strict=False)
    if unexpected or missing:
        raise ValueError(f"the critic's backbone does not take the actor's weights (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    return critic.to(next(actor.parameters()).device)


def load_actor_and_critic(base: str, critic: str | None = None, dtype: str = "auto") -> tuple[Any, Any]:
    """The actor from ``base`` (a Hugging Face name or directory); the critic from ``critic`` (a directory a
    value stage saved) or, without one, initialised from ``base`` with a new head."""
    transformers = _transformers()
    actor = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    value = transformers.AutoModelForTokenClassification.from_pretrained(critic or base, num_labels=1, dtype=dtype)
    return actor, value


def prepare_for_training(model: Any, gradient_checkpointing: bool = False) -> Any:
    """Dropout off, training mode, optionally gradient checkpointing (transformers only checkpoints in
    training mode, hence dropout off rather than eval mode). Without dropout off, the PPO ratio would
    compare the policy with a random sub-network of itself, and the critic's head (0.1 in transformers'
    token classifiers) would add noise to every target."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for name in ("attention_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop",
                 "attn_pdrop", "dropout"):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """``auto``: bf16 on a GPU, fp32 on the CPU (CPU bf16 autocast is slower than fp32 there)."""
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision


@contextlib.contextmanager
def compute_precision(precision: str, device: str | torch.device) -> Iterator[None]:
    """The weights stay fp32 (the optimiser's master copy); ``bf16`` runs the matmuls in bf16 through
    autocast, as FSDP's mixed precision does. Logprobs and values always come out in fp32."""
    if precision == "bf16":
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            yield
    else:
        yield


def _head_stats(head: Any, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(head(hidden).float(), dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _plain_head(actor: Any) -> bool:
    """Whether logits are just ``lm_head(hidden)`` (no soft-capping or scaling after it), so that the head
    can be applied a chunk of positions at a time."""
    config = actor.config
    return (getattr(config, "final_logit_softcapping", None) is None and getattr(config, "logit_scale", None) is None
            and actor.get_output_embeddings() is not None)


class _ScoringHead(torch.nn.Module):
    """Stands in for the output head during one forward: instead of logits ``[batch, tokens, vocab]`` it returns
    ``[batch, tokens, 2]``, each position's logprob of the next target and the entropy it was drawn from,
    computed ``chunk`` positions at a time and recomputed in the backward pass. It runs inside the model's own
    forward, so under FSDP2 the head's weight is gathered there as for any forward."""

    def __init__(self, head: torch.nn.Module, targets: torch.Tensor, chunk: int):
        super().__init__()
        self.head, self.targets, self.chunk = head, targets, chunk

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1]
        parts = []
        for start in range(0, hidden.shape[1], self.chunk):
            part = slice(start, start + self.chunk)
            lp, ent = checkpoint(_head_stats, self.head, hidden[:, part], self.targets[:, part], use_reentrant=False)
            parts.append(torch.stack([lp, ent], dim=-1))
        stats = torch.cat(parts, dim=1)
        return torch.cat([torch.zeros_like(stats[:, :1]), stats], dim=1)


@contextlib.contextmanager
def _scoring_head(actor: Any, ids: torch.Tensor, chunk: int) -> Iterator[None]:
    head = actor.get_output_embeddings()
    name = next(n for n, child in actor.named_children() if child is head)
    setattr(actor, name, _ScoringHead(head, ids[:, 1:], chunk))
    try:
        yield
    finally:
        setattr(actor, name, head)


def policy_forward(actor: Any, ids: torch.Tensor, attention: torch.Tensor,
                   chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logprob and the entropy of the distribution it was drawn from, ``[batch, tokens]``.

    With ``chunk``, the head runs over that many positions at a time and is recomputed in the backward
    pass: the fp32 logits of a 32k-token sequence over a 152k vocabulary would take 20 GB at once. No KV
    cache: scoring never decodes, and a cache of 32k positions is gigabytes."""
    if chunk and ids.shape[1] > chunk and _plain_head(actor):
        with _scoring_head(actor, ids, chunk):
            stats = actor(input_ids=ids, attention_mask=attention, use_cache=False).logits
        return stats[..., 0], stats[..., 1]
    logits = actor(input_ids=ids, attention_mask=attention, use_cache=False).logits
    return token_logprobs(logits, ids), token_entropy(logits)


def value_forward(critic: Any, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each token's value: the critic's output at the position before it (the state the token was drawn
    in), aligned like ``token_logprobs``; position 0 gets 0."""
    out = critic(input_ids=ids, attention_mask=attention, use_cache=False).logits.squeeze(-1).float()
    return torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
