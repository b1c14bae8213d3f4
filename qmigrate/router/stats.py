"""The counters `qmigrate stats` shows for the router: the scheduler's own, then what its
records hold now, per worker, how long moves took and the loop's errors. Plain data in, a
dict out (in the order they are shown)."""

from __future__ import annotations

from collections import Counter

from qmigrate.router.scheduler import Scheduler


def stats_counters(sched: Scheduler, *, unprinted: int, output_backlog: int, dropped_sends: int,
                   parked: dict, kv_imported: dict[str, int], worker_times: dict[str, tuple[int, int]],
                   errors: Counter[str]) -> dict[str, int | float]:
    counters = dict(sched.counters)
    counters.update(queued=len(sched.queue), live=len(sched.seqs),
                    open_leases=len(sched.leases),
                    workers=sum(w.alive for w in sched.workers.values()),
                    serving=sum(w.alive and not w.draining for w in sched.workers.values()),
                    unprinted=unprinted, output_backlog=output_backlog,
                    dropped_sends=dropped_sends)
    for name, w in sched.workers.items():
        counters[f"owned_{name}"] = len(w.owned)
        counters[f"leased_{name}"] = w.num_leased
        counters[f"asking_{name}"] = len(parked.get(name, ()))
    counters.update({f"kv_imported_{name}": n for name, n in kv_imported.items()},
                    kv_imported=sum(kv_imported.values()))
    delays: dict[str, list[float]] = {}
    for cause, seconds in sched.move_delays:
        delays.setdefault(cause, []).append(seconds)
    for cause, values in delays.items():  # from the decision to move to the new worker's lease
        values.sort()
        counters[f"move_delay_ms_p50_{cause}"] = round(values[len(values) // 2] * 1000, 3)
        counters[f"move_delay_ms_max_{cause}"] = round(values[-1] * 1000, 3)
    for name, (busy, idle) in worker_times.items():
        counters[f"busy_ms_{name}"], counters[f"idle_ms_{name}"] = busy, idle
    counters.update({f"errors_{kind}": n for kind, n in errors.items()})
    return counters
