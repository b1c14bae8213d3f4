"""`qmigrate bench`: one workload, three paths, measured side by side in one run.

- pipeline:   a router and N worker processes over ZeroMQ. This process submits every
              request at time 0 the way ingest does, and receives tokens on the
              detokenizer's socket, where it timestamps them (bench/pipeline.py).
- in-process: the same engine through the offline API (`qmigrate.LLM`), its
              continuous-batching loop in this process: no router, no sockets.
- hf-static:  transformers `generate()` in static batches (left-padded, each batch run
              to its longest output), the baseline docs/benchmarks.md describes.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qmigrate.bench.pipeline import PIPELINE_LINKS, run_pipeline
from qmigrate.bench.timeline import PathResult, Progress, Timeline, free, frozen_heap, sync


@dataclass(slots=True)
class Workload:
    num_requests: int = 256
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (32, 512)
    vocab: tuple[int, int] = (10, 31000)
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        """(prompt ids, output length) per request, drawn as docs/benchmarks.md (mixed-256) specifies."""
        r = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            n_prompt = r.randint(*self.prompt_len)
            n_out = r.randint(*self.output_len)
            out.append(([r.randint(*self.vocab) for _ in range(n_prompt)], n_out))
        return out


# --- the engine alone ------------------------------------------------------------------

def run_inprocess(model_path: str, device: str, dtype: str, requests, max_seqs: int,
                  max_tokens: int, profile: bool = False, runner: str = "auto",
                  worker_overrides: dict | None = None, load_format: str = "auto") -> PathResult:
    """The engine alone, through the offline API (`qmigrate.LLM`), with the pipeline workers'
    settings (so the two paths schedule prefill alike). EOS is ignored: outputs have the
    workload's lengths."""
    from qmigrate.offline.llm import LLM
    from qmigrate.offline.params import SamplingParams
    llm = LLM(model_path, dtype=dtype, load_format=load_format,
              **{"device": device, "runner": runner, "max_num_seqs": max_seqs, "max_num_batched_tokens": max_tokens,
                 **(worker_overrides or {})})
    print(f"  in-process: {llm.engine.describe()}", file=sys.stderr)
    lengths = [n for _, n in requests]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
    progress = Progress("in-process", sum(lengths))
    watch = _StepWatch(device, profile)
    timeline = Timeline(lengths, 0.0)

    def on_step(got: list[int]) -> None:
        now = time.monotonic()
        if not timeline.t0:   # the requests are checked: the run starts (the pipeline's checks none)
            timeline.t0 = now
            return
        for i in got:
            timeline.add(i, 1, now)
        progress.update(sum(timeline.count))
        watch.after_step(len(got))
    with frozen_heap():
        llm.generate([p for p, _ in requests], params, on_step=on_step)
        sync(device)
        end = time.monotonic()
    progress.close()
    del llm
    free(device)
    return timeline.result("in-process", end)


class _StepWatch:
    """With `profile`, the 40th step under the torch profiler (from the collect of the step
    before it to its own, a step launched behind it included); prints where its time goes."""

    def __init__(self, device: str, profile: bool):
        self.device, self.profile, self.num_steps, self.prof, self.t0 = device, profile, 0, None, 0.0

    def after_step(self, num_rows: int) -> None:
        self.num_steps += 1
        if not self.profile:
            return
        if self.num_steps == 39:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.startswith("cuda") else [])
            sync(self.device)
            self.prof, self.t0 = profile(activities=activities), time.monotonic()
            self.prof.start()
        elif self.num_steps == 40 and self.prof is not None:
            sync(self.device)
            self.prof.stop()
            wall = time.monotonic() - self.t0
            key = "cuda_time_total" if self.device.startswith("cuda") else "cpu_time_total"
            print(f"profiled step: {num_rows} rows, {wall * 1000:.1f} ms wall", file=sys.stderr)
            print(self.prof.key_averages().table(sort_by=key, row_limit=18), file=sys.stderr)
            self.prof = None


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
        sync(device)
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
            sync(device)
            ttft += [time.monotonic() - t0] * len(batch)  # nothing streams: tokens land per batch
            done += sum(n for _, n in batch)
            progress.update(done)
        seconds = time.monotonic() - t0
        progress.close()
    del model
    free(device)
    return PathResult("hf-static", seconds, sum(lengths), ttft, [])


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
        results.append(run_transformers_cb(model_path, devices[0], dtype, requests, load_format, max_tokens))
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
