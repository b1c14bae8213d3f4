"""`qmigrate bench admission-step`: what admitting a prompt into running decode rows costs
them, whole and under the worker's `prefill_tokens_with_decode`.

For each batch size: prefill every row to the context, then time whole steps (a device
synchronize on both ends, as `bench decode-step` does) of
- `decode`: the decode rows alone;
- `whole`: the decode rows plus one new prompt of `prompt_len` tokens, the limit off;
- `limited`: the same admission under the limit, every step from the first part of the prompt
  to the step of its last part (which samples its first token). Its longest step is what a
  running stream waits between two tokens while the prompt is admitted; `steps` is how many
  steps the prompt takes, which its first token waits for.
The decode rows rewrite the same position each step; every admission is a fresh prompt, so
the prefix cache finds nothing. Runs on the CPU too (figures there say only that it works).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

REPEATS = 3   # admissions timed per figure, after one that warms up; the median is reported


def run_admission_steps(model_path: str, device: str, batches: list[int], context: int, prompt_len: int,
                        worker: dict, json_path: Path | None = None) -> list[dict]:
    """`worker`: WorkerConfig fields (from --worker-setting); the engine is built from them,
    with rows for the largest batch and the new prompt."""
    from qmigrate.config import WorkerConfig
    from qmigrate.hub.loading import load_model
    from qmigrate.engine.rows import StepRow
    from qmigrate.engine.engine import Engine
    cfg = WorkerConfig(**{**worker, "max_num_seqs": max(batches) + 1}).engine_config()
    limit = cfg.prefill_tokens_with_decode
    model, _ = load_model(model_path, device, "auto")
    engine = Engine(model, cfg)
    del model
    if context + 2 > engine.max_len or prompt_len + 1 > engine.max_len:
        raise ValueError(f"context {context} and prompt {prompt_len} must fit the model's {engine.max_len} positions")
    print(engine.describe(), file=sys.stderr)
    engine.warm_up()
    r = random.Random(0)
    results = []
    for batch in batches:
        ids = {i: [r.randint(10, 1000) for _ in range(context - 1)] for i in range(batch)}
        per_step = max(1, cfg.max_num_batched_tokens // (context - 1))
        for first in range(0, batch, per_step):   # prompts alone: no limit applies
            rows = [StepRow(i, ids[i], 0, 0) for i in range(first, min(batch, first + per_step))]
            for row, token in zip(rows, engine.step(rows)):
                ids[row.seq_id].append(token)
        decode = [StepRow(i, [ids[i][-1]], context - 1, 1) for i in range(batch)]
        decode_ms = _median([_timed(engine, device, decode)[0] for _ in range(REPEATS + 2)][2:])
        whole, limited = [], []
        for k in range(REPEATS + 1):
            for limit_now, out in ((0, whole), (limit, limited)):
                engine.set_prompt_limits(prefill_tokens_with_decode=limit_now)
                prompt = [r.randint(10, 1000) for _ in range(prompt_len)]
                times = _admit(engine, device, decode, StepRow(batch, prompt, 0, 0))
                if k:
                    out.append(times)
        engine.set_prompt_limits(prefill_tokens_with_decode=limit)
        for i in range(batch):
            engine.release(i)
        whole_ms = _median([max(t) for t in whole])
        max_ms = _median([max(t) for t in limited])
        results.append({"batch": batch, "context": context, "prompt_len": prompt_len, "limit": limit,
                        "decode_ms": decode_ms, "whole_ms": whole_ms, "limited_max_ms": max_ms,
                        "limited_steps": len(limited[0]), "whole_x_decode": whole_ms / decode_ms,
                        "limited_x_decode": max_ms / decode_ms})
    print(f"a prompt of {prompt_len} tokens admitted into decode rows at context {context}, {engine.runner.name} "
          f"runner: whole, and under prefill_tokens_with_decode={limit} (its longest step, and the steps it "
          f"takes to its first token)")
    lines = [f"{'batch':>5} {'decode ms':>9} {'whole ms':>9} {'x decode':>8} {'limited max':>11} {'x decode':>8}"
             f" {'steps':>5}"]
    lines += [f"{x['batch']:5d} {x['decode_ms']:9.2f} {x['whole_ms']:9.2f} {x['whole_x_decode']:8.2f} "
              f"{x['limited_max_ms']:11.2f} {x['limited_x_decode']:8.2f} {x['limited_steps']:5d}" for x in results]
    print("\n".join(lines))
    if json_path is not None:
        json_path.write_text(json.dumps({"runner": engine.runner.name, "describe": engine.describe(),
                                         "results": results}, indent=2))
    return results


def _admit(engine, device: str, decode: list, row) -> list[float]:
    """Whole-step ms of every step from the prompt row's first part to its last."""
    from qmigrate.engine.rows import StepRow
    times = []
    while True:
        ms, pending = _timed(engine, device, decode + [row])
        times.append(ms)
        if row.seq_id not in pending.partial:
            break
        start = engine.cached_len(row.seq_id)
        row = StepRow(row.seq_id, row.new_ids[start - row.start:], start, 0)
    engine.release(row.seq_id)
    return times


def _timed(engine, device: str, rows: list) -> tuple[float, object]:
    from qmigrate.bench.timeline import sync
    sync(device)
    t0 = time.perf_counter()
    pending = engine.launch(rows)
    engine.collect(pending)
    sync(device)
    return (time.perf_counter() - t0) * 1000, pending


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
