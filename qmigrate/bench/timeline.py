"""What the benchmark's paths measure with: a path's result, the arrival times of each
request's tokens (TTFT and TPOT follow from them), a progress line, and the device's sync,
free and heap helpers."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class PathResult:
    name: str
    seconds: float
    useful_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    migrations: dict[str, int] = field(default_factory=dict)
    move_delay_ms: dict[str, float] = field(default_factory=dict)  # router's p50/max per cause
    longest_request_s: float = 0.0  # start to last token of the longest request: a floor of the run

    @property
    def tok_per_s(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None
        return {"seconds": self.seconds, "useful_tokens": self.useful_tokens, "tok_per_s": self.tok_per_s,
                "ttft_p50_s": pct(self.ttft_s, 50), "ttft_p99_s": pct(self.ttft_s, 99),
                "tpot_p50_ms": _ms(pct(self.tpot_s, 50)), "tpot_p99_ms": _ms(pct(self.tpot_s, 99)),
                "migrations": self.migrations, "move_delay_ms": self.move_delay_ms,
                "longest_request_s": self.longest_request_s}


def _ms(x):
    return None if x is None else x * 1000


class Timeline:
    """Arrival times of each request's tokens, from which TTFT and TPOT follow."""

    def __init__(self, lengths: list[int], t0: float):
        self.t0, self.lengths = t0, lengths
        self.first = [0.0] * len(lengths)
        self.last = [0.0] * len(lengths)
        self.count = [0] * len(lengths)
        self.num_done = 0

    def add(self, i: int, n: int, now: float) -> None:
        if self.count[i] == 0 and n:
            self.first[i] = now
        self.count[i] += n
        self.last[i] = now
        if self.count[i] >= self.lengths[i] and n:
            self.num_done += 1

    def result(self, name: str, end: float, migrations=None) -> PathResult:
        ttft = [f - self.t0 for f in self.first]
        tpot = [(l - f) / (n - 1) for f, l, n in zip(self.first, self.last, self.lengths) if n > 1]
        longest = max(self.lengths, default=0)
        floor = max((l - self.t0 for l, n in zip(self.last, self.lengths) if n == longest), default=0.0)
        return PathResult(name, end - self.t0, sum(self.lengths), ttft, tpot, migrations or {},
                          longest_request_s=floor)


class Progress:
    """Requests done, tokens/s and what waits, redrawn on one line of a terminal's stderr."""

    def __init__(self, name: str, total: int, num_requests: int | None = None):
        from qmigrate.ops.progress import ProgressLine
        self.total, self.num_requests, self.t0 = total, num_requests, time.monotonic()
        self.line = ProgressLine(f"  {name}")

    def update(self, done_tokens: int, done_requests: int | None = None, queued: int | None = None) -> None:
        if self.line.due():
            rate = done_tokens / max(time.monotonic() - self.t0, 1e-9)
            if done_requests is None:
                self.line.show(done_tokens, self.total, rate, unit="tokens")
            else:
                self.line.show(done_requests, self.num_requests, rate, queued)

    def close(self) -> None:
        self.line.clear()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


@contextmanager
def frozen_heap():
    """A timed section without full garbage collections over what was built before it (as
    every role serves); the heap is handed back to the collector after it."""
    import gc
    from qmigrate.ops.process import freeze_heap
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def free(device: str) -> None:
    import gc
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()
