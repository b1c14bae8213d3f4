"""`qmigrate bench`: one workload, three paths, measured side by side in one run.

- pipeline:   a router and N worker processes over ZeroMQ. This process submits every
              request at time 0 the way ingest does, and receives tokens on the
              detokenizer's socket, where it timestamps them (bench/pipeline.py).
- in-process: the same engine driven by a plain continuous-batching loop in this
              process: no router, no sockets.
- hf-static:  transformers `generate()` in static batches (left-padded, each batch run
              to its longest output), the baseline of shared/BENCHMARK.md.

Useful tokens are the requested ones only; EOS is ignored everywhere.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import random
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class Workload:
    num_requests: int = 256
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 512)
    vocab: tuple[int, int] = (10, 31000)
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt ids, output length) per request, drawn as shared/BENCHMARK.md specifies."""
        r = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n_prompt = r.randint(*self.prompt_len)
            n_out = r.randint(*self.output_len)
            out.append(([r.randint(*self.vocab) for _ in range(n_prompt)], n_out))
        return out


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


# --- the engine alone ------------------------------------------------------------------

def run_inprocess(model_path: str, device: str, dtype: str, requests, max_seqs: int,
                  max_tokens: int, profile: bool = False, runner: str = "auto",
                  worker_overrides: dict | None = None, load_format: str = "auto") -> PathResult:
    """The engine alone, with the pipeline workers' limits on the prompt tokens of a step (so
    the two paths schedule prefill alike)."""
    from qmigrate.config import WorkerConfig
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.engine import Engine
    worker = WorkerConfig(**(worker_overrides or {}))
    model, _ = load_model(model_path, device, dtype, load_format=load_format)
    engine = Engine(model, max_batch=max_seqs, max_batch_tokens=max_tokens, runner=runner,
                    prefill_tokens_per_step=worker.prefill_tokens_per_step,
                    prefill_tokens_with_decode=worker.prefill_tokens_with_decode,
                    prefill_spread_steps=worker.prefill_spread_steps)
    del model
    print(f"  in-process: {engine.describe()}", file=sys.stderr)
    engine.warm_up()
    with frozen_heap():
        result = _inprocess_loop(engine, requests, max_seqs, max_tokens, profile, device)
    del engine
    _free(device)
    return result


def _inprocess_loop(engine, requests, max_seqs: int, max_tokens: int, profile: bool, device: str) -> PathResult:
    from qmigrate.engine.rows import REFUSED, StepRow
    lengths = [n for _, n in requests]
    waiting = deque(range(len(requests)))
    # The step in flight, and per sequence the row of its next step. Step N+1 is built and
    # launched before step N's tokens are collected: a running row feeds the token its
    # previous step samples without that token passing through the host.
    pending = None
    running: dict[int, StepRow] = {}
    progress = Progress("in-process", sum(lengths))
    timeline = Timeline(lengths, time.monotonic())
    num_steps = 0
    while waiting or running or pending is not None:
        rows = list(running.values())
        budget = max_tokens - sum(max(1, len(r.new_ids)) for r in rows)
        while waiting and len(rows) < max_seqs and (len(requests[waiting[0]][0]) <= budget or not rows):
            i = waiting.popleft()
            budget -= len(requests[i][0])
            rows.append(StepRow(i, requests[i][0], 0, 0))
        num_steps += 1
        if profile and num_steps == 40 and pending is not None:
            known = dict(zip((r.seq_id for r in pending.rows), engine.collect(pending)))
            rows = [StepRow(r.seq_id, r.new_ids or [known[r.seq_id]], r.start, r.index) for r in rows]
            _profiled(engine, rows, device)
        nxt = engine.launch(rows, after=pending) if rows else None
        running = {}
        for row in rows:
            if row.seq_id in nxt.partial:   # its prompt goes on in the next step
                start = max(0, engine.cached_len(row.seq_id))
                running[row.seq_id] = StepRow(row.seq_id, requests[row.seq_id][0][start:], start, 0)
            elif row.index + 1 < lengths[row.seq_id]:
                running[row.seq_id] = StepRow(row.seq_id, [], row.start + max(1, len(row.new_ids)), row.index + 1)
            else:
                engine.release(row.seq_id)  # its last step is queued on the device before any reuse
        if pending is not None:
            tokens = engine.collect(pending)
            if any(t == REFUSED and r.seq_id not in pending.partial for r, t in zip(pending.rows, tokens)):
                raise RuntimeError("the in-process benchmark ran out of KV blocks")
            now = time.monotonic()
            for row in pending.rows:
                if row.seq_id not in pending.partial:
                    timeline.add(row.seq_id, 1, now)
            progress.update(sum(timeline.count))
        pending = nxt
    _sync(device)
    progress.close()
    return timeline.result("in-process", time.monotonic())


def _profiled(engine, rows, device: str) -> list[int]:
    """One step under the torch profiler; prints where its time goes."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    _sync(device)
    t0 = time.monotonic()
    with profile(activities=activities) as prof:
        tokens = engine.step(rows)
        _sync(device)
    wall = time.monotonic() - t0
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    print(f"profiled step: {len(rows)} rows, {sum(len(r.new_ids) for r in rows)} new tokens, "
          f"{wall * 1000:.1f} ms wall", file=sys.stderr)
    print(prof.key_averages().table(sort_by=key, row_limit=18), file=sys.stderr)
    return tokens


# --- transformers generate, static batches ---------------------------------------------

def run_hf_static(model_path: str, device: str, dtype: str, requests, batch_size: int,
                  load_format: str = "auto") -> PathResult:
    import torch
    from qmigrate.hub.loading import load_model
    model, tokenizer = load_model(model_path, device, dtype, load_format=load_format)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lengths = [n for _, n in requests]
    progress = Progress("hf-static", sum(lengths))
    ttft = []
    with torch.inference_mode():
        model.generate(torch.tensor([[10, 11, 12]], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad)  # warm-up
        _sync(device)
        t0 = time.monotonic()
        done = 0
        for start in range(0, len(requests), batch_size):
            batch = requests[start:start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt):] = torch.tensor(prompt)
                mask[row, width - len(prompt):] = 1
            longest = max(n for _, n in batch)
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad)
            _sync(device)
            ttft += [time.monotonic() - t0] * len(batch)  # nothing streams: tokens land per batch
            done += sum(n for _, n in batch)
            progress.update(done)
        seconds = time.monotonic() - t0
        progress.close()
    del model
    _free(device)
    return PathResult("hf-static", seconds, sum(lengths), ttft, [])


# --- helpers -----------------------------------------------------------------------------

def _sync(device: str) -> None:
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


def _free(device: str) -> None:
    import gc
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


def machine_info(device: str) -> dict:
    import torch
    import transformers
    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
        try:
            import pynvml
            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001 -- the driver version is a nicety
            pass
    return info


def format_table(results: list[PathResult]) -> str:
    base = next((r for r in results if r.name == "hf-static"), None)
    lines = [f"{'path':14} {'tok/s':>10} {'vs HF':>7} {'TTFT p50/p99 s':>16} {'TPOT p50/p99 ms':>17}  migrations"]
    for r in results:
        s = r.summary()
        ratio = f"{r.tok_per_s / base.tok_per_s:6.2f}x" if base and base.tok_per_s else "      -"
        ttft = f"{s['ttft_p50_s']:.2f}/{s['ttft_p99_s']:.2f}" if s["ttft_p50_s"] is not None else "-"
        tpot = f"{s['tpot_p50_ms']:.1f}/{s['tpot_p99_ms']:.1f}" if s["tpot_p50_ms"] is not None else "-"
        moves = ", ".join(f"{k} {v}" for k, v in sorted(r.migrations.items())) or "-"
        lines.append(f"{r.name:14} {r.tok_per_s:10,.0f} {ratio:>7} {ttft:>16} {tpot:>17}  {moves}")
    rates: dict[str, list[float]] = {}
    for r in results:
        rates.setdefault(r.name, []).append(r.tok_per_s)
    if rates.get("pipeline") and rates.get("in-process"):
        ratios = [p / i for p, i in zip(rates["pipeline"], rates["in-process"]) if i]
        each = ", ".join(f"{x:.3f}" for x in ratios)
        lines.append(f"pipeline / in-process = {float(np.median(ratios)):.3f}"
                     + (f" (median of runs: {each})" if len(ratios) > 1 else ""))
    if rates.get("pipeline-tcp") and rates.get("pipeline-curve"):
        ratios = [c / t for c, t in zip(rates["pipeline-curve"], rates["pipeline-tcp"]) if t]
        each = ", ".join(f"{x:.3f}" for x in ratios)
        lines.append(f"curve / plain tcp = {float(np.median(ratios)):.3f}"
                     + (f" (median of runs: {each})" if len(ratios) > 1 else ""))
    return "\n".join(lines)


def run_bench(*, model_path: str, devices: list[str], dtype: str, workload: Workload, paths: list[str],
              max_seqs: int, max_tokens: int, hf_batch: int, router_overrides: dict,
              json_path: Path | None, log_level: str = "warning", profile: bool = False,
              steps_per_dispatch: int = 1, repeat: int = 1, runner: str = "auto",
              faults: bool = False, trace_dir: Path | None = None,
              worker_overrides: dict | None = None, load_format: str = "auto") -> list[PathResult]:
    """`workload`: anything whose requests() gives (prompt ids, output length) per request
    (Workload, or bench/sharegpt.py's ShareGPTWorkload)."""
    requests = workload.requests()
    total = sum(n for _, n in requests)
    prompts = [len(p) for p, _ in requests]
    print(f"workload: {len(requests)} requests, prompts {min(prompts)}-{max(prompts)} ids, "
          f"{total:,} output tokens; model {model_path}; workers {devices}", file=sys.stderr)
    results = []
    link = None
    if "pipeline-curve" in paths:
        from qmigrate.bench.link import link_table
        link = link_table()
        print(link[0])
    from qmigrate.bench.pipeline import PIPELINE_LINKS, run_pipeline
    for attempt in range(repeat):  # interleaved, so drift hits both paths alike
        for name in PIPELINE_LINKS:
            if name in paths:
                trace = trace_dir / f"{name}-{attempt + 1}" if trace_dir is not None else None
                results.append(run_pipeline(model_path, devices, dtype, requests, max_seqs, max_tokens,
                                            router_overrides, log_level, steps_per_dispatch, runner, name,
                                            faults=faults, trace_dir=trace, worker_overrides=worker_overrides,
                                            load_format=load_format))
        if "in-process" in paths:
            results.append(run_inprocess(model_path, devices[0], dtype, requests, max_seqs, max_tokens,
                                         profile and attempt == 0, runner, worker_overrides, load_format))
    if "transformers-cb" in paths:
        from qmigrate.bench.peer import run_transformers_cb
        results.append(run_transformers_cb(model_path, devices[0], dtype, requests, load_format))
    if "hf-static" in paths:
        results.append(run_hf_static(model_path, devices[0], dtype, requests, hf_batch, load_format))
    table = format_table(results)
    print(table)
    if json_path is not None:
        report = {"workload": dataclasses.asdict(workload) | {"output_tokens": total, "requests": len(requests)},
                  "load_format": load_format,
                  "machine": machine_info(devices[0]), "workers": devices, "max_seqs": max_seqs,
                  "max_tokens": max_tokens, "model": model_path, "steps_per_dispatch": steps_per_dispatch,
                  "worker_settings": worker_overrides or {}, "runs": [{"path": r.name, **r.summary()} for r in results], "table": table}
        if link is not None:
            report.update(link_round_trips=link[1], link_table=link[0])
        json_path.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return results
