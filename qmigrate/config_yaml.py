"""YAML text and plain mappings -> checked section dataclasses. The only module that reads YAML."""

from __future__ import annotations

import difflib
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from .config_rules import ConfigError


def kind_of(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def check_keys(cls: type, data: dict, where: str) -> None:
    known = [f.name for f in fields(cls)]
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (fields: {', '.join(known)})"
            raise ConfigError(None, f"unknown field {key!r} {where}{hint}")


def build_section(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {kind_of(data)}")
    check_keys(cls, data, f"in {path}")
    try:
        return cls(**data)
    except ConfigError as e:
        raise e.within(path) from None


def parse_settings(cls: type, section: str, items: list[str]) -> dict[str, Any]:
    """KEY=VALUE texts (VALUE read as a YAML scalar) -> fields of `cls`, checked."""
    out = read_settings(section, items)
    build_section(cls, out, section)
    return out


def read_settings(section: str, items: list[str]) -> dict[str, Any]:
    """KEY=VALUE texts (VALUE read as a YAML scalar) -> a mapping, not yet checked."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(section, f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"{section}.{key.strip()}", f"unreadable value {text!r}") from None
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one silently."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor" may be overridden by design
            continue
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, str):
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; unreadable text, invalid YAML or an empty file is a ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(None, "not UTF-8 text", str(path)) from None
    except OSError as e:
        reason = "no such file" if isinstance(e, FileNotFoundError) else f"cannot read: {e.strerror or e}"
        raise ConfigError(None, reason, str(path)) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(None, f"invalid YAML{where}: {getattr(e, 'problem', None) or e}", str(path)) from None
    if data is None:
        raise ConfigError(None, "empty file, expected a topology mapping", str(path))
    return data


def write_yaml(data: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
