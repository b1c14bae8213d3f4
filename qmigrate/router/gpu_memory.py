"""What the VRAM monitors last reported of each GPU, and the free share of it that the router's
memory watermarks compare (RouterConfig.min_free_vram_fraction, admit_free_vram_fraction).

The share is of the memory the fleet's own workers do not hold on that GPU: their KV pools,
weights and graphs are theirs by design, and only what other processes take is pressure."""

from __future__ import annotations

from qmigrate.router.records import WorkerState

MAX_GPUS = 4096  # GPUs whose last memory report is kept


class GpuMemory:
    def __init__(self, workers: dict[str, WorkerState]):
        self.workers = workers
        self.reports: dict[str, tuple[int, int]] = {}   # GPU uuid -> (total, free) bytes

    def report(self, gpu_uuid: str, total: int, free: int) -> None:
        """A monitor's report of one GPU, in bytes (the oldest GPU forgotten past MAX_GPUS)."""
        if gpu_uuid not in self.reports and len(self.reports) >= MAX_GPUS:
            self.reports.pop(next(iter(self.reports)))
        self.reports[gpu_uuid] = (total, free)

    def free_fraction(self, gpu_uuid: str) -> float | None:
        """Free memory over the memory the fleet does not hold, on that GPU; None: no report."""
        if (report := self.reports.get(gpu_uuid)) is None:
            return None
        total, free = report
        held = sum(w.held_bytes for w in self.workers.values() if w.alive and w.gpu_uuid == gpu_uuid)
        others = total - held  # free memory plus what other processes hold
        return 1.0 if others <= 0 else min(1.0, max(0.0, free / others))
