"""Our tools as plain Python functions with type hints and Google-style docstrings, built from the tools' own
JSON schemas (one source): the shape TRL's ``environment_factory`` and verifiers' tool environments read a tool
from (both turn a function's signature and docstring into a schema with ``transformers.utils.get_json_schema``
or their own equivalent). Each function forwards its keyword arguments to ``call(name, arguments)``.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Callable

from cuda_agent.agent.session import AgentConfig
from cuda_agent.agent.tools.registry import TOOLS
from cuda_agent.agent.tools.toolbox import Toolbox  # noqa: F401 - importing it registers every tool family

_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}


def tool_schemas(config: AgentConfig | None = None) -> list[dict[str, Any]]:
    """The schemas an episode's toolbox offers with ``config``'s limits, without making a toolbox (which would
    start a shell): only the limits enter a schema's text."""
    config = config or AgentConfig()
    limits = SimpleNamespace(command_timeout_s=config.command_timeout_s, max_output_chars=config.max_output_chars)
    return [tool.schema(limits) for tool in TOOLS.values()]


def tool_function(schema: dict[str, Any], call: Callable[..., str], *, method: bool = False) -> Callable[..., str]:
    """A function for one tool schema (OpenAI function format) that calls ``call(name, arguments)``.
    ``method``: its first parameter is ``self`` and the call is ``call(self, name, arguments)`` (to be set on a
    class: TRL lists an environment's tools from its class)."""
    spec = schema["function"]
    name, parameters = spec["name"], spec.get("parameters", {})
    required = set(parameters.get("required", ()))
    properties = parameters.get("properties", {})
    # Required first: a Python signature cannot put a parameter without a default after one with it.
    ordered = sorted(properties, key=lambda p: p not in required)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if method else []
    annotations: dict[str, Any] = {}
    for key in ordered:
        kind = _TYPES.get(properties[key].get("type"), str)
        annotations[key] = kind if key in required else (kind | None)
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY if method else
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=inspect.Parameter.empty if key in required else None,
                                        annotation=annotations[key]))
    annotations["return"] = str

    def forward(*args: Any, **kwargs: Any) -> str:
        owner = args[:1] if method else ()
        kwargs.update(zip(ordered, args[len(owner):]))
        # Unset optional arguments stay unset: the tool's own defaults apply, as when a model leaves them out.
        return call(*owner, name, {k: v for k, v in kwargs.items() if v is not None})

    lines = [_one_line(spec.get("description", name)), "", "Args:"]
    lines += [f"    {key}: {_one_line(properties[key].get('description') or key)}" for key in ordered]
    lines += ["", "Returns:", "    The tool's output, as the model sees it."]
    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = "\n".join(lines) if ordered else "\n".join(lines[:1] + lines[-3:])
    forward.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    forward.__annotations__ = annotations
    return forward


def _one_line(text: str) -> str:
    # The docstring parsers split arguments on "name:" at the start of a line: keep each text on one line.
    return " ".join(str(text).split())
