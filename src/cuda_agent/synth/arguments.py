"""Constructor and call arguments for catalog operators, chosen from the input shape.

torch names its parameters consistently (``in_channels`` is always the input's
dimension 1, ``in_features`` its last), so a table of names is enough to fill in
the required ones and to vary a few optional ones (convolution stride and
padding). A required parameter with no rule makes the operator unusable at that
shape (``ArgumentError``); whether the choice works is decided by running it.
"""

from __future__ import annotations

import importlib
import random
from typing import Any, Callable

from cuda_agent.synth.catalog import Operator

CONFIG_KEY = "__config__"  # a transformers config argument: {"__config__": model_type, **fields}


class ArgumentError(ValueError):
    """No argument rule fits this operator at this shape."""


def resolve_arguments(op: Operator, shape: tuple[int, ...], rng: random.Random,
                      sizes: tuple[int, ...] = (32, 64, 128)) -> dict[str, Any]:
    """Keyword arguments for ``op`` applied to an input of ``shape``; ``sizes`` are output widths."""
    if not shape:
        raise ArgumentError("a rank-0 input")
    tail = op.name.rsplit(".", 1)[-1].lower()
    kwargs: dict[str, Any] = {}
    for p in op.params:
        name = p.name
        if name == "inplace":
            kwargs[name] = False
            continue
        if name in ("device", "dtype", "out", "layout", "memory_format", "generator", "pin_memory",
                    "requires_grad", "_stacklevel", "return_indices", "ceil_mode", "count_include_pad"):
            continue
        if p.tensor_operand and op.kind == "function":
            continue  # a tensor operand: passed positionally by the composer
        value = _rule(op, tail, name, p.required, p.default, shape, rng, sizes)
        if value is _KEEP:
            if p.required:
                raise ArgumentError(f"no rule for required parameter {name!r} of {op.name}")
            continue
        kwargs[name] = value
    return kwargs


_KEEP = object()


def _channels(shape: tuple[int, ...]) -> int:
    if len(shape) < 2:
        raise ArgumentError("needs a channel dimension (rank >= 2)")
    return shape[1]


def _rule(op: Operator, tail: str, name: str, required: bool, default: Any, shape: tuple[int, ...],
          rng: random.Random, sizes: tuple[int, ...]) -> Any:
    rank = len(shape)
    spatial = min(shape[2:]) if rank > 2 else shape[-1]
    if name in ("in_channels", "num_features", "num_channels", "channels"):
        return _channels(shape)
    if name in ("in_features", "in1_features", "in2_features", "hidden_size", "embed_dim"):
        return shape[-1]
    if name == "normalized_shape":
        return [shape[-1]]
    if name == "dim" and op.source == "transformers":
        return shape[-1]
    if name in ("out_channels", "out_features"):
        return rng.choice(sizes)
    if name == "num_groups":
        return rng.choice([g for g in (1, 2, 4, 8, 16, 32) if _channels(shape) % g == 0])
    if name == "groups" and required:
        options = [g for g in (2, 4) if _channels(shape) % g == 0]
        if not options:
            raise ArgumentError("channels not divisible into groups")
        return rng.choice(options)
    if name == "kernel_size":
        if "conv" in tail:
            return rng.choice([k for k in (1, 3, 5) if k <= spatial] or [1])
        return rng.choice([k for k in (2, 3) if k <= spatial] or [1])
    if "conv" in tail and name == "stride" and not required:
        return rng.choice([1, 1, 2])
    if "conv" in tail and name == "padding" and not required:
        return rng.choice([0, 1])
    if name == "output_size":
        return rng.choice([s for s in (1, 2, 4, 8) if s <= spatial] or [1])
    if name in ("upscale_factor", "downscale_factor"):
        return 2
    if name == "scale_factor" and "upsampl" in tail:
        return 2.0
    if name == "size" and required:
        return rng.choice([2, 3, 5])
    if name == "padding" and required:
        return rng.choice([1, 2])
    if name in ("value",) and required:
        return 0.0
    if name == "threshold" and required:
        return round(rng.uniform(-0.5, 0.5), 2)
    if name in ("norm_type", "p") and required:
        return 2.0
    if name in ("exponent",) and required:
        return rng.choice([2.0, 3.0, 0.5])
    if name in ("min", "max") and tail in ("clamp", "clip"):
        return -1.0 if name == "min" else 1.0
    if name in ("dim", "dims") and (required or (default is None and ("soft" in tail or tail in ("glu",)))):
        if rank < 2:
            return -1 if name == "dim" else [-1]
        choice = rng.choice([-1, *range(1, rank)])
        return choice if name == "dim" else [choice]
    if name == "config":
        return _config(op, shape, rng)
    return _KEEP


def _config(op: Operator, shape: tuple[int, ...], rng: random.Random) -> dict[str, Any]:
    hidden = shape[-1]
    heads = next((h for h in (16, 8, 4, 2, 1) if hidden % h == 0 and hidden // h >= 16), 1)
    family = op.name.split(":", 1)[1].split(".", 1)[0]
    return {CONFIG_KEY: family, "hidden_size": hidden, "intermediate_size": hidden * rng.choice([2, 4]),
            "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
            "hidden_act": "silu" if family not in ("gpt2", "bert", "t5") else "gelu"}


def resolve_callable(op: Operator) -> Callable[..., Any]:
    """The class or function ``op`` names."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if op.source == "transformers":
        return getattr(importlib.import_module(op.import_path), op.name.rsplit(".", 1)[-1])
    namespace, _, attr = op.name.partition(".")
    return getattr({"nn": nn, "F": F, "torch": torch}[namespace], attr)


def build_config(value: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in value.items() if k != CONFIG_KEY}
    return AutoConfig.for_model(value[CONFIG_KEY], **fields)


def instantiate(op: Operator, kwargs: dict[str, Any], shape: tuple[int, ...]) -> tuple[Callable[..., Any], list[tuple[int, ...]]]:
    """A callable ``(x, *others)`` for ``op`` with ``kwargs``, and the shapes of the other tensor
    operands it takes (same as the input: elementwise ops and two-input modules)."""
    target = resolve_callable(op)
    others = [tuple(shape)] * (op.arity - 1)
    if op.kind == "module":
        built = {k: build_config(v) if isinstance(v, dict) and CONFIG_KEY in v else v for k, v in kwargs.items()}
        module = target(**built)
        return module, others
    return (lambda x, *rest: target(x, *rest, **kwargs)), others
