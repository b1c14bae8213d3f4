"""The rules a topology's fields are checked by, and the error a topology fails with."""

from __future__ import annotations

import math
import re
from dataclasses import field, fields
from typing import Any, Callable


class ConfigError(ValueError):
    """An invalid topology: `field` is the dotted path ("workers[1].device") or None."""

    def __init__(self, field: str | None, reason: str, source: str | None = None):
        self.field, self.reason, self.source = field, reason, source
        super().__init__(": ".join(p for p in (source, field, reason) if p))

    def within(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, self.reason, self.source)


class Invalid(Exception):
    """Raised by a field check with what was expected."""


def rule(expected: str, ok: Callable[[Any], bool], convert: Callable[[Any], Any] = lambda v: v):
    def check(value: Any) -> Any:
        if ok(value):
            return convert(value)
        raise Invalid(expected)
    return check


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def number(expected: str, ok: Callable[[float], bool]) -> Callable[[Any], float]:
    return rule(expected, lambda v: (is_int(v) or isinstance(v, float)) and math.isfinite(v) and ok(v), float)


# YAML 1.1 reads on/off and yes/no as booleans: a choice that offers one of these words takes
# the boolean for it, and a true/false setting takes the words (as quoted strings too).
_TRUE_WORDS, _FALSE_WORDS = ("on", "yes", "true"), ("off", "no", "false")


def one_of(*options: str) -> Callable[[Any], str]:
    quoted = [repr(o) for o in options]
    expected = " or ".join(quoted) if len(quoted) == 2 else "one of " + ", ".join(quoted)
    as_word = {flag: next((w for w in words if w in options), None)
               for flag, words in ((True, _TRUE_WORDS), (False, _FALSE_WORDS))}

    def word(v: Any) -> Any:
        return as_word[v] if isinstance(v, bool) else v
    return rule(expected, lambda v: word(v) in options, word)


def _to_bool(v: Any) -> bool:
    return v if isinstance(v, bool) else v.strip().lower() in _TRUE_WORDS


def text(pattern: str, expected: str) -> Callable[[Any], str]:
    return rule(expected, lambda v: isinstance(v, str) and re.fullmatch(pattern, v) is not None)


port = rule("an integer 1..65535", lambda v: is_int(v) and 1 <= v <= 65535)
optional_port = rule("an integer 1..65535 or null", lambda v: v is None or is_int(v) and 1 <= v <= 65535)
metrics_port = rule("an integer 1..65535, or 0 or null for none",
                      lambda v: v is None or is_int(v) and 0 <= v <= 65535)
count = rule("an integer >= 1", lambda v: is_int(v) and v >= 1)
non_negative = rule("an integer >= 0", lambda v: is_int(v) and v >= 0)
positive = number("a number > 0", lambda x: x > 0)
boolean = rule("true or false", lambda v: isinstance(v, bool) or (
    isinstance(v, str) and v.strip().lower() in _TRUE_WORDS + _FALSE_WORDS), _to_bool)
optional_text = rule("a non-empty string or null", lambda v: v is None or (isinstance(v, str) and v != ""))
# Names end up in ipc socket paths, log file names and shell commands.
name = text(r"([A-Za-z0-9][A-Za-z0-9_.-]*)?", "a name of letters, digits, '.', '_' or '-'")
host = text(r"[^\s/]+", "a host name or IP address")
optional_host = rule("a host name or IP address, or null",
                       lambda v: v is None or isinstance(v, str) and re.fullmatch(r"[^\s/]+", v) is not None)
device = text(r"cpu|cuda(:\d+)?", "'cpu', 'cuda' or 'cuda:N'")


def setting(default: Any, check: Callable[[Any], Any]) -> Any:
    return field(default=default, metadata={"check": check})


class Section:
    __slots__ = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                value = getattr(self, f.name)
                try:
                    setattr(self, f.name, check(value))
                except Invalid as e:
                    raise ConfigError(f.name, f"expected {e}, got {value!r}") from None
        self.validate()

    def validate(self) -> None:
        pass
