"""Worker keys under their names of the release before: accepted for one more release under
their new names, with one notice per old key however many workers use it."""

from __future__ import annotations

import logging
from typing import Any, Callable

from . import config_rules as rules
from .config_rules import ConfigError

log = logging.getLogger("qmigrate.config")


def _gib_to_bytes(value: Any) -> int:
    return int(rules.positive(value) * 2**30)


# Worker keys under their names of the release before, accepted (with a notice) for one more:
# old name -> (new name, the old value as the new one's value or None for the same, a note)
RENAMED_WORKER_KEYS: dict[str, tuple[str, Callable[[Any], Any] | None, str]] = {
    "max_seqs": ("max_num_seqs", None, ""),
    "max_tokens": ("max_num_batched_tokens", None, ""),
    "cpu_kv_gib": ("cpu_kvcache_space_bytes", _gib_to_bytes, ", in bytes"),
    "cuda_graphs": ("enforce_eager", lambda on: not rules.boolean(on), ", its opposite"),
    "prefix_cache": ("enable_prefix_caching", None, ""),
    "tensor_parallel": ("tensor_parallel_size", None, ""),
}


def rename_worker_keys(data: Any, path: str, renamed: dict[str, list[str]]) -> Any:
    """A worker's mapping with its old keys under their new names; each old key's place is
    added to `renamed[old]` (for one notice per key). Both names at once is a ConfigError."""
    if not isinstance(data, dict) or not any(old in data for old in RENAMED_WORKER_KEYS):
        return data
    out = dict(data)
    for old, (new, convert, _) in RENAMED_WORKER_KEYS.items():
        if old not in out:
            continue
        if new in out:
            raise ConfigError(f"{path}.{old}", f"{old!r} is the old name of {new!r}, which is also given: "
                              f"keep only {new!r}")
        value = out.pop(old)
        try:
            out[new] = convert(value) if convert is not None else value
        except rules.Invalid as e:
            raise ConfigError(f"{path}.{old}", f"expected {e}, got {value!r}") from None
        renamed.setdefault(old, []).append(f"{path}.{old}")
    return out


def log_renamed(renamed: dict[str, list[str]], source: str) -> None:
    """One line per old key, however many workers use it."""
    for old, places in renamed.items():
        where = ", ".join(places) if source == "<dict>" else f"{source}: {', '.join(places)}"
        new, _, note = RENAMED_WORKER_KEYS[old]
        log.warning("%s: %r is deprecated, use %r%s (the old name is accepted for one release)",
                    where, old, new, note)
