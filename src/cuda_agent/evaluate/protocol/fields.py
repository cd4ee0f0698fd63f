"""Typed JSON messages: frozen dataclasses whose fields are checked as they are read.

``_Fields._parse`` refuses a missing, unknown or ill-typed field with a ``ValueError`` that names the
message and the field; ``to_dict`` writes the fields back. ``_Request`` adds the ``"op"`` key of a
request line, ``_Reply`` ignores what the request loop adds to every reply. The messages themselves
are all in ``evaluate.protocol.messages``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar

T = TypeVar("T", bound="_Fields")

# What the request loop and the process wrapper add to every reply.
_BOOKKEEPING = frozenset({"ok", "seconds", "nonce"})
# The exact types a plain item may have (JSON's own; bool is not an int here): a list of these is checked at once.
_EXACT: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
_PLAIN = frozenset({int, float, str, bool, type(None)})
# Per message class: its fields' types (resolved once: ``get_type_hints`` evaluates every annotation), its fields
# and their names: resolving the hints for every message would be half of parsing a region's GPU requests.
_SCHEMAS: dict[type, tuple[dict[str, Any], tuple[dataclasses.Field, ...], frozenset[str]]] = {}


def _check(tp: Any, value: Any, where: str) -> Any:
    """``value`` if it has type ``tp`` (nested messages parsed into their dataclasses); else ValueError."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ValueError(f"{where} is null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where} has the wrong type ({type(value).__name__})")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp) or (Any,)
        exact = _EXACT.get(item)
        if exact is not None and all(type(v) in exact for v in value):
            return list(value)  # what the item check would pass, without naming each item (most of a parse)
        return [_check(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {type(value).__name__}")
        _, item = typing.get_args(tp) or (str, Any)
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key that is not a string")
        return {k: _check(item, v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, _Fields):
        if isinstance(value, tp):
            return value
        return tp._parse(value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where} must be an integer, got {type(value).__name__}")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where} must be a number, got {type(value).__name__}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {type(value).__name__}")
        return value
    raise TypeError(f"protocol: no check for the type {tp!r}")  # a bug in this module, not in a reply


def _schema(cls: type) -> tuple[dict[str, Any], tuple[dataclasses.Field, ...], frozenset[str]]:
    found = _SCHEMAS.get(cls)
    if found is None:
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        found = _SCHEMAS[cls] = (typing.get_type_hints(cls), fields, frozenset(f.name for f in fields))
    return found


def _dump(value: Any) -> Any:
    if isinstance(value, _Request):
        return value.to_message()
    if isinstance(value, _Fields):
        return value.to_dict()
    if isinstance(value, list):
        if all(type(v) in _PLAIN for v in value):
            return list(value)
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


class _Fields:
    """Typed fields read from a JSON object (``_parse``) and written back (``to_dict``)."""

    _what: ClassVar[str] = "message"
    _ignored: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def _parse(cls: type[T], data: Any, where: str | None = None) -> T:
        where = where or cls._what
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be an object, got {type(data).__name__}")
        hints, fields, names = _schema(cls)
        extra = sorted(str(k) for k in data if k not in names and k not in cls._ignored)
        if extra:
            raise ValueError(f"{where}: unexpected field {', '.join(map(repr, extra))}")
        missing = [f.name for f in fields if f.name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{where}: missing field {', '.join(map(repr, missing))}")
        values = {f.name: _check(hints[f.name], data[f.name], f"{where}: field {f.name!r}") for f in fields if f.name in data}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The fields set (optional fields left at None are left out)."""
        return {f.name: _dump(getattr(self, f.name)) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if getattr(self, f.name) is not None}


class _Request(_Fields):
    op: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "op" in cls.__dict__:
            cls._what = f"{cls.op!r} request"

    def to_message(self) -> dict[str, Any]:
        return {"op": self.op} | self.to_dict()

    @classmethod
    def from_message(cls: type[T], data: dict[str, Any]) -> T:
        """Parse a request; its ``"op"`` may be there (it must be this class's) or already taken out."""
        return cls._parse(data)

    @classmethod
    def _parse(cls: type[T], data: Any, where: str | None = None) -> T:
        if isinstance(data, dict) and "op" in data:
            if data["op"] != cls.op:  # type: ignore[attr-defined]
                raise ValueError(f"{where or cls._what}: op is {data['op']!r}, not {cls.op!r}")  # type: ignore[attr-defined]
            data = {k: v for k, v in data.items() if k != "op"}
        return super()._parse.__func__(cls, data, where)  # type: ignore[attr-defined]


class _Reply(_Fields):
    _ignored = _BOOKKEEPING

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._what = cls.__name__

    @classmethod
    def from_reply(cls: type[T], data: dict[str, Any]) -> T:
        return cls._parse(data)
