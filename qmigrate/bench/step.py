"""`qmigrate bench decode-step`: the time of one decode step against the weight-read floor.

For each batch size: prefill every row to the context, warm up 3 steps, then time 20
decode steps with a device synchronize on both ends (the method docs/benchmarks.md gives). Three
figures per batch: `step`, the engine's whole step as a caller that waits for each step
sees it (host work, forward, sampling and the fetch of the sampled ids); `overlap`, the
same steps with step N+1 launched before step N is collected, as the worker and the
in-process loop run them; and `gpu`, 20 forwards queued back to back with no host work
between them, which is what the device itself needs per step. The
floor is the weight bytes over the device-to-device copy bandwidth measured in the same
process.

Two more figures price admitting a prompt into a running batch, as continuous batching does
whenever a request finishes while others wait: `mixed`, the whole step of the same decode
rows plus one new prompt of MIXED_PROMPT tokens, and `prefill`, a step of that prompt alone.
The engine takes one row more than the largest batch, as a worker whose `max_num_seqs` has room
for the new row would: otherwise the mixed step of the largest batch has more rows than the
runner's graphs and runs eagerly, which no worker does (its steps never pass `max_num_seqs`).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

MIXED_PROMPT = 256


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return nbytes / sorted(times)[len(times) // 2]


def run_decode_steps(model_path: str, device: str, batches: list[int], context: int, runner: str,
                     json_path: Path | None = None, profile: bool = False, load_format: str = "auto",
                     settings: dict | None = None, admission: bool = True) -> list[dict]:
    """`settings`: engine settings beside the bench's own (quantization, kv_cache_dtype);
    `admission` False skips the mixed and prefill steps (their figures are then NaN)."""
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    model, _ = load_model(model_path, device, "auto", load_format=load_format)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = Engine(model, max_num_seqs=max(batches) + 1, max_num_batched_tokens=16384, runner=runner,
                    own_model=True, **(settings or {}))
    del model
    if engine.config.quantization != "none":   # the floor reads the weights as the runner holds them
        weight_bytes = held_bytes(engine.runner.model)
    bandwidth = copy_bandwidth(device)
    floor_ms = weight_bytes / bandwidth * 1000
    print(f"{engine.describe()}; weights {weight_bytes / 1e9:.2f} GB, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s, floor {floor_ms:.3f} ms", file=sys.stderr)
    step_bytes = _step_bytes(engine, weight_bytes)
    r = random.Random(0)
    results = []
    for batch in batches:
        ids = {i: [r.randint(10, 31000) for _ in range(context - 1)] for i in range(batch)}
        per_step = max(1, 16384 // (context - 1))
        for first in range(0, batch, per_step):   # prefill in chunks of the step budget
            rows = [StepRow(i, ids[i], 0, 0) for i in range(first, min(batch, first + per_step))]
            for row, token in zip(rows, engine.step(rows)):
                ids[row.seq_id].append(token)
        pos = context - 1

        def rows_now():
            return [StepRow(i, [ids[i][-1]], pos, 1) for i in range(batch)]

        for _ in range(3):
            rows = rows_now()
            for row, token in zip(rows, engine.step(rows)):
                ids[row.seq_id].append(token)
            pos += 1
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(20):
            tokens = engine.step(rows_now())
            for i, token in enumerate(tokens):
                ids[i].append(token)
            pos += 1
        torch.cuda.synchronize(device)
        step_ms = (time.perf_counter() - t0) / 20 * 1000
        # overlapped: step N+1 is launched (fed on the device) before step N is collected
        pending = engine.launch(rows_now())
        pos += 1
        t0 = time.perf_counter()
        for _ in range(20):
            nxt = engine.launch([StepRow(i, [], pos, 1) for i in range(batch)], after=pending)
            engine.collect(pending)
            pending, pos = nxt, pos + 1
        engine.collect(pending)
        torch.cuda.synchronize(device)
        overlap_ms = (time.perf_counter() - t0) / 21 * 1000
        for i, token in enumerate(engine.collect(pending)):
            ids[i].append(token)
        # the device alone: the same decode batch, forwards queued without a host sync
        gpu_ms, decode = _device_ms(engine, rows_now(), device, 20)
        if profile and batch == 64:
            _profile_forward(engine, decode, device)
        mixed_ms = prefill_ms = mixed_gpu_ms = float("nan")
        if admission:
            mixed_ms, prefill_ms = _admission_steps(engine, device, batch, rows_now, r)
            mixed_gpu_ms = _mixed_device_ms(engine, device, batch, rows_now, r,
                                            profile and batch == max(batches))
        for i in range(batch):
            engine.release(i)
        # the roofline: the weights the step reads and every row's KV of the context
        kv_bytes = engine.kv_bytes_per_token * context * batch
        weight_floor_ms = step_bytes(batch) / bandwidth * 1000
        floor_ms = (step_bytes(batch) + kv_bytes) / bandwidth * 1000
        results.append({"batch": batch, "read_bytes": step_bytes(batch), "kv_bytes": kv_bytes,
                        "weight_floor_ms": weight_floor_ms, "context": context, "step_ms": step_ms, "overlap_ms": overlap_ms,
                        "overlap_x_floor": overlap_ms / floor_ms, "gpu_ms": gpu_ms,
                        "floor_ms": floor_ms, "step_x_floor": step_ms / floor_ms,
                        "gpu_x_floor": gpu_ms / floor_ms, "mixed_ms": mixed_ms, "prefill_ms": prefill_ms,
                        "mixed_gpu_ms": mixed_gpu_ms,
                        "mixed_prompt": MIXED_PROMPT})
    lines = [f"{'batch':>5} {'floor ms':>8} {'step ms':>8} {'x floor':>8} {'overlap':>8} {'x floor':>8}"
             f" {'gpu ms':>8} {'x floor':>8}"
             f" {'mixed':>8} {'mix gpu':>8} {'prefill':>8}"]
    lines += [f"{x['batch']:5d} {x['floor_ms']:8.3f} {x['step_ms']:8.2f} {x['step_x_floor']:8.1f} "
              f"{x['overlap_ms']:8.2f} "
              f"{x['overlap_x_floor']:8.1f} {x['gpu_ms']:8.2f} {x['gpu_x_floor']:8.1f} "
              f"{x['mixed_ms']:8.2f} {x['mixed_gpu_ms']:8.2f} {x['prefill_ms']:8.2f}" for x in results]
    floors = sorted({round(x["floor_ms"], 3) for x in results})
    floor_text = f"{floors[0]:.3f} ms" if len(floors) == 1 else f"{floors[0]:.3f}-{floors[-1]:.3f} ms by batch"
    print(f"decode step, context {context}, {engine.runner.name} runner, floor (weights and KV read) {floor_text}; "
          f"mixed: the same step with a new prompt of {MIXED_PROMPT} tokens (mix gpu: its forwards queued back to "
          f"back), prefill: that prompt alone")
    print("\n".join(lines))
    if json_path is not None:
        json_path.write_text(json.dumps({"runner": engine.runner.name, "describe": engine.describe(),
                                         "weight_bytes": weight_bytes, "copy_bytes_per_s": bandwidth,
                                         "results": results}, indent=2))
    return results


def held_bytes(model) -> int:
    """Bytes of every tensor a fast-runner model holds (each storage once)."""
    from qmigrate.engine.models.base import held_storages
    return sum(held_storages(model).values())


def compare_decode_steps(model_path: str, device: str, batches: list[int], context: int, runner: str,
                         variants: list[dict], json_path: Path | None = None, load_format: str = "auto") -> list:
    """run_decode_steps once per variant of the engine settings (decode steps only), in this
    process one after the other, then each variant's device ms against the first's and against
    its own floor."""
    import gc
    runs = []
    for settings in variants:
        print(f"--- {_name(settings)}", file=sys.stderr)
        runs.append(run_decode_steps(model_path, device, batches, context, runner, None, False, load_format,
                                     settings, admission=False))
        gc.collect()
        torch.cuda.empty_cache()
    base = runs[0]
    print(f"decode step (gpu ms, device alone), context {context}: each variant against {_name(variants[0])}")
    print(f"{'variant':>28} {'batch':>5} {'gpu ms':>8} {'speedup':>8} {'floor ms':>8} {'x floor':>8}")
    for settings, results in zip(variants, runs):
        for x, b in zip(results, base):
            print(f"{_name(settings):>28} {x['batch']:5d} {x['gpu_ms']:8.2f} {b['gpu_ms'] / x['gpu_ms']:8.2f} "
                  f"{x['floor_ms']:8.3f} {x['gpu_x_floor']:8.2f}")
    if json_path is not None:
        json_path.write_text(json.dumps([{"settings": v, "results": r} for v, r in zip(variants, runs)], indent=2))
    return runs


def setting_variants(quantization: str, kv_cache_dtype: str) -> list[dict]:
    """Every combination of the comma-separated values, as engine settings (defaults left out)."""
    from qmigrate.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS
    quants, kv_dtypes = quantization.split(","), kv_cache_dtype.split(",")
    for flag, values, allowed in (("--quantization", quants, QUANTIZATIONS),
                                  ("--kv-cache-dtype", kv_dtypes, KV_CACHE_DTYPES)):
        if any(v not in allowed for v in values):
            raise ValueError(f"{flag} takes {' or '.join(allowed)} (comma-separated for several), "
                             f"got {','.join(values)!r}")
    return [{k: v for k, v in (("quantization", q), ("kv_cache_dtype", d)) if v not in ("none", "auto")}
            for q in quants for d in kv_dtypes]


def _name(settings: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items()) or "defaults"


def _step_bytes(engine, weight_bytes: int):
    """batch -> the weight bytes a decode step of that many rows reads: all of them for a dense
    model; for a mixture of experts on the fast runner, the dense weights and the experts the
    batch is expected to hit (models/moe.py, uniform routing)."""
    from qmigrate.engine.layers.moe import MoE
    model = getattr(engine.runner, "model", None)
    if model is None or not any(isinstance(layer.mlp, MoE) for layer in model.layers):
        return lambda batch: weight_bytes
    from qmigrate.engine.models.moe import active_weight_bytes
    return lambda batch: active_weight_bytes(model, batch)[0]


def _admission_steps(engine, device: str, batch: int, rows_now, r: random.Random,
                     num_steps: int = 10) -> tuple[float, float]:
    """(mixed, prefill) step ms: the decode rows plus one new prompt, and the prompt alone."""
    from qmigrate.engine.rows import StepRow
    new_id = batch  # a seq id no decode row uses
    prompt = [r.randint(10, 31000) for _ in range(MIXED_PROMPT)]
    times = {"mixed": [], "prefill": []}
    for i in range(num_steps + 2):  # the first two warm up
        for kind in times:
            rows = (rows_now() if kind == "mixed" else []) + [StepRow(new_id, prompt, 0, 0)]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            engine.step(rows)  # the decode rows rewrite the same position each time
            torch.cuda.synchronize(device)
            if i >= 2:
                times[kind].append(time.perf_counter() - t0)
            engine.release(new_id)
    return tuple(sorted(t)[len(t) // 2] * 1000 for t in times.values())


def _mixed_device_ms(engine, device: str, batch: int, rows_now, r: random.Random, profile: bool,
                     num_steps: int = 10) -> float:
    """Device ms of the mixed step's forward alone, as `gpu` is for the decode step."""
    from qmigrate.engine.rows import StepRow
    rows = rows_now() + [StepRow(batch, [r.randint(10, 31000) for _ in range(MIXED_PROMPT)], 0, 0)]
    ms, mixed = _device_ms(engine, rows, device, num_steps)
    if profile:
        _profile_forward(engine, mixed, device, "mixed")
    engine.release(batch)
    return ms


def _device_ms(engine, rows, device: str, num_steps: int):
    """Device ms of a step's forward alone: `rows` placed, then forwards queued with no host
    sync between them (each rewrites the same KV positions). Returns (ms, the step's batch)."""
    from qmigrate.engine.batch import StepBatch
    engine.place(rows)
    batch = StepBatch.build(engine.pool, [x.seq_id for x in rows], [x.new_ids for x in rows],
                            [x.start for x in rows])
    with torch.inference_mode():
        engine.runner.forward(batch)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.runner.forward(batch).argmax(-1)
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / num_steps * 1000, batch


def _profile_forward(engine, decode, device: str, what: str = "decode") -> None:
    """Where one forward's device time goes, by kernel."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.runner.forward(decode)
        torch.cuda.synchronize(device)
    print(f"profile: 5 {what} forwards of {decode.num_rows} rows", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
          file=sys.stderr)
