"""Strict loading of plain YAML data into frozen dataclasses.

Unknown keys, wrong types and bad values are errors that name the file, the path inside it and,
for a misspelt key, the closest known one. Every section of the policy file, and every
policy's own parameters, go through :func:`load`, so the rules live in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A policy file (or part of one) is invalid; the message says where and why."""

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        self.path = path
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path or '<root>'}: {message}")


def _join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


SECRET = {"secret": True}
"""``dataclasses.field(metadata=SECRET)``: the value is a credential, never shown in errors."""
SECRET_KEYS = {"secret_keys": True}
"""``dataclasses.field(metadata=SECRET_KEYS)``: a mapping whose keys are credentials, shown
masked in error paths."""


def mask_secret(key: str) -> str:
    """Enough of a credential to find it in the file, not enough to use it."""
    if key.startswith("sha256:"):
        return key[:15] + "..."
    return key[:4] + "..." if len(key) > 8 else "..."


def load(cls: type[T], data: Any, path: str = "", source: str | None = None) -> T:
    """Build dataclass ``cls`` from ``data`` (a mapping), strictly."""
    return typing.cast(T, _convert(cls, data, path, source))


def _load_dataclass(cls: type, data: Any, path: str, source: str | None) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping, got {type(data).__name__}", source)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = {n.replace("_", "-"): n for n in fields} | {n: n for n in fields}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or key not in names:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            tip = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(fields)}"
            raise ConfigError(_join(path, key), f"unknown key{tip}", source)
        name = names[key]
        meta = fields[name].metadata
        where = _join(path, key)
        if meta.get("secret"):
            try:
                kwargs[name] = _convert(hints[name], value, where, source)
            except ConfigError:
                raise ConfigError(
                    where,
                    f"invalid value of type {type(value).__name__} (a secret: not shown)",
                    source,
                ) from None
        elif meta.get("secret_keys") and isinstance(value, Mapping):
            kwargs[name] = _convert_secret_keys(hints[name], value, where, source)
        else:
            kwargs[name] = _convert(hints[name], value, where, source)
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and (f.default_factory is dataclasses.MISSING)
        ):
            raise ConfigError(_join(path, name), "required key is missing", source)
    try:
        obj = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(path, str(exc), source) from exc
    return obj


def _convert_secret_keys(
    tp: Any, value: Mapping[Any, Any], path: str, source: str | None
) -> Mapping[Any, Any]:
    """A mapping whose keys are secrets: errors name each entry by its masked key."""
    key_type, value_type = get_args(tp) or (str, Any)
    out = {}
    for k, v in value.items():
        where = f"{path}[{mask_secret(str(k))}]"
        out[_convert(key_type, k, where, source)] = _convert(value_type, v, where, source)
    return types.MappingProxyType(out)


def _convert(tp: Any, value: Any, path: str, source: str | None) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _load_dataclass(tp, value, path, source)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path, source)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[-1] if errors else ConfigError(path, "bad value", source)
    if origin is typing.Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}", source
            )
        return value
    if origin in (tuple,):
        args = get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}", source)
        item = args[0]
        return tuple(_convert(item, v, _join(path, i), source) for i, v in enumerate(value))
    if origin in (dict, Mapping, typing.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {type(value).__name__}", source)
        args = get_args(tp) or (str, Any)
        return types.MappingProxyType(
            {
                _convert(args[0], k, _join(path, k), source): _convert(
                    args[1], v, _join(path, k), source
                )
                for k, v in value.items()
            }
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}", source)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {value!r}", source)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}", source)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}", source)
        return value
    raise ConfigError(path, f"unsupported type {tp!r}", source)  # a bug in a dataclass, not input
