"""Step timelines: what each worker and the router did and when, to read a run afterwards.

Off unless the topology's `trace_dir` names a directory (`qmigrate bench --trace DIR` sets it
in the topology of each run). A traced process keeps
(monotonic time, event, fields...) tuples in memory and appends them as JSON lines to
DIR/<label>-<pid>.jsonl when it flushes (the roles flush with their heartbeat or metrics
tick; the router, the workers and the detokenizer also flush when SIGTERM stops them, and
ingest as it unwinds). The processes of one host share CLOCK_MONOTONIC, so their files line up.

Worker events: ask (request no.), lease (id, steps, rows, full forms), start_begin /
start_end (lease id), prompts (a launched step's prompt rows, their new tokens, the
positions of those found cached), launch (rows), collect_begin (rows) / collect_end, finish_begin /
finish_end (lease id), withdrawn (lease id: a chain revoked before it started, answered
unrun), masks (a step's constrained rows, seconds their masks took where the matchers are (for masks
the device waits for: those of the step before, whose answer has come by then),
seconds the worker took to have them, 1 if it had them before building the next step:
`Engine.settle`). Router events: submit (sequences offered,
taken), request (worker, request no.), grant (worker, lease id, rows, steps, request no.),
result (worker, lease id), tokens
(worker, rows: a step's tokens on their way to the detokenizer). The token path after
the router: the detokenizer's in (rows of a Tokens message) and out (replies sent to ingest),
ingest's in (replies received) and each HTTP process's in (replies it takes from ingest).
Gaps between a hop's arrivals that grow from one hop to the next are latency that hop adds
to a stream's inter-token times.

`summarize(DIR)` (`python -m qmigrate.ops.trace DIR`; with a `qmigrate bench serve --json`
report after it, run by run: `summarize_runs`) turns the files into the figures that located
this project's gaps: per worker, the time with no step on the device, the time the host waited
for the device, host time per step, step-to-step times, and what an admission (a lease with
prompts) costs the running streams, part by part; for the router, how long a request waited
for its lease.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from qmigrate.ops.process import before_sigterm

GAP_S = 0.002  # a stretch with no step on the device longer than this is listed


class Tracer:
    def __init__(self, directory: str, label: str):
        self.path = Path(directory) / f"{label}-{os.getpid()}.jsonl"
        self.events: list[tuple] = []

    def __call__(self, kind: str, *fields) -> None:
        self.events.append((time.monotonic(), kind, *fields))

    def flush(self) -> None:
        if self.events:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.events)
            self.events.clear()


class _Off:
    """The tracer when tracing is off: every call costs one no-op method call."""

    def __call__(self, kind: str, *fields) -> None:
        pass

    def flush(self) -> None:
        pass


OFF = _Off()


def tracer(label: str, directory: str | None) -> Tracer | _Off:
    if not directory:
        return OFF
    Path(directory).mkdir(parents=True, exist_ok=True)
    return Tracer(directory, label)


def flush_on_sigterm(trace: Tracer | _Off) -> None:
    """A role stopped with SIGTERM (as its node stops it) writes its last stretch first, then
    ends as the signal would have ended it. Only a traced process changes its handler; it is
    called from the role's main thread."""
    if trace is not OFF:
        before_sigterm(trace.flush)


# --- reading a trace back ---------------------------------------------------------------

def summarize(directory: str | Path, window: tuple[float, float] | None = None) -> list[str]:
    """One block of lines per traced process of the directory; `window` (monotonic seconds,
    first and last): only the events within it."""
    lines = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if window is not None:
            events = [e for e in events if window[0] <= e[0] <= window[1]]
        if not events:
            continue
        kinds = {e[1] for e in events}
        if "collect_end" in kinds:
            lines += worker_summary(path.stem, events)
        elif "grant" in kinds:
            lines += router_summary(path.stem, events)
        if "in" in kinds:
            lines.append(gap_line(f"{path.stem}: messages in", [e[0] for e in events if e[1] == "in"]))
    return lines


def gap_line(what: str, times: list[float]) -> str:
    """The gaps between successive arrivals (a stream's tokens arrive with them)."""
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if not gaps:
        return f"{what}: {len(times)}"
    return (f"{what}: {len(times)}, gaps p50 {_ms(gaps, 0.5)} p90 {_ms(gaps, 0.9)} p99 {_ms(gaps, 0.99)} "
            f"max {gaps[-1] * 1000:.1f} ms")


def worker_summary(label: str, events: list) -> list[str]:
    starts = [e[0] for e in events if e[1] == "start_end"]
    ends = [e[0] for e in events if e[1] == "finish_end"]
    if not starts or not ends:
        return [f"{label}: no lease ran"]
    first, last = starts[0], ends[-1]
    on_device = steps = 0
    idle = blocked = 0.0
    gaps = []
    last_t, collect_t = first, None
    for t, kind, *fields in events:
        if not first <= t <= last:
            continue
        if on_device == 0:
            idle += t - last_t
            if t - last_t > GAP_S:
                gaps.append(t - last_t)
        last_t = t
        if kind == "start_end" or (kind == "launch" and fields and fields[0] > 0):
            on_device += 1
        elif kind == "collect_begin":
            collect_t = t
        elif kind == "collect_end" and collect_t is not None:
            on_device = max(0, on_device - 1)
            blocked += t - collect_t
            steps += 1
    span = last - first
    per_step = span / max(1, steps) * 1000
    leases = [e for e in events if e[1] == "lease"]
    multi = sum(1 for e in leases if e[3] > 1)
    return [f"{label}: {steps} steps in {span:.3f} s ({per_step:.2f} ms a step), {len(leases)} leases "
            f"({multi} of several steps)",
            f"  no step on the device {idle * 1000:.0f} ms ({idle / span:.1%}); "
            f"{len(gaps)} stretches over {GAP_S * 1000:g} ms, longest {max(gaps, default=0) * 1000:.1f} ms",
            f"  host waited for the device {blocked * 1000:.0f} ms ({blocked / span:.1%}); "
            f"host time {(span - blocked) / max(1, steps) * 1000:.2f} ms a step"] + _step_lines(events) \
        + _mask_lines(events)


def _mask_lines(events: list) -> list[str]:
    """Steps with constrained rows: how long their masks took where the matchers are, how long
    the worker then took to have them, and how often it had them before building the next step."""
    masks = [e for e in events if e[1] == "masks"]
    if not masks:
        return []
    rows, took, waited = ([e[i] for e in masks] for i in (2, 3, 4))
    early = sum(e[5] for e in masks if len(e) > 5)
    return [f"  {len(masks)} steps waited for masks ({statistics.median(rows):.0f} constrained rows p50): "
            f"filled in p50 {_ms(took, 0.5)} ms, p90 {_ms(took, 0.9)}; waited for p50 {_ms(waited, 0.5)} ms, "
            f"p90 {_ms(waited, 0.9)}; sampled before the next step was built in {early}"]


def _ms(values: list[float], q: float) -> str:
    values = sorted(values)
    return f"{values[min(len(values) - 1, int(len(values) * q))] * 1000:.2f}"


def _step_lines(events: list) -> list[str]:
    """Step to step (collect to collect), and what an admission costs the streams: for each
    lease with prompts, from the end of the last step before it started to the end of its
    own step, with the parts of that stretch: the wait for the lease to come, its start, and
    the starts of leases launched behind it before it was collected."""
    ends = [e[0] for e in events if e[1] == "collect_end"]
    lines = []
    if len(ends) > 1:
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        lines.append(f"  step to step p50 {_ms(gaps, 0.5)} ms, p90 {_ms(gaps, 0.9)}, p99 {_ms(gaps, 0.99)}")
        lines += _admission_lines(events)
    arrived, prompts, open_ = {}, [], {}   # open_: prompt leases started, their step not collected
    last_end = begun = finishing = None
    for t, kind, *fields in events:
        if kind == "lease":
            arrived[fields[0]] = (t, fields[3] > 0)
        elif kind == "start_begin":
            begun = t
        elif kind == "start_end" and begun is not None:
            for other in open_.values():
                other["behind"] += t - begun
            t0, has_prompts = arrived.pop(fields[0], (begun, False))
            if has_prompts and last_end is not None:
                open_[fields[0]] = {"from": last_end, "wait": max(0.0, t0 - last_end), "start": t - begun,
                                    "behind": 0.0}
        elif kind == "finish_begin":
            finishing = fields[0]
        elif kind == "collect_end":
            last_end = t
            if (got := open_.pop(finishing, None)) is not None:
                got["gap"] = t - got["from"]
                prompts.append(got)
    if prompts:
        def part(key: str, q: float = 0.5) -> str:
            return _ms([p[key] for p in prompts], q)
        lines.append(f"  {len(prompts)} leases with prompts: last step's end to theirs p50 {part('gap')} ms, "
                     f"p90 {part('gap', 0.9)}; parts (p50): waiting for the lease "
                     f"{part('wait')}, its start {part('start')}, leases started behind it first {part('behind')}")
    return lines


def _admission_lines(events: list) -> list[str]:
    """Steps (collect to collect) that admitted prompt rows against the others: what a
    stream's token waits for when a prompt comes in beside it, and how much of the tail
    (steps over twice the median) that is."""
    with_prompts, without, tokens, admitted = [], [], [], False
    last = None
    for t, kind, *fields in events:
        if kind == "prompts" and fields and fields[0] > 0:
            admitted = True
            tokens.append(fields[1])
        elif kind == "collect_end":
            if last is not None:
                (with_prompts if admitted else without).append(t - last)
            last, admitted = t, False
    if not with_prompts:
        return []
    median = statistics.median(with_prompts + without)
    long_ = [d for d in with_prompts if d > 2 * median]
    total_long = len(long_) + sum(d > 2 * median for d in without)
    mean = statistics.fmean
    return [f"  {len(with_prompts)} steps admitted prompts (new tokens p50 {statistics.median(tokens):.0f}): "
            f"{mean(with_prompts) * 1000:.2f} ms a step on average, {mean(without or [0]) * 1000:.2f} ms without; "
            f"{len(long_)} of the {total_long} steps over twice the median admitted"]


def router_summary(label: str, events: list) -> list[str]:
    asked, waits = {}, []
    for t, kind, *fields in events:
        if kind == "request":
            asked[(fields[0], fields[1])] = t
        elif kind == "grant" and (t0 := asked.pop((fields[0], fields[4]), None)) is not None:
            waits.append(t - t0)
    if not waits:
        return [f"{label}: no lease granted"]
    waits.sort()
    lines = [f"{label}: {len(waits)} leases; a request waited for its lease p50 "
             f"{statistics.median(waits) * 1000:.2f} ms, p90 {waits[int(len(waits) * 0.9)] * 1000:.2f} ms, "
             f"max {waits[-1] * 1000:.1f} ms"]
    by_worker: dict[str, list[float]] = {}
    for t, kind, *fields in events:
        if kind == "tokens":
            by_worker.setdefault(fields[0], []).append(t)
    lines += [gap_line(f"  tokens of {name} forwarded", times) for name, times in sorted(by_worker.items())]
    return lines


def summarize_runs(directory: str | Path, report: str | Path) -> list[str]:
    """summarize() for each run of a `qmigrate bench serve --json` report, in its own window
    (the runs' `t0_monotonic` and `duration_s`: one host's clock, as the trace's)."""
    lines = []
    for k, run in enumerate(json.loads(Path(report).read_text())["runs"], 1):
        t0 = run.get("t0_monotonic")
        if t0 is None:
            raise ValueError(f"{report}: run {k} has no t0_monotonic (a report of an older bench serve)")
        lines.append(f"run {k} (rate {run.get('rate', '?')}): {run['duration_s']:.2f} s, "
                     f"{run['output_tok_per_s']:,.0f} tok/s")
        lines += ["  " + line for line in summarize(directory, (t0, t0 + run["duration_s"]))]
    return lines


if __name__ == "__main__":   # python -m qmigrate.ops.trace DIR [BENCH_SERVE_JSON]
    import sys
    print("\n".join(summarize_runs(*sys.argv[1:3]) if len(sys.argv) > 2 else summarize(sys.argv[1])))
