"""The tool registry: a ``Tool`` is a name, a JSON schema, validation of its arguments and ``call``.

A tool family's module registers its tools with ``@register("name")``, the schema
next to the code it describes; ``Toolbox`` offers the model every registered tool,
in the order they were registered (bash, files, search, todo: the order the
package imports the families in), and finds the one a call names with ``get_tool``.

Tools are stateless, one instance each; what an episode keeps (the shell, the
jobs, the todo list, the workspace) lives on the ``Toolbox`` passed to ``call``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from cuda_agent.agent.tools.toolbox import Toolbox


@dataclass
class ToolResult:
    content: str  # what the model sees
    error: bool = False  # a bad call or a failed action; the episode goes on
    metadata: dict[str, Any] = field(default_factory=dict)


class ToolError(Exception):
    """A bad call or a failed action; the message is shown to the model as is."""


class Tool:
    """One tool the model may call. A subclass sets ``description`` and ``parameters`` (or overrides
    ``describe`` where they depend on the toolbox's limits) and implements ``call``; ``register``
    sets ``name``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {}

    def describe(self, box: Toolbox) -> tuple[str, dict[str, Any]]:
        """(description, JSON schema of the arguments) as the model sees them."""
        return self.description, self.parameters

    def schema(self, box: Toolbox) -> dict[str, Any]:
        """The OpenAI function schema (a fresh copy: callers may change it)."""
        description, parameters = self.describe(box)
        return {"type": "function", "function": {"name": self.name, "description": description,
                                                 "parameters": copy.deepcopy(parameters)}}

    def parse(self, box: Toolbox, arguments: str | dict[str, Any]) -> dict[str, Any]:
        """The arguments of a call, from JSON text or a dict, checked against the schema."""
        if isinstance(arguments, str):
            if not arguments.strip():
                arguments = {}  # some models send "" for a call without arguments
            else:
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError as exc:
                    raise ToolError(f"the arguments of {self.name} are not valid JSON ({exc}); send one JSON "
                                    "object such as {\"path\": \"model.py\"}, with strings quoted and escaped"
                                    ) from None
        if not isinstance(arguments, dict):
            raise ToolError(f"the arguments of {self.name} must be a JSON object, not {json_type(arguments)}")
        try:
            return validate(arguments, self.describe(box)[1])
        except ToolError as exc:
            raise ToolError(f"{self.name}: {exc}") from None

    def call(self, box: Toolbox, **arguments: Any) -> ToolResult:
        """Do it; raise ``ToolError`` for a bad call or a failed action."""
        raise NotImplementedError


_TOOLS: dict[str, Tool] = {}
TOOLS: Mapping[str, Tool] = MappingProxyType(_TOOLS)  # name -> tool, in the order registered

ToolClass = TypeVar("ToolClass", bound=type[Tool])


def register(name: str) -> Callable[[ToolClass], ToolClass]:
    """Class decorator: register one instance of the ``Tool`` subclass under ``name``."""
    def decorate(cls: ToolClass) -> ToolClass:
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise TypeError(f"@register({name!r}) takes a subclass of Tool, not {cls!r}")
        if name in _TOOLS:
            other = type(_TOOLS[name])
            raise ValueError(f"a tool named {name!r} is registered already ({other.__module__}.{other.__qualname__})")
        cls.name = name
        _TOOLS[name] = cls()
        return cls
    return decorate


def tool_names() -> tuple[str, ...]:
    return tuple(_TOOLS)


def get_tool(name: str) -> Tool:
    tool = _TOOLS.get(name)
    if tool is None:
        raise ToolError(f"unknown tool {name!r}; the tools are: {', '.join(_TOOLS)}")
    return tool


# ----------------------------------------------------------------------------- the JSON schema subset

def object_schema(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
               "array": "an array", "object": "an object"}


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def validate(value: Any, schema: dict[str, Any], where: str = "") -> Any:
    """``value`` checked against the small subset of JSON schema the tools use; integral floats become
    ints. ``where`` names the value in messages ('' for the arguments object itself)."""
    kind = schema.get("type")
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool)
                   or isinstance(value, float) and value.is_integer(),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }.get(kind, True)
    if not ok:
        raise ToolError(f"{where or 'the arguments'} must be {_JSON_TYPES[kind]}, not {json_type(value)} "
                        f"({json.dumps(value)[:60]})")
    if kind == "integer":
        value = int(value)
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"{where} must be one of {', '.join(map(json.dumps, schema['enum']))}, not {json.dumps(value)}")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            raise ToolError(f"{where} must have at least {schema['minItems']} item(s)")
        return [validate(item, schema["items"], f"{where}[{i}]") for i, item in enumerate(value)]
    if kind == "object":
        props = schema.get("properties", {})
        inner = (where + ".") if where else ""
        for name in schema.get("required", ()):
            if name not in value:
                hint = props[name].get("description") or _JSON_TYPES.get(props[name].get("type"), "")
                raise ToolError(f"missing required argument {inner}{name!r}: {hint.rstrip('.')}. Required: "
                                f"{', '.join(schema['required'])}")
        for name in value:
            if name not in props:
                raise ToolError(f"unknown argument {inner}{name}; the arguments are: {', '.join(props)}")
        return {name: validate(item, props[name], inner + name) for name, item in value.items()}
    return value
