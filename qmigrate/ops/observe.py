"""What an operator sees of the fleet: per-worker and per-GPU figures the router keeps.

Pure bookkeeping, updated per message (a lease sent, a result back, a VRAM report), never
per row, so the router's step path stays cheap. `snapshot` turns it into plain rows for the
Stats message, `qmigrate status` and the Prometheus gauges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Stats.workers rows and Stats.gpus rows, in this column order on the wire.
WORKER_COLUMNS = ("name", "node", "device", "gpu_uuid", "state", "owned", "leased", "batch_size",
                  "tokens_per_s", "kv_used_tokens", "kv_total_tokens", "block_size", "tokens_total",
                  "vram_free_fraction", "prompt_tokens", "cached_tokens", "gpu_blocks", "gpu_hits",
                  "host_blocks", "host_hits", "host_bytes_in", "host_bytes_out", "prefill_tokens_per_s")
GPU_COLUMNS = ("node", "uuid", "index", "total_bytes", "used_bytes", "free_bytes", "util_percent")

NO_TIER = (-1,) * 6   # the tier columns of a worker without a host tier
RATE_WINDOW_S = 5.0  # tokens/s is measured over about this long


@dataclass(slots=True)
class WorkerTally:
    node: str = ""
    device: str = ""
    batch_size: int = 0          # rows of the last lease sent
    free_kv_tokens: int = -1     # as the worker last reported; -1: unknown
    tokens_total: int = 0
    window_start: float = 0.0
    window_tokens: int = 0
    tokens_per_s: float = 0.0


@dataclass(slots=True)
class FleetObserver:
    workers: dict[str, WorkerTally] = field(default_factory=dict)
    gpus: dict[str, list] = field(default_factory=dict)   # uuid -> a GPU_COLUMNS row
    kv_transfer_bytes: int = 0

    def joined(self, name: str, node: str, device: str, now: float) -> None:
        self.workers[name] = WorkerTally(node=node, device=device, window_start=now)

    def leased(self, name: str, num_rows: int) -> None:
        if (t := self.workers.get(name)) is not None:
            t.batch_size = num_rows

    def shipped(self, num_tokens: int, kv_bytes_per_token: int) -> None:
        self.kv_transfer_bytes += max(0, num_tokens) * max(0, kv_bytes_per_token)

    def reported(self, name: str, num_tokens: int, free_kv_tokens: int, now: float) -> None:
        """A step result of num_tokens tokens came back from name."""
        if (t := self.workers.get(name)) is None:
            return
        t.tokens_total += num_tokens
        t.window_tokens += num_tokens
        if free_kv_tokens >= 0:
            t.free_kv_tokens = free_kv_tokens
        self._roll(t, now)

    def asked(self, name: str, free_kv_tokens: int) -> None:
        if (t := self.workers.get(name)) is not None and free_kv_tokens >= 0:
            t.free_kv_tokens = free_kv_tokens

    def vram(self, node: str, uuid: str, index: int, total: int, used: int, free: int, util: int) -> None:
        self.gpus[uuid] = [node, uuid, index, total, used, free, util]

    def tick(self, now: float) -> None:
        for t in self.workers.values():
            self._roll(t, now)

    @staticmethod
    def _roll(t: WorkerTally, now: float) -> None:
        span = now - t.window_start
        if span >= RATE_WINDOW_S:
            t.tokens_per_s = t.window_tokens / span
            t.window_start, t.window_tokens = now, 0
        elif span > 1.0 and not t.tokens_per_s:  # the first window: what it has so far
            t.tokens_per_s = t.window_tokens / span

    def snapshot(self, sched) -> tuple[list[list], list[list]]:
        """(worker rows, GPU rows) in WORKER_COLUMNS / GPU_COLUMNS order."""
        rows = []
        for name, w in sched.workers.items():
            t = self.workers.get(name) or WorkerTally()
            state = "dead" if not w.alive else "draining" if w.draining else (
                "memory-short" if w.is_memory_short else "no-prefill" if not w.may_prefill else "up")
            kv_used = max(0, w.kv_tokens - t.free_kv_tokens) if t.free_kv_tokens >= 0 and w.kv_tokens else -1
            rows.append([name, t.node, t.device, w.gpu_uuid, state, len(w.owned), w.num_leased,
                         t.batch_size, round(t.tokens_per_s, 1), kv_used, w.kv_tokens, w.block_size,
                         t.tokens_total, -1.0 if w.free_vram_fraction is None else round(w.free_vram_fraction, 4),
                         sched.cache_queries[name], sched.cache_hits[name],
                         *sched.tier_stats.get(name, NO_TIER), w.prefill_tokens_per_s])
        return rows, list(self.gpus.values())


def hit_rate(prompt_tokens: int, cached_tokens: int) -> float | None:
    """The share of prompt tokens found in a prefix cache (None: no prompts yet)."""
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else None


def as_dicts(columns: tuple[str, ...], rows: list[list]) -> list[dict]:
    return [dict(zip(columns, row)) for row in rows]
