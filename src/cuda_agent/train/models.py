"""Actor and critic: Hugging Face models, both from one base (the paper initialises both from it).

The critic is the base with a scalar head, as ``AutoModelForTokenClassification`` with ``num_labels=1``:
the class verl loads its critic as, so a critic pretrained here (``cuda-agent train value``) hands over
to verl by path. Needs the ``[train]`` extra (transformers).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from cuda_agent.train.algo import token_entropy, token_logprobs


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImportError("training needs transformers: pip install 'cuda-agent[train]'") from exc
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


def policy_forward(actor: Any, ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's logprob and the entropy of the distribution it was drawn from, ``[batch, tokens]``."""
    logits = actor(input_ids=ids, attention_mask=attention).logits
    return token_logprobs(logits, ids), token_entropy(logits)


def value_forward(critic: Any, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Each token's value: the critic's output at the position before it (the state the token was drawn
    in), aligned like ``token_logprobs``; position 0 gets 0."""
    out = critic(input_ids=ids, attention_mask=attention).logits.squeeze(-1).float()
    return torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
