"""What a qmigrate server did during a `bench serve` run, from its router's Prometheus /metrics
read before and after the run: sequences moved by cause and by mechanism, preemptions (KV
evicted for room), KV bytes shipped, and the prefix cache's hits over the fleet. Any server
that does not export a counter reads 0 for it."""

from __future__ import annotations

import re
import time
import urllib.request

# the router's /metrics refreshes on its tick (0.1 s): a read this long after the run sees it all
SETTLE_S = 0.3
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Samples of the Prometheus text format: {(name, ((label, value), ...)): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse(resp.read().decode("utf-8", "replace"))


def _by_label(before: dict, after: dict, name: str, label: str) -> dict[str, int]:
    out = {}
    for (n, labels), value in after.items():
        if n != name:
            continue
        key = dict(labels).get(label, "")
        if (delta := value - before.get((n, labels), 0.0)) > 0:
            out[key] = out.get(key, 0) + int(round(delta))
    return out


def _total(before: dict, after: dict, name: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)


def run_counts(before: dict, after: dict) -> dict:
    """The counters' growth between two scrapes."""
    prompt = _total(before, after, "qmigrate_prefix_prompt_tokens_total")
    cached = _total(before, after, "qmigrate_prefix_cached_tokens_total")
    causes = _by_label(before, after, "qmigrate_migrations_total", "cause")
    return {"migrations": sum(causes.values()), "migrations_by_cause": causes,
            "migrations_by_mechanism": _by_label(before, after, "qmigrate_migrations_by_mechanism_total", "mechanism"),
            "preemptions": int(round(_total(before, after, "qmigrate_preemptions_total"))),
            "resends": int(round(_total(before, after, "qmigrate_resends_total"))),
            "kv_bytes_shipped": int(round(_total(before, after, "qmigrate_kv_transfer_bytes_total"))),
            "prefix_prompt_tokens": int(prompt), "prefix_cached_tokens": int(cached),
            "prefix_hit_rate": cached / prompt if prompt else None,
            "tokens_by_worker": _by_label(before, after, "qmigrate_generated_tokens_total", "worker")}


class ServerCounters:
    """Scrapes before a run and after it; a server that cannot be read gives None, not an error."""

    def __init__(self, url: str | None):
        self.url = url
        self.before: dict | None = None

    def start(self) -> None:
        if self.url is not None:
            time.sleep(SETTLE_S)   # what came before (the warm-up, the run before) counted first
        self.before = self._read()

    def stop(self) -> dict | None:
        if self.url is None or self.before is None:
            return None
        time.sleep(SETTLE_S)
        after = self._read()
        return None if after is None else run_counts(self.before, after)

    def _read(self) -> dict | None:
        if self.url is None:
            return None
        try:
            return scrape(self.url)
        except (OSError, ValueError):
            return None


def describe(counts: dict) -> str:
    """One line: migrations by cause and mechanism, preemptions, bytes shipped, prefix hits."""
    causes = ", ".join(f"{k} {v}" for k, v in sorted(counts["migrations_by_cause"].items())) or "none"
    how = ", ".join(f"{k} {v}" for k, v in sorted(counts["migrations_by_mechanism"].items()))
    hits = counts["prefix_hit_rate"]
    return (f"migrations {counts['migrations']} ({causes}{'; ' + how if how else ''}), preemptions "
            f"{counts['preemptions']}, KV shipped {counts['kv_bytes_shipped'] / 1e6:,.1f} MB, prefix hits "
            + ("-" if hits is None else f"{100 * hits:.1f}%"))
